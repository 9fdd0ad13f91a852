"""PEFT export / import of one adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

Export is exact at the same rank: the fused linears' A is duplicated into q/k/v (gate/up) and B is split
in Megatron's interleaved GQA layout. Tensors are gathered over TP and PP to global rank 0, which writes
to a temporary directory and renames it into place (an existing export is replaced only when the new
one is complete). Import accepts a PEFT LoRA adapter only when it is exactly representable: q/k/v
(gate/up) targeted together with identical A and the same rank.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from lorafusion.core.errors import ConfigError, MissingFileError
from lorafusion.core.lora import LoRASpec
from lorafusion.layers.inject import add_adapter, get_lora_context, lora_modules
from lorafusion.core.targets import PEFT_GROUPS, resolve_target_modules, to_peft_target_modules
from lorafusion.models.layout import column_shard, column_unshard, qkv_merge, qkv_split, shard
from lorafusion.core.arch import ModelArch

_PARENT = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp", "linear_fc2": "mlp"}
_PREFIX = "base_model.model.model.layers"


def _peft_key(layer: int, peft_module: str, kind: str, ab: str) -> str:
    return f"{_PREFIX}.{layer}.{_PARENT[kind]}.{peft_module}.lora_{ab}.weight"


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gather_tp(t: torch.Tensor, dim_kind: str, kind: str) -> torch.Tensor:
    """Full tensor from TP shards. dim_kind: "col" (rows sharded like a column-parallel W), "row_in"
    (dim 1 sharded like a row-parallel W) or "rep" (replicated)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or dim_kind == "rep":
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return column_unshard(kind, parts) if dim_kind == "col" else torch.cat(parts, dim=1)


def adapter_peft_state(model, name: str, arch: ModelArch, grad: bool = False) -> dict[str, torch.Tensor] | None:
    """PEFT-keyed fp32 tensors of adapter ``name`` (its weights, or with ``grad`` their gradients mapped
    the same way; a fused linear's dA then stands for each projection's share summed); the full dict on
    global rank 0, None elsewhere."""
    ctx = get_lora_context(model)
    if name not in ctx.specs:
        raise KeyError(f"adapter {name!r} is not on the model (adapters: {sorted(ctx.specs)})")
    local: dict[str, torch.Tensor] = {}
    for key, mod in lora_modules(model):
        if name not in mod.lora_A:
            continue
        layer, kind = int(key.split(".")[0]) - 1, mod.lora_kind
        pa, pb = mod.lora_A[name], mod.lora_B[name]
        if grad:
            pa = pa.grad if pa.grad is not None else torch.zeros_like(pa)
            pb = pb.grad if pb.grad is not None else torch.zeros_like(pb)
        a, b = pa.detach().float(), pb.detach().float()
        if kind in ("linear_qkv", "linear_fc1"):
            b = _gather_tp(b, "col", kind)
        else:
            a = _gather_tp(a, "row_in", kind)
        if kind == "linear_qkv":
            bs = qkv_split(b, arch)
        elif kind == "linear_fc1":
            bs = b.chunk(2, dim=0)
        else:
            bs = (b,)
        for peft_module, b_part in zip(PEFT_GROUPS[kind], bs, strict=True):
            local[_peft_key(layer, peft_module, kind, "A")] = a.cpu().clone()
            local[_peft_key(layer, peft_module, kind, "B")] = b_part.cpu().contiguous().clone()
    if not _dist():
        return local
    # One copy per pipeline stage is enough: gather from TP rank 0 of DP rank 0 of every stage.
    gathered = [None] * dist.get_world_size()
    send = local if (parallel_state.get_tensor_model_parallel_rank() == 0
                     and parallel_state.get_data_parallel_rank() == 0) else {}
    dist.all_gather_object(gathered, send)
    if dist.get_rank() != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    for part in gathered:
        full.update(part)
    return full


def peft_adapter_config(spec: LoRASpec, base_model: str | None = None) -> dict:
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": spec.r, "lora_alpha": spec.lora_alpha, "lora_dropout": spec.lora_dropout,
        "target_modules": to_peft_target_modules(spec.target_modules), "use_rslora": spec.use_rslora,
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
        "use_dora": False, "lora_bias": False, "revision": None,
    }


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``; an OSError (full disk, ``ulimit -f``: EFBIG) names the file."""
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def write_dir_atomically(out_dir: str | Path, files: dict[str, callable]) -> Path:
    """Write ``files`` ({filename: writer(path)}) into a temporary sibling directory, then rename it to
    ``out_dir``; an existing ``out_dir`` is replaced only after the new one is complete."""
    def fill(tmp: Path) -> None:
        for fname, writer in files.items():
            writer(tmp / fname)

    return fill_dir_atomically(out_dir, fill)


def copier(src: str | Path):
    """A ``fill`` for :func:`fill_dir_atomically`: the files of directory ``src`` (an adapter) copied in."""
    files = [p for p in Path(src).iterdir() if p.is_file()]

    def fill(tmp: Path) -> None:
        for p in files:
            shutil.copyfile(p, tmp / p.name)

    return fill


def fill_dir_atomically(out_dir: str | Path, fill) -> Path:
    """``fill(tmp_dir)`` writes into a temporary sibling directory, which is then renamed to ``out_dir``;
    an existing ``out_dir`` is replaced only after the new one is complete."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        fill(tmp)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_peft_adapter(model, name: str, out_dir: str | Path, arch: ModelArch | None = None,
                        base_model: str | None = None) -> Path | None:
    """Write adapter ``name`` as a PEFT adapter directory (collective: call on every rank)."""
    snapshot = peft_adapter_snapshot(model, name, arch, base_model)
    return None if snapshot is None else write_peft_adapter(out_dir, *snapshot)


def peft_adapter_snapshot(model, name: str, arch: ModelArch | None = None,
                          base_model: str | None = None) -> tuple[dict[str, torch.Tensor], dict] | None:
    """Adapter ``name`` in host memory, ready for :func:`write_peft_adapter`: (PEFT-keyed fp32 tensors, its
    ``adapter_config.json``) on global rank 0, None elsewhere (collective)."""
    state = adapter_peft_state(model, name, arch or model_arch(model))
    if state is None:
        return None
    return state, peft_adapter_config(get_lora_context(model).specs[name], base_model)


def write_peft_adapter(out_dir: str | Path, state: dict[str, torch.Tensor], config: dict) -> Path:
    """Write a snapshot as a PEFT adapter directory, complete or absent (no collectives: any thread)."""
    return write_dir_atomically(out_dir, {
        "adapter_config.json": lambda p: p.write_text(json.dumps(config, indent=2) + "\n"),
        # serialised here, written by Python: a full disk or a file size limit is then an OSError naming the
        # file (safetensors' own writer raises SafetensorError, which the CLI cannot tell from a bug)
        "adapter_model.safetensors": lambda p: write_bytes(p, safetensors_bytes(state, metadata={"format": "pt"})),
    })


def model_arch(model) -> ModelArch:
    from lorafusion.layers.inject import _chunks, _unwrap

    arch = getattr(_unwrap(_chunks(model)[0]), "lorafusion_arch", None)
    if arch is None:
        raise ValueError("model has no architecture record: build it with lorafusion.models.provider.build_model")
    return arch


# ---------------------------------------------------------------------------------------------- import

def read_peft_adapter(path: str | Path) -> tuple[LoRASpec, dict[str, torch.Tensor]]:
    """Validate a PEFT adapter directory and return (spec, tensors with PEFT keys)."""
    path = Path(path)
    cfg_file, st_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_file.is_file():
        raise MissingFileError(f"{cfg_file}: missing (expected a PEFT adapter directory)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_file}: not valid JSON ({e})") from e
    if cfg.get("peft_type") != "LORA":
        raise ConfigError(f"{cfg_file}: peft_type: expected 'LORA', got {cfg.get('peft_type')!r}")
    for field, ok in (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False), ("lora_bias", False)):
        if cfg.get(field, ok) != ok:
            raise ConfigError(f"{cfg_file}: {field}: expected {ok!r}, got {cfg.get(field)!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            raise ConfigError(f"{cfg_file}: {field}: per-module ranks/alphas cannot be imported (expected empty)")
    for field in ("modules_to_save", "layers_to_transform", "layer_replication", "trainable_token_indices"):
        if cfg.get(field):
            raise ConfigError(f"{cfg_file}: {field}: expected null, got {cfg.get(field)!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        raise ConfigError(f"{cfg_file}: target_modules: a regex string cannot be mapped exactly; expected a list")
    try:
        spec = LoRASpec(r=cfg.get("r"), lora_alpha=cfg.get("lora_alpha"), lora_dropout=cfg.get("lora_dropout", 0.0),
                        target_modules=tuple(targets) if isinstance(targets, list) else targets,
                        use_rslora=bool(cfg.get("use_rslora", False)))
    except ValueError as e:
        raise ConfigError(f"{cfg_file}: {e}") from e
    if not st_file.is_file():
        raise MissingFileError(f"{st_file}: missing (only safetensors adapters are supported)")
    try:
        with safe_open(str(st_file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise ConfigError(f"{st_file}: not a readable safetensors file ({e})") from e
    return spec, tensors


def import_peft_adapter(model, name: str, path: str | Path, arch: ModelArch | None = None) -> LoRASpec:
    """Add adapter ``name`` to ``model`` with the weights of the PEFT adapter at ``path``."""
    arch = arch or model_arch(model)
    spec, tensors = read_peft_adapter(path)
    st_file = Path(path) / "adapter_model.safetensors"
    tensors = {k.replace(".lora_A.default.weight", ".lora_A.weight").replace(".lora_B.default.weight", ".lora_B.weight"): v
               for k, v in tensors.items()}
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    # Validate and map everything before touching the model.
    staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    used: set[str] = set()
    for key, mod in lora_modules(model):
        kind = key.split(".", 1)[1]
        if kind not in spec.target_modules:
            continue
        layer = int(key.split(".")[0]) - 1
        a_parts, b_parts = [], []
        for peft_module in PEFT_GROUPS[kind]:
            ka, kb = _peft_key(layer, peft_module, kind, "A"), _peft_key(layer, peft_module, kind, "B")
            for k in (ka, kb):
                if k not in tensors:
                    raise ConfigError(f"{st_file}: tensor {k!r} missing")
                used.add(k)
            a_parts.append(tensors[ka].float())
            b_parts.append(tensors[kb].float())
        a = a_parts[0]
        for other, peft_module in zip(a_parts[1:], PEFT_GROUPS[kind][1:], strict=True):
            if other.shape != a.shape or not torch.equal(other, a):
                raise ConfigError(
                    f"{st_file}: layer {layer} {peft_module}.lora_A differs from {PEFT_GROUPS[kind][0]}.lora_A; "
                    f"{'/'.join(PEFT_GROUPS[kind])} share one A in the fused {kind}, so this adapter has no "
                    f"exact representation")
        fin, fout = mod.full_in_out()
        if a.shape != (spec.r, fin):
            raise ConfigError(f"{st_file}: layer {layer} {kind} lora_A has shape {tuple(a.shape)}, expected {(spec.r, fin)}")
        b = qkv_merge(*b_parts, arch) if kind == "linear_qkv" else torch.cat(b_parts, 0)
        if b.shape != (fout, spec.r):
            raise ConfigError(f"{st_file}: layer {layer} {kind} lora_B has shape {tuple(b.shape)}, expected {(fout, spec.r)}")
        if kind in ("linear_qkv", "linear_fc1"):
            staged[key] = (a, column_shard(kind, b, tp, rank))
        else:
            staged[key] = (shard(a, 1, tp, rank), b)
    if not dist.is_initialized() or dist.get_world_size() == 1 or parallel_state.get_pipeline_model_parallel_world_size() == 1:
        extra = sorted(set(k for k in tensors if ".layers." in k) - used)
        if extra:
            raise ConfigError(f"{st_file}: tensors {extra[:3]}... target modules outside target_modules "
                             f"{to_peft_target_modules(spec.target_modules)}")
    add_adapter(model, name, spec)
    with torch.no_grad():
        for key, mod in lora_modules(model):
            if key in staged:
                a, b = staged[key]
                mod.lora_A[name].copy_(a)
                mod.lora_B[name].copy_(b)
    return spec




def run_jobs(src: Path) -> list[str]:
    """The jobs a run directory knows of (its adapters, checkpoints and summary)."""
    names = {p.name for d in ("adapters", "checkpoints") if (src / d).is_dir() for p in (src / d).iterdir()
             if p.is_dir() and not p.name.startswith(".")}
    try:
        names |= set(json.loads((src / "summary.json").read_text()).get("jobs", {}))
    except (OSError, json.JSONDecodeError, AttributeError):
        pass
    return sorted(names)


def find_adapter(src: Path, job: str, best: bool = False) -> tuple[Path, str]:
    """(PEFT adapter directory, what it is) of ``job`` in a run directory or one checkpoint step directory;
    ``best``: its best-eval checkpoint's (a run directory only)."""
    from lorafusion.checkpoint.format import best_checkpoint, latest_checkpoint, read_state

    if not src.is_dir():
        raise MissingFileError(f"{src}: no checkpoint or adapter of job {job!r}: no such directory (expected a run "
                               f"output_dir or a checkpoints/<job>/step_N directory)")
    if best:
        if (src / "state.json").is_file():
            raise ConfigError(f"{src}: --best takes a run output_dir, not one checkpoint directory")
        ckpt = best_checkpoint(src / "checkpoints" / job)
        if ckpt is None:
            known = run_jobs(src)
            raise MissingFileError(f"{src}: no best-eval checkpoint of job {job!r} " + (
                "(the job has no eval set — eval_dataset or eval_split — or was not evaluated yet)"
                if job in known else f"(unknown job; the run's jobs: {', '.join(known) or 'none'})"))
        state = json.loads((ckpt / "state.json").read_text())
        return ckpt / "adapter", (f"best-eval checkpoint, step {state.get('step')} (eval loss "
                                  f"{(state.get('eval') or {}).get('best')})")
    final = src / "adapters" / job
    status = None
    if (src / "summary.json").is_file():
        try:
            status = json.loads((src / "summary.json").read_text()).get("jobs", {}).get(job, {}).get("status")
        except (json.JSONDecodeError, AttributeError):
            status = None
    if (src / "adapter" / "adapter_config.json").is_file():  # one checkpoint step directory
        state = read_state(src) if (src / "state.json").is_file() else {}
        if state.get("job", job) != job:
            raise ConfigError(f"{src}: is a checkpoint of job {state['job']!r}, not of --job {job!r}")
        return src / "adapter", f"checkpoint at step {state.get('step', '?')}"
    if (final / "adapter_config.json").is_file() and status in (None, "done", "diverged", "cancelled",
                                                                 "early_stopped"):
        return final, {"diverged": "last finite state (the job diverged)", "cancelled": "adapter at its cancellation",
                       "early_stopped": "adapter at its early stop"}.get(status, "final adapter")
    if (src / "checkpoints" / job).is_dir():
        ckpt = latest_checkpoint(src / "checkpoints" / job)
        if ckpt is None:
            raise MissingFileError(f"{src / 'checkpoints' / job}: no complete checkpoint")
        return ckpt / "adapter", (f"latest checkpoint, step {int(ckpt.name.split('_')[-1])} (the job has not "
                                  f"finished)")
    known = run_jobs(src)
    if known:
        raise ConfigError(f"{src}: unknown job {job!r}; the run's jobs: {', '.join(known)}")
    raise MissingFileError(f"{src}: no checkpoint or adapter of job {job!r} (expected a run output_dir "
                           f"or a checkpoints/<job>/step_N directory)")


__all__ = ["adapter_peft_state", "copier", "export_peft_adapter", "fill_dir_atomically", "find_adapter", "import_peft_adapter",
           "peft_adapter_snapshot", "read_peft_adapter", "peft_adapter_config", "run_jobs", "write_dir_atomically",
           "write_peft_adapter", "resolve_target_modules"]

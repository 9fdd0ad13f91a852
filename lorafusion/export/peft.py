"""PEFT export / import of one adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

Export is exact: on a fused linear each projection's own A and B (its rows of the fused layout, Megatron's
interleaved GQA layout for q/k/v) become the PEFT tensors; with ``shared_fused_a`` the shared A is duplicated
into q/k/v (gate/up). Tensors are gathered over TP and PP to global rank 0, which writes to a temporary
directory and renames it into place (an existing export is replaced only when the new one is complete).
Import takes any PEFT LoRA adapter of LLaMA/Qwen2 (any subset of targets, rank, alpha, rsLoRA, bias none);
with ``shared_fused_a`` its q/k/v (gate/up) A must be identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from lorafusion.core.errors import ConfigError, MissingFileError
from lorafusion.core.lora import LoRASpec
from lorafusion.core.peft_config import COMPARED, read_peft_config
from lorafusion.layers.fused_proj import merge_rows, split_rows
from lorafusion.layers.inject import add_adapter, get_lora_context, lora_modules
from lorafusion.core.targets import PEFT_GROUPS, resolve_target_modules, to_peft_target_modules
from lorafusion.layers.sharding import TPSplit, tp_rank
from lorafusion.models.hf_layout import qkv_merge, qkv_split
from lorafusion.core.arch import ModelArch
from lorafusion.dist import multi_process
from lorafusion.rundir.atomic import write_bytes, write_dir_atomically
from lorafusion.rundir.integrity import ADAPTER_HASHES, adapter_hashes

_PARENT = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp", "linear_fc2": "mlp"}
_PREFIX = "base_model.model.model.layers"


def _peft_key(layer: int, peft_module: str, kind: str, ab: str) -> str:
    return f"{_PREFIX}.{layer}.{_PARENT[kind]}.{peft_module}.lora_{ab}.weight"


def _gather_tp(t: torch.Tensor, split: TPSplit) -> torch.Tensor:
    """The full tensor from every TP rank's part, put together as its layer's ``split`` says."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or split.dim is None:
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return split.unshard(parts)


def adapter_peft_state(model, name: str, arch: ModelArch,
                       grad: bool = False) -> dict[str, torch.Tensor] | None:
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
        chosen = mod.lora_proj.get(name)
        if chosen is not None:  # a fused linear with an A and B per projection
            b_parts = split_rows(b, mod.projection_index(), chosen)
            for p, a_part, b_part in zip(chosen, a.chunk(len(chosen)), b_parts, strict=True):
                local[_peft_key(layer, PEFT_GROUPS[kind][p], kind, "A")] = a_part.cpu().clone()
                b_full = _gather_tp(b_part, mod.tp_split("lora_B_proj"))
                local[_peft_key(layer, PEFT_GROUPS[kind][p], kind, "B")] = b_full.cpu().clone()
            continue
        a, b = _gather_tp(a, mod.tp_split("lora_A")), _gather_tp(b, mod.tp_split("lora_B"))
        if kind == "linear_qkv":
            bs = qkv_split(b, arch)
        elif kind == "linear_fc1":
            bs = b.chunk(2, dim=0)
        else:
            bs = (b,)
        for peft_module, b_part in zip(PEFT_GROUPS[kind], bs, strict=True):
            local[_peft_key(layer, peft_module, kind, "A")] = a.cpu().clone()
            local[_peft_key(layer, peft_module, kind, "B")] = b_part.cpu().contiguous().clone()
    if not multi_process():
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


def export_peft_adapter(model, name: str, out_dir: str | Path, arch: ModelArch | None = None,
                        base_model: str | None = None) -> Path | None:
    """Write adapter ``name`` as a PEFT adapter directory (collective: call on every rank)."""
    snapshot = peft_adapter_snapshot(model, name, arch, base_model)
    return None if snapshot is None else write_peft_adapter(out_dir, *snapshot)


def peft_adapter_snapshot(model, name: str, arch: ModelArch | None = None,
                          base_model: str | None = None) -> tuple[dict[str, torch.Tensor], dict] | None:
    """Adapter ``name`` in host memory, ready for :func:`write_peft_adapter`: (PEFT-keyed fp32 tensors, its
    ``adapter_config.json``) on global rank 0, None elsewhere (collective). ``base_model``: what the config
    names as its base (default: the directory a model built by ``build_model_from_hf`` came from)."""
    from lorafusion.layers.inject import _chunks, _unwrap

    base_model = base_model or getattr(_unwrap(_chunks(model)[0]).config, "base_model", None)
    if base_model is None:
        raise ConfigError("export_peft_adapter: base_model: expected the base model's HF name or directory, "
                          "which the adapter config names for transformers (the model was not built by "
                          "build_model_from_hf, which records it)")
    state = adapter_peft_state(model, name, arch or model_arch(model))
    if state is None:
        return None
    return state, peft_adapter_config(get_lora_context(model).specs[name], base_model)


def write_peft_adapter(out_dir: str | Path, state: dict[str, torch.Tensor], config: dict) -> Path:
    """Write a snapshot as a PEFT adapter directory, complete or absent (no collectives: any thread), with the
    sha256 of its files beside them (export and generate check them: rundir/integrity.py)."""
    files = {"adapter_config.json": (json.dumps(config, indent=2) + "\n").encode(),
             # serialised here, written by Python: a full disk or a file size limit is then an OSError naming
             # the file (safetensors' own writer raises SafetensorError, which the CLI cannot tell from a bug)
             "adapter_model.safetensors": safetensors_bytes(state, metadata={"format": "pt"})}
    files[ADAPTER_HASHES] = adapter_hashes(files).encode()
    return write_dir_atomically(out_dir, {n: (lambda p, b=b: write_bytes(p, b)) for n, b in files.items()})


def model_arch(model) -> ModelArch:
    from lorafusion.layers.inject import _chunks, _unwrap

    arch = getattr(_unwrap(_chunks(model)[0]).config, "arch", None)
    if arch is None:
        raise ValueError("model has no architecture record: build it with "
                         "lorafusion.models.provider.build_model")
    return arch


# ---------------------------------------------------------------------------------------------- import

def read_peft_adapter(path: str | Path) -> tuple[LoRASpec, dict[str, torch.Tensor]]:
    """Validate a PEFT adapter directory and return (spec, tensors with PEFT keys)."""
    path = Path(path)
    st_file = path / "adapter_model.safetensors"
    _, spec = read_peft_config(path)
    if not st_file.is_file():
        raise MissingFileError(f"{st_file}: missing (only safetensors adapters are supported)")
    try:
        with safe_open(str(st_file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise ConfigError(f"{st_file}: not a readable safetensors file ({e})") from e
    return spec, tensors


def job_spec_for_adapter(file_spec: LoRASpec, job_spec: LoRASpec | None, where: str) -> LoRASpec:
    """The spec an imported adapter trains with: the file's, with the job's ``lora_dropout`` and
    ``shared_fused_a`` when a job names one; r, lora_alpha, use_rslora and target_modules must then agree
    (ConfigError naming ``where``'s field otherwise)."""
    if job_spec is None:
        return file_spec
    for f in COMPARED:
        if getattr(job_spec, f) != getattr(file_spec, f):
            got = getattr(file_spec, f)
            raise ConfigError(f"{where}.lora.{f}: the adapter in init_from has {got!r}, the job "
                              f"{getattr(job_spec, f)!r} (leave it out of lora or set it as the adapter has "
                              "it)")
    try:
        return LoRASpec(**{**file_spec.model_dump(), "lora_dropout": job_spec.lora_dropout,
                           "shared_fused_a": job_spec.shared_fused_a})
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def _stage_layer(mod, spec: LoRASpec, tensors: dict, layer: int, st_file: Path, arch: ModelArch, used: set):
    """(A, B) of one targeted linear for this rank from PEFT tensors, checked; PEFT keys read go into
    ``used``."""
    kind = mod.lora_kind
    tp, rank = tp_rank()
    projs = spec.projections(kind)
    a_parts, b_parts = [], []
    for peft_module in projs:
        ka, kb = _peft_key(layer, peft_module, kind, "A"), _peft_key(layer, peft_module, kind, "B")
        for k in (ka, kb):
            if k not in tensors:
                raise ConfigError(f"{st_file}: tensor {k!r} missing")
            used.add(k)
        a_parts.append(tensors[ka].float())
        b_parts.append(tensors[kb].float())
    fin, fout = mod.full_in_out()
    for a, peft_module in zip(a_parts, projs, strict=True):
        if a.shape != (spec.r, fin):
            raise ConfigError(f"{st_file}: layer {layer} {peft_module}.lora_A has shape {tuple(a.shape)}, "
                              f"expected {(spec.r, fin)}")
    if len(PEFT_GROUPS[kind]) > 1 and not spec.shared_fused_a:  # an A and B per projection
        index = mod.projection_index()
        chosen = tuple(PEFT_GROUPS[kind].index(p) for p in projs)
        for b, p, peft_module in zip(b_parts, chosen, projs, strict=True):
            rows = int((index == p).sum()) * tp
            if b.shape != (rows, spec.r):
                raise ConfigError(f"{st_file}: layer {layer} {peft_module}.lora_B has shape "
                                  f"{tuple(b.shape)}, expected {(rows, spec.r)}")
        b_split = mod.tp_split("lora_B_proj")
        return torch.cat(a_parts), merge_rows([b_split.shard(b, tp, rank) for b in b_parts], index, chosen)
    a = a_parts[0]
    for other, peft_module in zip(a_parts[1:], projs[1:], strict=True):
        if not torch.equal(other, a):
            raise ConfigError(
                f"{st_file}: layer {layer} {peft_module}.lora_A differs from {projs[0]}.lora_A; with "
                f"lora.shared_fused_a: true {'/'.join(projs)} share one A in the fused {kind}, so this "
                f"adapter has no exact representation (set shared_fused_a: false)")
    b = qkv_merge(*b_parts, arch) if kind == "linear_qkv" else torch.cat(b_parts, 0)
    if b.shape != (fout, spec.r):
        raise ConfigError(f"{st_file}: layer {layer} {kind} lora_B has shape {tuple(b.shape)}, expected "
                          f"{(fout, spec.r)}")
    return mod.tp_split("lora_A").shard(a, tp, rank), mod.tp_split("lora_B").shard(b, tp, rank)


def import_peft_adapter(model, name: str, path: str | Path, arch: ModelArch | None = None,
                        spec: LoRASpec | None = None, where: str = "lora") -> LoRASpec:
    """Add adapter ``name`` to ``model`` with the weights of the PEFT adapter at ``path`` (any subset of
    targets, rank, alpha, rsLoRA). ``spec``: a job's LoRA settings to train it with (see
    :func:`job_spec_for_adapter`; ``where`` names the job in errors)."""
    arch = arch or model_arch(model)
    file_spec, tensors = read_peft_adapter(path)
    spec = job_spec_for_adapter(file_spec, spec, where)
    st_file = Path(path) / "adapter_model.safetensors"
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:  # it would decode NUL characters (generate) or train from garbage (init_from)
        raise ConfigError(f"{st_file}: tensor {bad[0]!r} holds non-finite values (NaN or inf; {len(bad)} "
                          f"tensor(s) in all); the adapter is unusable")
    tensors = {k.replace(".lora_A.default.weight", ".lora_A.weight")
               .replace(".lora_B.default.weight", ".lora_B.weight"): v
               for k, v in tensors.items()}
    # Validate and map everything before touching the model.
    staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    used: set[str] = set()
    for key, mod in lora_modules(model):
        if mod.lora_kind in spec.megatron_targets:
            staged[key] = _stage_layer(mod, spec, tensors, int(key.split(".")[0]) - 1, st_file, arch, used)
    if not multi_process() or parallel_state.get_pipeline_model_parallel_world_size() == 1:
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


__all__ = ["adapter_peft_state", "export_peft_adapter", "import_peft_adapter", "job_spec_for_adapter",
           "peft_adapter_snapshot", "read_peft_adapter", "peft_adapter_config", "write_peft_adapter",
           "resolve_target_modules"]

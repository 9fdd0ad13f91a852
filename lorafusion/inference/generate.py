"""``lorafusion generate RUN_DIR --prompts IN.jsonl --out OUT.jsonl``: batched multi-adapter decoding.

The run's base is rebuilt (a preset from the run's seed, or ``model.path``), every job named by a prompt
row gets its PEFT adapter loaded into the same multi-adapter LoRA layers, and the rows of all adapters (and
of the bare base) are decoded together, S-LoRA style: each forward packs one segment per sequence (thd,
as in training) with one LoRA routing segment per run of same-adapter sequences, so one pass through the
model serves every adapter.

Decoding uses a KV cache (:mod:`lorafusion.inference.kv_cache`): one packed prefill of the prompts, then one
row per unfinished sequence per step. ``use_cache=False`` recomputes every sequence in full each step (the
reference the cache is tested against). Greedy at temperature 0; otherwise temperature + top-p sampling,
each row with its own generator seeded by (seed, row number), so a row's sample does not depend on which
rows share its batch. A sequence ends at the tokenizer's eos (kept in ``output_ids``, as transformers'
``generate`` does), after ``max_new_tokens``, or when it fills the model's context.

What a run directory records of its base: ``RUN_DIR/base_model.json`` when present; otherwise the adapters'
``base_model_name_or_path`` (a preset name or ``model.path``) and the checkpoints' ``state.json`` (seed,
dtype, tokenizer type). A preset's random weights are drawn on CUDA when the machine has a GPU (as training
does), so generate on the same kind of machine the run trained on, unless the record says otherwise.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lorafusion.config.schema import TokenizerConfig
from lorafusion.core.arch import PRESETS
from lorafusion.core.arch import preset as preset_arch
from lorafusion.core.errors import ConfigError, MissingFileError, UserError
from lorafusion.core.seeds import mix_seed
from lorafusion.data.tokenizer import build_tokenizer
from lorafusion.inference.prompts import encode_prompt, read_prompts
from lorafusion.inference.sampling import Request, commit_tokens, pick_tokens
from lorafusion.rundir.adapters import check_generate_out, find_adapter, run_jobs
from lorafusion.rundir.atomic import exclusive_out, write_text_atomic
from lorafusion.rundir.jsonfile import read_json_file
from lorafusion.rundir.integrity import DamagedFileError, check_adapter, check_base_record
from lorafusion.rundir.layout import latest_checkpoint

# The model side (Megatron, the model, the KV cache, adapters) is imported inside the functions that build
# and run it, so that generate checks the run directory, the prompts and --out before paying for Megatron's
# import.

DECODE_MODES = ("auto", "graph", "static", "dynamic")

# ------------------------------------------------------------------------------------------------ the run
@dataclass
class RunInfo:
    run_dir: Path
    preset: str | None
    path: str | None
    seed: int
    dtype: str
    tokenizer: dict  # {"type": ..., "path": ...}
    adapters: dict[str, Path]  # job -> PEFT adapter directory (final, else the latest checkpoint's)
    init_device: str | None = None  # device type the preset's weights were drawn on (None: as training would)
    # model.base_precision of the run: generate quantizes the base as training did
    base_precision: str = "bf16"


def _read_json(path: Path) -> dict:
    try:
        value = read_json_file(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable JSON "
                          f"({e.strerror if isinstance(e, OSError) else e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _latest_checkpoint_dir(job_dir: Path) -> Path | None:
    return latest_checkpoint(job_dir) if job_dir.is_dir() else None


def load_run(run_dir: str | Path) -> RunInfo:
    """What :func:`build_run_model` and :func:`run_tokenizer` need, from a ``lorafusion train`` output
    directory."""
    run = Path(run_dir)
    if not run.is_dir():
        raise MissingFileError(f"{run}: no such run directory (expected the output_dir of lorafusion train)")
    adapters: dict[str, Path] = {}
    states: list[dict] = []
    if (run / "summary.json").is_file():
        _read_json(run / "summary.json")  # a garbled summary is one error here (find_adapter passes over it)
    for name in run_jobs(run):  # (a job only in summary.json has neither: it gets no adapter and no state)
        final = run / "adapters" / name
        ckpt = _latest_checkpoint_dir(run / "checkpoints" / name)
        if ckpt is not None and (ckpt / "state.json").is_file():
            states.append(_read_json(ckpt / "state.json"))
        # as `lorafusion export` picks: the final adapter of a job that ended, else its latest checkpoint
        try:
            adapters[name] = find_adapter(run, name)[0]
        except DamagedFileError:  # (never passed over)
            raise
        except UserError:  # no usable checkpoint: its final adapter if it has one
            if (final / "adapter_config.json").is_file():
                check_adapter(final)
                adapters[name] = final
    if not adapters:
        raise MissingFileError(f"{run}: no adapter under adapters/ or checkpoints/ (expected the output_dir "
                               f"of lorafusion train)")
    record = run / "base_model.json"
    # the run's own record of its base (one that is no regular file: named, never passed over)
    if record.exists():
        r = _read_json(record)
        # (an edited record would rebuild another base than the adapters trained on)
        check_base_record(run, r)
        if not isinstance(r.get("seed"), int) or (r.get("preset") is None) == (r.get("path") is None):
            raise ConfigError(f"{record}: expected an integer 'seed' and exactly one of 'preset' or 'path'")
        tok = r.get("tokenizer") or {"type": "byte", "path": None}
        return RunInfo(run, r.get("preset"), r.get("path"), r["seed"], r.get("dtype", "float32"), tok,
                       adapters, r.get("init_device"), r.get("base_precision", "bf16"))
    if not states:
        raise MissingFileError(f"{run}: no checkpoint state.json (it records the run's seed, which rebuilds "
                               f"the base); expected checkpoints/<job>/step_N/state.json")
    state = states[0]
    settings = state.get("settings") or {}
    base = _read_json(next(iter(adapters.values())) / "adapter_config.json").get("base_model_name_or_path")
    preset = path = None
    if base in PRESETS:
        preset = base
    elif base and Path(base).is_dir():
        path = base
    else:
        raise MissingFileError(f"{next(iter(adapters.values())) / 'adapter_config.json'}: "
                               f"base_model_name_or_path {base!r} is neither a preset nor a HF model "
                               "directory on this machine")
    tok_type = settings.get("(run) tokenizer.type", "byte")
    return RunInfo(run, preset, path, int(state["seed"]), settings.get("(run) model.dtype", "float32"),
                   {"type": tok_type, "path": None}, adapters)


def run_tokenizer(info: RunInfo):
    tok = dict(info.tokenizer)
    if tok["type"] == "sentencepiece" and not tok.get("path") and info.path:
        tok["path"] = str(Path(info.path) / "tokenizer.model")
    return build_tokenizer(TokenizerConfig(type=tok["type"], path=tok.get("path")), model_path=info.path)


def build_run_model(info: RunInfo, jobs: Sequence[str], device=None):
    """The run's base (TP = PP = 1) with the adapters of ``jobs`` loaded, in eval mode."""
    from megatron.core import parallel_state

    from lorafusion.dist import init_distributed
    from lorafusion.models.base import base_arch, build_base

    if not parallel_state.model_parallel_is_initialized():
        init_distributed(1, 1, seed=info.seed)
    elif (parallel_state.get_tensor_model_parallel_world_size(),
          parallel_state.get_pipeline_model_parallel_world_size()) != (1, 1):
        raise ConfigError(
            "generate: runs with tp = pp = 1 (one device); the parallel state here has another layout")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    drawn = torch.device(device).type if device is not None else "cpu"
    if not info.path and info.init_device and info.init_device != drawn:
        raise ConfigError(f"{info.run_dir / 'base_model.json'}: the run drew its random base weights on "
                          f"{info.init_device}; generate on a machine of that kind (here: {drawn})")
    model = build_base(*base_arch(info.path, info.preset), dtype=info.dtype, device=device, seed=info.seed,
                       base_precision=info.base_precision, lora_impl=None)  # (None: fused kernels on CUDA)
    for job in jobs:
        _import_adapter(model, info, job)
    model.eval()
    return model


def _import_adapter(model, info: RunInfo, job: str, tries: int = 3) -> None:
    """Job ``job``'s adapter onto ``model``. A live run prunes old checkpoints: one picked a moment ago may be
    gone by now (its files read as missing), so the lookup is made again and the newer one taken."""
    from lorafusion.export.peft import import_peft_adapter
    for attempt in range(tries):
        try:
            return import_peft_adapter(model, job, info.adapters[job])
        except (MissingFileError, ConfigError):
            if attempt == tries - 1 or (info.adapters[job] / "adapter_config.json").is_file():
                raise
            info.adapters[job] = find_adapter(info.run_dir, job)[0]  # (pruned meanwhile: the newer one)


# --------------------------------------------------------------------------------------------- decoding
def _forward(model, jobs, seqs: Sequence[Sequence[int]], positions: torch.Tensor, device) -> torch.Tensor:
    """One packed forward of ``seqs`` (rows of sequence i routed to ``jobs[i]``); the logits [n, V] of each
    sequence's last row."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from lorafusion.inference.static_decode import adapter_routing
    from lorafusion.layers import lora_batch
    from lorafusion.ops.tables import to_device  # pinned + non-blocking: no stream sync per copy

    counts = [len(s) for s in seqs]
    cu_host = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rope_len = int(positions.max()) + 1  # (positions: a host tensor)
    cu = to_device(cu_host, device)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=rope_len,
                          max_seqlen_kv=rope_len)
    host = torch.tensor([t for s in seqs for t in s] + (cu_host[1:] - 1).tolist() + positions.tolist(),
                        dtype=torch.long)  # tokens, each sequence's last row, positions: one copy
    both = to_device(host, device)
    n = host.numel() - len(seqs) - positions.numel()
    tokens, last, pos = both[:n][None], both[n:n + len(seqs)], both[n + len(seqs):]
    routing, names = adapter_routing(jobs, counts)

    def last_rows_only(_module, args, kwargs):  # the output layer sees each sequence's last row, not [T, V]
        return (args[0].index_select(0, last), *args[1:]), kwargs

    hook = model.output_layer.register_forward_pre_hook(last_rows_only, with_kwargs=True)
    try:
        with lora_batch(model, routing, names):
            logits = model(tokens, pos[None], attention_mask=None, packed_seq_params=psp)
    finally:
        hook.remove()
    return logits[0].float()


@torch.no_grad()
def generate_ids(model, requests: Sequence[Request], *, eos_id: int, max_new_tokens: int, context: int,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, use_cache: bool = True,
                 first_row: int = 0, decode: str = "auto") -> None:
    """Decode ``requests`` together (fills each one's ``output_ids``). Sequences are ordered by adapter so
    that each adapter's rows form one routing segment; ``first_row`` numbers the rows for their seeds.
    ``decode`` (with the cache): "graph" — after the prefill, every step is one static step replayed from a
    CUDA graph (:mod:`lorafusion.inference.static_decode`; eager off CUDA); "static" — the same step, eager;
    "dynamic" — one packed row per live sequence per step; "auto" — graph on CUDA if ``GRAPH_BY_DEFAULT``,
    else dynamic."""
    from lorafusion.inference.kv_cache import KVCache, decoding
    from lorafusion.inference.static_decode import GRAPH_BY_DEFAULT, decode_static

    if decode not in DECODE_MODES:
        raise ConfigError(f"decode: expected one of {', '.join(DECODE_MODES)}, got {decode!r}")
    device = next(model.parameters()).device
    auto = "graph" if GRAPH_BY_DEFAULT and device.type == "cuda" else "dynamic"
    decode = auto if decode == "auto" else decode
    static = use_cache and decode != "dynamic"
    order = sorted(range(len(requests)), key=lambda i: (requests[i].job is not None, requests[i].job or ""))
    reqs = [requests[i] for i in order]
    gens = ([torch.Generator(device=device).manual_seed(mix_seed(seed, first_row + i)) for i in order]
            if temperature > 0 else None)
    limit = [min(max_new_tokens, context - len(r.prompt_ids)) for r in reqs]
    for r in reqs:
        r.output_ids = []
    live = [i for i in range(len(reqs)) if limit[i] > 0]
    max_len = max(len(r.prompt_ids) + lim for r, lim in zip(reqs, limit))
    cache = KVCache(len(reqs), -(-max_len // 16) * 16 if static else max_len, device)  # (aligned key mask)
    with decoding(model, cache) if use_cache else contextlib.nullcontext():
        step = 0
        while live:
            if static and step == 1:  # every decode step: one fixed-shape forward of all rows
                decode_static(model, cache, reqs, live, limit, eos_id=eos_id, temperature=temperature,
                              top_p=top_p, gens=gens, graph=decode != "static")
                break
            jobs = [reqs[i].job for i in live]
            if not use_cache:  # full recompute: every live sequence from its first token
                seqs = [reqs[i].prompt_ids + reqs[i].output_ids for i in live]
                positions = torch.cat([torch.arange(len(s)) for s in seqs])
            elif step == 0:
                seqs = [reqs[i].prompt_ids for i in live]
                positions = cache.prefill(live, [len(s) for s in seqs])
            else:
                seqs = [[reqs[i].output_ids[-1]] for i in live]
                positions = cache.decode(live)
            logits = _forward(model, jobs, seqs, positions, device)
            if use_cache:
                cache.advance()
            rows = None if gens is None else [gens[i] for i in live]
            live = commit_tokens(reqs, live, pick_tokens(logits, temperature, top_p, rows), eos_id, limit)
            step += 1


# ------------------------------------------------------------------------------------------------- CLI
def generate_file(run_dir, prompts, out, *, max_new_tokens: int = 128, temperature: float = 0.0,
                  top_p: float = 1.0, seed: int = 0, batch_size: int = 64, force: bool = False,
                  use_cache: bool = True,
                  decode: str = "auto") -> dict:
    """Everything ``lorafusion generate`` does; returns a summary. One writer of ``out`` at a time: a second
    generate to the same --out fails at once (both reported success, one's rows lost)."""
    if decode == "graph" and not torch.cuda.is_available():  # (generate_ids would run the same step eagerly)
        raise ConfigError("--decode graph: a CUDA graph needs a CUDA GPU and this machine has none; use "
                          "--decode static (the graph's step, run eagerly: the same tokens) or auto (dynamic "
                          "on a CPU)")
    check_generate_out(out := Path(out), Path(prompts), force)  # --force: an earlier output only
    with exclusive_out(out):
        return _generate_file(run_dir, prompts, out, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, seed=seed, batch_size=batch_size, force=force, use_cache=use_cache,
                              decode=decode)


def _generate_file(run_dir, prompts, out: Path, *, max_new_tokens, temperature, top_p, seed, batch_size,
                   force, use_cache, decode) -> dict:
    if not (0 <= temperature < float("inf")) or not (0 < top_p <= 1):  # (NaN fails both)
        raise ConfigError(f"--temperature must be >= 0 and --top-p in (0, 1], got {temperature} and {top_p}")
    if not 0 <= seed < 1 << 63:
        raise ConfigError(f"--seed: expected an integer from 0 to 2**63 - 1, got {seed}")
    info = load_run(run_dir)
    tokenizer = run_tokenizer(info)
    context = _context(info)
    requests = read_prompts(prompts, tokenizer, list(info.adapters), context, info.run_dir)
    jobs = sorted({r.job for r in requests if r.job is not None})
    t0 = time.perf_counter()
    model = build_run_model(info, jobs)
    t1 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        generate_ids(model, requests[start:start + batch_size], eos_id=tokenizer.eos_id,
                     max_new_tokens=max_new_tokens, context=context, temperature=temperature, top_p=top_p,
                     seed=seed, use_cache=use_cache,
                     first_row=start, decode=decode)
    t2 = time.perf_counter()
    rows = [{**r.row, "prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
             "output": tokenizer.decode([t for t in r.output_ids if t != tokenizer.eos_id])}
            for r in requests]
    write_text_atomic(out, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), mkdir=True,
                      replace=force)  # (without --force never over a file written meanwhile)
    new = sum(len(r.output_ids) for r in requests)
    return {"rows": len(requests), "jobs": jobs, "new_tokens": new, "load_s": round(t1 - t0, 3),
            "generate_s": round(t2 - t1, 3), "tokens_per_s": round(new / max(t2 - t1, 1e-9), 1),
            "out": str(out), "expected": expected_matches(rows)}


def expected_matches(rows: Sequence[dict]) -> dict[str, list[int]]:
    """For rows with an ``expected`` string: per job (``"(base)"`` for none), [outputs equal to it, rows]."""
    score: dict[str, list[int]] = {}
    for row in rows:
        if isinstance(row.get("expected"), str):
            hit = score.setdefault(row.get("job") or "(base)", [0, 0])
            hit[0] += row["output"] == row["expected"]
            hit[1] += 1
    return score


def _context(info: RunInfo) -> int:
    if info.path:
        from lorafusion.models.hf_import import HFCheckpoint

        return HFCheckpoint(info.path).arch.max_position_embeddings
    return preset_arch(info.preset).max_position_embeddings


__all__ = ["Request", "RunInfo", "build_run_model", "encode_prompt", "expected_matches", "generate_file",
           "generate_ids", "load_run", "read_prompts", "run_tokenizer"]

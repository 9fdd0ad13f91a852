"""Core attention for packed sequences (Megatron ``core_attention`` submodule).

A packed microbatch holds several samples back to back (``qkv_format="thd"`` with ``cu_seqlens``): each
sample attends causally to itself only — no cross-sample attention, no padding. Three implementations, chosen
once per process by ``model.attention`` (:func:`select_attention`):

- "fa4": FlashAttention-4 (the ``flash-attn-4`` package's ``flash_attn.cute.flash_attn_varlen_func``, CuTe-DSL
  kernels compiled at first use; Hopper and newer), k and v passed grouped;
- "fa2": torch's ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 kernels), k and v expanded to the
  query heads where torch's op has no ``enable_gqa``;
- "per-sample": an exact per-segment reference with ``scaled_dot_product_attention`` (the CPU path).

``auto`` takes the first of :data:`AUTO_ORDER` for this GPU that is installed and passes a small packed
forward+backward against an fp32 reference at start-up, else fa2 (checked the same way), else per-sample.
A process that selected nothing (inference) runs fa2 on CUDA. Unpacked ``[s, b, h, d]`` input is plain
causal SDPA.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from lorafusion.core.errors import ConfigError

# auto's candidates per GPU compute capability (major), fastest first, as measured on the 8B's packed shapes
# (scripts/bench_attention.py); fa2 is tried after them on every GPU
AUTO_ORDER = {9: ("fa4", "fa2")}
FA4_INSTALL = "pip install 'lorafusion[fa4]'"
PROBE_LENGTHS = (1, 67, 130)  # the start-up check's packed samples (a length-1 sample among them)
PROBE_TOLERANCE = 0.02  # its largest relative error (norm) of the output and of dq, dk, dv vs fp32


def expand_kv(k: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    groups = k.shape[dim]
    return k if groups == heads else k.repeat_interleave(heads // groups, dim=dim)


def causal_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """q [L, H, D], k/v [L, G, D] → [L, H, D]; causal, GQA by repeating kv heads."""
    h = q.shape[1]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, expand_kv(k, h, 1), expand_kv(v, h, 1)))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    return out.squeeze(0).transpose(0, 1)


def varlen_attention_reference(q, k, v, cu_seqlens: torch.Tensor, scale: float,
                               bounds=None) -> torch.Tensor:
    """Exact packed attention: each [cu[i], cu[i+1]) segment attends causally within itself. ``bounds``: the
    same as host ints, if the caller has them (then the device's ``cu_seqlens`` is not read: a host read
    inside a pipeline schedule can deadlock it on NCCL)."""
    bounds = list(bounds) if bounds is not None else cu_seqlens.tolist()
    outs = [causal_attention_reference(q[a:b], k[a:b], v[a:b], scale)
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    tail = q.shape[0] - bounds[-1]
    if tail:  # rows past the last sample (never produced by the packer): zeros, no gradient
        outs.append(q.new_zeros(tail, *q.shape[1:]))
    return torch.cat(outs, dim=0)


_VARLEN = None
_VARLEN_FAILED = False
_FA4 = None
_SELECTED: str | None = None  # "fa4", "fa2" or "per-sample" once select_attention ran; None: fa2 on CUDA


def _varlen_fn():
    global _VARLEN
    if _VARLEN is None:
        try:
            from torch.nn.attention.varlen import varlen_attn

            _VARLEN = (varlen_attn, set(inspect.signature(varlen_attn).parameters))
        except ImportError:
            _VARLEN = (None, set())
    return _VARLEN


def _fa4_fn():
    """FlashAttention-4's varlen function (imported at first use; raises what the import raises). Its compiled
    kernels are kept on disk across processes (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED, unless set)."""
    global _FA4
    if _FA4 is None:
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
        from flash_attn.cute import flash_attn_varlen_func

        _FA4 = flash_attn_varlen_func
    return _FA4


def fa4_attention(q, k, v, cu: torch.Tensor, max_seqlen: int, scale: float) -> torch.Tensor:
    """FlashAttention-4 packed causal attention: q [T, H, D], k/v [T, G, D] grouped, ``cu`` int32 on q's
    device; forward and backward through its autograd function (it saves q, k, v, the output and the fp32
    log-sum-exp). v is copied first: Megatron's v is a view of the qkv projection's output, which a saved view
    would keep alive whole (q + 2g per token; q and k reach here rotated, as new tensors) for a copy of g."""
    out, _lse = _fa4_fn()(q, k, v.contiguous(), cu_seqlens_q=cu, cu_seqlens_k=cu,
                          max_seqlen_q=max_seqlen or None,
                          max_seqlen_k=max_seqlen or None, softmax_scale=scale, causal=True)
    return out


def fa2_attention(q, k, v, cu: torch.Tensor, max_seqlen: int, scale: float) -> torch.Tensor:
    """torch's varlen_attn (FlashAttention-2), k and v expanded first where it has no ``enable_gqa``."""
    fn, params = _varlen_fn()
    if fn is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn")
    k, v, kw = _fa2_args(q, k, v, params, scale)
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kw)


def _fa2_args(q, k, v, params, scale):
    kw = {"scale": scale}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:
        k, v = expand_kv(k, q.shape[1], 1), expand_kv(v, q.shape[1], 1)
    return k, v, kw


def varlen_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
                     bounds=None) -> torch.Tensor:
    """Packed causal attention by the selected implementation; ``bounds``: ``cu_seqlens`` as host ints, if
    known (the per-sample path then never reads the device)."""
    global _SELECTED
    if _SELECTED == "per-sample" or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return varlen_attention_reference(q, k, v, cu_seqlens, scale, bounds)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if _SELECTED == "fa4":
        try:
            return fa4_attention(q, k, v, cu, max_seqlen, scale)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # a shape its kernels refuse: fa2 from now on (without enable_gqa it keeps
            # q - 3g more elements per token and layer than fa4's count: inside the memory plan's margin)
            warnings.warn(f"FlashAttention-4 failed ({type(e).__name__}: {e}); using torch's varlen_attn "
                          "(FlashAttention-2) from now on", stacklevel=2)
            _SELECTED = "fa2"
    fn, params = _varlen_fn()
    if fn is None:
        return varlen_attention_reference(q, k, v, cu_seqlens, scale, bounds)
    k, v, kw = _fa2_args(q, k, v, params, scale)
    return _varlen_or_fallback(fn, q, k, v, cu, cu_seqlens, max_seqlen, scale, kw, bounds)


def _varlen_or_fallback(fn, q, k, v, cu, cu_seqlens, max_seqlen, scale, kw, bounds=None):
    """``fn`` (torch's varlen_attn); if it fails for a reason other than memory, the per-sample path from now
    on. Out of memory is raised: the fallback saves one more q-width tensor per token and layer (the
    per-sample outputs beside their concatenation; scheduler.memory.attention_elems), so switching to it for
    good made every later step of the process bigger than planned (it did so in the memory calibration
    grids)."""
    global _VARLEN_FAILED
    if _VARLEN_FAILED:
        return varlen_attention_reference(q, k, v, cu_seqlens, scale, bounds)
    try:
        return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kw)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError, NotImplementedError) as e:  # e.g. a head dim or GPU the kernel lacks
        warnings.warn(f"torch varlen_attn failed ({e}); using the per-sample SDPA path from now on",
                      stacklevel=3)
        _VARLEN_FAILED = True
        return varlen_attention_reference(q, k, v, cu_seqlens, scale, bounds)


def attention_path() -> str:
    """Which packed attention this process runs on a GPU, as the memory model names it
    (``lorafusion.scheduler.memory.attention_elems``): "fa4" when selected, "per-sample" when selected or
    once ``varlen_attn`` failed (or torch has none), "varlen-gqa" when torch's op takes grouped k and v, else
    "varlen" (k and v expanded first)."""
    if _SELECTED in ("fa4", "per-sample"):
        return _SELECTED
    fn, params = _varlen_fn()
    if fn is None or _VARLEN_FAILED:
        return "per-sample"
    return "varlen-gqa" if "enable_gqa" in params else "varlen"


_RUN = {"fa4": fa4_attention, "fa2": fa2_attention}


def probe(name: str, heads: int, groups: int, head_dim: int, dtype: torch.dtype,
          device: torch.device) -> str | None:
    """Run implementation ``name`` ("fa4" or "fa2") forward and backward on a small packed batch of this
    shape and compare the output and dq, dk, dv with the fp32 reference; None if it ran and matched, else
    why not (out of memory is raised)."""
    gen = torch.Generator().manual_seed(0)
    t = sum(PROBE_LENGTHS)
    q, k, v, dout = (torch.randn(t, n, head_dim, generator=gen) for n in (heads, groups, groups, heads))
    bounds = [0]
    for n in PROBE_LENGTHS:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32)
    scale = 1.0 / math.sqrt(head_dim)
    want = _forward_backward(lambda a, b, c: varlen_attention_reference(a, b, c, cu, scale), q, k, v, dout)
    try:
        cu_dev = cu.to(device)
        got = _forward_backward(lambda a, b, c: _RUN[name](a, b, c, cu_dev, max(PROBE_LENGTHS), scale),
                                *(x.to(device=device, dtype=dtype) for x in (q, k, v, dout)))
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        return f"{type(e).__name__}: {str(e).strip()[:300]}"
    for what, x, y in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        x = x.detach().float().cpu()
        if x.shape != y.shape or not torch.isfinite(x).all():
            return f"its {what} has shape {tuple(x.shape)} or non-finite values"
        err = ((x - y).norm() / y.norm().clamp_min(1e-30)).item()
        if not err <= PROBE_TOLERANCE:
            return f"its {what} is off by {err:.3g} (relative) from the fp32 reference"
    return None


def _forward_backward(fn, q, k, v, dout):
    with torch.enable_grad():
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout)
    return [out.detach()] + [x.grad for x in leaves]


def fa4_problem(capability: tuple[int, int]) -> str | None:
    """Why FlashAttention-4 cannot train on a GPU of this compute capability here (None: it can): its backward
    needs sm_90 or newer, and the package must import."""
    if capability[0] < 9:
        return ("FlashAttention-4 trains on Hopper (sm_90) or newer GPUs; this one is "
                f"sm_{capability[0]}{capability[1]}")
    try:
        _fa4_fn()
    except Exception as e:  # not installed, or its CUDA libraries do not load
        return (f"flash-attn-4 is not installed or does not load ({type(e).__name__}: {str(e)[:200]}); "
                f"install it with {FA4_INSTALL}")
    return None


def _gpu() -> tuple[torch.device, tuple[int, int]] | None:
    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    return device, torch.cuda.get_device_capability(device)


def _unavailable(name: str, capability: tuple[int, int]) -> str | None:
    if name == "fa4":
        return fa4_problem(capability)
    if _varlen_fn()[0] is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (FlashAttention-2)"
    return None


def select_attention(setting: str, heads: int, groups: int, head_dim: int, dtype: torch.dtype,
                     where: str = "model.attention") -> str:
    """Choose this process's packed attention for ``model.attention`` = ``setting`` (every later
    :func:`varlen_attention` runs it) on attention layers of ``heads`` query heads, ``groups`` kv heads of
    ``head_dim`` (one tensor-parallel rank's) in ``dtype``; returns the memory model's name of the path
    (:func:`attention_path`). ``auto``: the first of :data:`AUTO_ORDER` for this GPU, then fa2, that is
    installed and passes :func:`probe` (an installed one that fails it is skipped with a warning);
    per-sample without a GPU or in float32. An explicit choice that cannot run here: one ConfigError naming
    ``where`` and what to do."""
    global _SELECTED
    gpu, half = _gpu(), dtype in (torch.float16, torch.bfloat16)
    if setting == "per-sample" or (setting == "auto" and not (gpu and half)):
        _SELECTED = "per-sample"
        return attention_path()
    if gpu is None:
        raise ConfigError(f"{where}: {setting} needs a CUDA GPU and this machine has none; use auto or "
                          "per-sample")
    if not half:
        raise ConfigError(f"{where}: {setting} needs model.dtype bfloat16 or float16; use auto or per-sample")
    device, capability = gpu
    names = (*AUTO_ORDER.get(capability[0], ()), "fa2") if setting == "auto" else (setting,)
    for name in dict.fromkeys(names):
        missing = _unavailable(name, capability)
        problem = missing or probe(name, heads, groups, head_dim, dtype, device)
        if problem is None:
            _SELECTED = name
            return attention_path()
        if setting != "auto":
            raise ConfigError(f"{where}: {name} cannot run here: {problem}"
                              + ("" if missing else "; use auto or another choice"))
        if not missing:
            warnings.warn(f"{where}: auto: {name} failed its start-up check ({problem}); trying the next",
                          stacklevel=2)
    warnings.warn(f"{where}: auto: no FlashAttention path passed its check; using per-sample SDPA (slow)",
                  stacklevel=2)
    _SELECTED = "per-sample"
    return attention_path()


def select_for_run(cfg, arch) -> str:
    """:func:`select_attention` for a run config and its ``ModelArch`` (heads and kv heads per TP rank)."""
    tp = cfg.parallelism.tp
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.model.dtype, torch.float32)
    return select_attention(cfg.model.attention, arch.num_attention_heads // tp,
                            max(1, arch.num_query_groups // tp), arch.kv_channels, dtype,
                            where=f"{cfg.source}: model.attention")


def selected() -> str | None:
    """The implementation this process selected ("fa4", "fa2", "per-sample"), or None."""
    return _SELECTED


class PackedDotProductAttention(MegatronModule):
    """Drop-in for Megatron's ``DotProductAttention`` that also takes ``packed_seq_params`` (thd).

    ``kv_cache``: None except while decoding (:func:`lorafusion.inference.kv_cache.decoding`), when packed
    rows attend through the cache instead."""

    kv_cache = None

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("parallelism: context parallelism is not supported by PackedDotProductAttention")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # query [t, np, hn], key/value [t, ng, hn]
            if self.kv_cache is not None:
                return self.kv_cache.attend(self.layer_number, query, key, value, self.softmax_scale)
            cu = packed_seq_params.cu_seqlens_q
            return varlen_attention(query, key, value, cu, int(packed_seq_params.max_seqlen_q or 0),
                                    self.softmax_scale, getattr(packed_seq_params, "host_cu_seqlens", None))
        # [sq, b, np, hn] → [b, np, sq, hn]
        sq, b, h, d = query.shape
        q = query.permute(1, 2, 0, 3)
        k = expand_kv(key, h, 2).permute(1, 2, 0, 3)
        v = expand_kv(value, h, 2).permute(1, 2, 0, 3)
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, h * d)

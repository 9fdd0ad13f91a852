"""Core attention for packed sequences (Megatron ``core_attention`` submodule).

A packed microbatch holds several samples back to back (``qkv_format="thd"`` with ``cu_seqlens``): each
sample attends causally to itself only — no cross-sample attention, no padding. On CUDA it uses torch's
``torch.nn.attention.varlen.varlen_attn`` (FlashAttention varlen); elsewhere an exact per-segment
reference with ``scaled_dot_product_attention``. Unpacked ``[s, b, h, d]`` input is plain causal SDPA.
"""

from __future__ import annotations

import inspect
import math
import warnings

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


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


def varlen_attention_reference(q, k, v, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact packed attention: each [cu[i], cu[i+1]) segment attends causally within itself."""
    bounds = cu_seqlens.tolist()
    outs = [causal_attention_reference(q[a:b], k[a:b], v[a:b], scale)
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    tail = q.shape[0] - bounds[-1]
    if tail:  # rows past the last sample (never produced by the packer): zeros, no gradient
        outs.append(q.new_zeros(tail, *q.shape[1:]))
    return torch.cat(outs, dim=0)


_VARLEN = None
_VARLEN_FAILED = False


def _varlen_fn():
    global _VARLEN
    if _VARLEN is None:
        try:
            from torch.nn.attention.varlen import varlen_attn

            _VARLEN = (varlen_attn, set(inspect.signature(varlen_attn).parameters))
        except ImportError:
            _VARLEN = (None, set())
    return _VARLEN


def varlen_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float) -> torch.Tensor:
    fn, params = _varlen_fn()
    if fn is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return varlen_attention_reference(q, k, v, cu_seqlens, scale)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    kw = {"scale": scale}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    h = q.shape[1]
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:
        k, v = expand_kv(k, h, 1), expand_kv(v, h, 1)
    return _varlen_or_fallback(fn, q, k, v, cu, cu_seqlens, max_seqlen, scale, kw)


def _varlen_or_fallback(fn, q, k, v, cu, cu_seqlens, max_seqlen, scale, kw):
    """``fn`` (torch's varlen_attn); if it fails for a reason other than memory, the per-sample path from now
    on. Out of memory is raised: the fallback saves one more q-width tensor per token and layer (the
    per-sample outputs beside their concatenation; scheduler.memory.attention_elems), so switching to it for
    good made every later step of the process bigger than planned (it did so in the memory calibration
    grids)."""
    global _VARLEN_FAILED
    if _VARLEN_FAILED:
        return varlen_attention_reference(q, k, v, cu_seqlens, scale)
    try:
        return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kw)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError, NotImplementedError) as e:  # e.g. a head dim or GPU the kernel lacks
        warnings.warn(f"torch varlen_attn failed ({e}); using the per-sample SDPA path from now on",
                      stacklevel=3)
        _VARLEN_FAILED = True
        return varlen_attention_reference(q, k, v, cu_seqlens, scale)


def attention_path() -> str:
    """Which packed attention this process runs on a GPU, as the memory model names it
    (``lorafusion.scheduler.memory.attention_elems``): "per-sample" once ``varlen_attn`` failed (or torch has
    none), "varlen-gqa" when torch's op takes grouped k and v, else "varlen" (k and v expanded first)."""
    fn, params = _varlen_fn()
    if fn is None or _VARLEN_FAILED:
        return "per-sample"
    return "varlen-gqa" if "enable_gqa" in params else "varlen"


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
                                    self.softmax_scale)
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

"""Counter-based dropout masks: a pure function of (seed, row id, global column).

Philox-4x32-10 exactly as Triton's ``tl.randint4x(seed, counter)`` computes it (32-bit counters). One call
gives four 32-bit words = eight 16-bit uniforms, so eight consecutive columns share one counter::

    counter = (row_id * ceil(k_total / 8) + (k_offset + col) // 8) mod 2**32
    t = (k_offset + col) % 8 ;  u16 = (word[t // 2] >> (16 * (t % 2))) & 0xFFFF
    keep = u16 >= ceil(p * 65536)            (keep rate 1 - p, to within 2**-16)

The torch reference and the Triton kernels (``lorafusion.kernels.dropout``) draw the same mask, and nothing
of size M×K is ever stored: backward regenerates it. (Eight uniforms per Philox call instead of one per
element: the kernels' X passes were bound by Philox arithmetic, not memory.)
"""

from __future__ import annotations

import torch

from lorafusion.core.seeds import keep_threshold

_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57


def _umulhi(a: int, b: torch.Tensor) -> torch.Tensor:
    # int64 products wrap mod 2**64, which keeps every bit we need.
    return ((b * a) >> 32) & _MASK32


def philox4_uint32(seed: int, offsets: torch.Tensor, n_rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """The four Philox-4x32 output words for counters (offsets, 0, 0, 0) and key = seed (``tl.randint4x``);
    each as int64 in [0, 2**32)."""
    c0 = offsets.to(torch.int64) & _MASK32
    c1 = torch.zeros_like(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(n_rounds):
        _c0, _c2 = c0, c2
        c0 = _umulhi(_ROUND_B, _c2) ^ c1 ^ k0
        c2 = _umulhi(_ROUND_A, _c0) ^ c3 ^ k1
        c1 = (_c2 * _ROUND_B) & _MASK32
        c3 = (_c0 * _ROUND_A) & _MASK32
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def philox_uint32(seed: int, offsets: torch.Tensor, n_rounds: int = 10) -> torch.Tensor:
    """First Philox-4x32 output word (``tl.randint``)."""
    return philox4_uint32(seed, offsets, n_rounds)[0]


def philox_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """``tl.rand(seed, offsets)``: uniform float32 in [0, 1)."""
    x = philox_uint32(seed, offsets)
    x = torch.where(x >= 2**31, x - 2**32, x)  # bitcast to int32
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * 4.6566127342e-10


def keep_mask(seed, row_ids: torch.Tensor, k: int, p: float, k_offset: int = 0,
              k_total: int | None = None) -> torch.Tensor:
    """Boolean keep mask [len(row_ids), k]: element kept with probability 1 - p (see module doc).

    One Philox call per eight columns, as the kernels draw it. ``seed`` is an int or a 0-dim int64 tensor
    (one compiled kernel then serves every seed)."""
    k_total = k if k_total is None else k_total
    thr = keep_threshold(p)
    first, last = k_offset // 8, (k_offset + k - 1) // 8
    groups = torch.arange(first, last + 1, device=row_ids.device, dtype=torch.int64)
    counters = (row_ids.to(torch.int64)[:, None] * ((k_total + 7) // 8) + groups[None, :]) & _MASK32
    w = philox4_uint32(seed, counters)  # 4 × [rows, groups]
    u16 = torch.stack([half for word in w for half in (word & 0xFFFF, word >> 16)],
                      dim=-1)  # [rows, groups, 8]
    lo = k_offset % 8
    return u16.reshape(u16.shape[0], -1)[:, lo:lo + k] >= thr

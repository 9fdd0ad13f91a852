"""Seed vocabulary shared by data, kernels, layers and runtime (pure Python, no torch).

- :func:`mix_seed` combines integers into one 63-bit seed (splitmix64 steps).
- :func:`name_key` turns a name (job, adapter, layer key, parameter name) into the 32-bit integer that
  is mixed into seeds: the crc32 of its UTF-8 bytes. Every place that keys randomness by a name uses it.
- :func:`keep_threshold` is the dropout rule on 16-bit Philox uniforms (see ``lorafusion.ops.dropout``).
"""

from __future__ import annotations

import math
import zlib

_M64 = 0xFFFFFFFFFFFFFFFF


def mix_seed(*parts: int) -> int:
    """Combine integers into one 63-bit seed (splitmix64 steps); stable across processes and runs."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = (h ^ (int(part) & _M64)) & _M64
        h = (h + 0x9E3779B97F4A7C15) & _M64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def name_key(name: str) -> int:
    """The integer a name contributes to a seed: crc32 of its UTF-8 bytes."""
    return zlib.crc32(name.encode("utf-8"))


def keep_threshold(p: float) -> int:
    """Integer threshold on the 16-bit uniforms: keep iff ``u16 >= keep_threshold(p)``."""
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p must be in [0, 1), got {p}")
    return min(65535, math.ceil(p * 65536))

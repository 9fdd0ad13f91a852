"""Triton JIT work per planned chunk, for the benchmarks (a trainer callback).

A kernel specialisation that a process meets for the first time is compiled (or, when an earlier process of
the same machine compiled it, loaded from Triton's disk cache) inside the chunk that first launches it. In a
sweep of one process per configuration the first process compiles and the later ones load: a timed chunk that
meets a new microbatch shape then costs the first run seconds that the others do not pay. :class:`JitClock`
counts these events and their wall time per chunk through Triton's ``jit_cache_hook`` (called before) and
``jit_post_compile_hook`` (after), so a run's record says whether its timed chunks were steady.
"""

from __future__ import annotations

import time


class JitClock:
    """Counts and times Triton JIT compilations / cache loads per chunk (``per_chunk``: ``{"n", "s"}`` for
    each chunk, the work between two chunks counted with the next one). Chains the hooks it finds; ``close()``
    restores them. Without Triton (or under ``TRITON_INTERPRET``, where nothing is compiled) it records
    zeros."""

    def __init__(self, knobs=None):
        if knobs is None:
            try:
                from triton import knobs as _k

                knobs = _k.runtime
            except Exception:  # no triton (or an older one without knobs): nothing to hook
                knobs = None
        self.per_chunk: list[dict] = []
        self._knobs, self._n, self._s, self._t0 = knobs, 0, 0.0, None
        if knobs is not None:
            self._prev = (knobs.jit_cache_hook, knobs.jit_post_compile_hook)
            knobs.jit_cache_hook, knobs.jit_post_compile_hook = self._before, self._after

    def _before(self, **kw):
        self._t0 = time.perf_counter()
        prev = self._prev[0]
        return prev(**kw) if prev is not None else None  # a true value would make Triton skip the compile

    def _after(self, **kw):
        if self._t0 is not None:
            self._n += 1
            self._s += time.perf_counter() - self._t0
            self._t0 = None
        prev = self._prev[1]
        return prev(**kw) if prev is not None else None

    def chunk_ran(self, trainer, chunk, result) -> None:
        self.per_chunk.append({"n": self._n, "s": round(self._s, 3)})
        self._n, self._s = 0, 0.0

    def summary(self, first_timed: int) -> dict:
        """``per_chunk`` and the events inside the timed chunks (index ``first_timed`` on)."""
        timed = self.per_chunk[first_timed:]
        return {"jit_per_chunk": self.per_chunk, "jit_timed_n": sum(c["n"] for c in timed),
                "jit_timed_s": round(sum(c["s"] for c in timed), 3)}

    def close(self) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._prev
            self._knobs = None

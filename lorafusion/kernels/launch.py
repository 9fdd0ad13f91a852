"""Repeated launches of a Triton kernel without ``JITFunction.run``'s per-call work.

``kernel[grid](*args, **kw)`` goes through ``JITFunction.run`` on every call: options and knobs, the
argument binding and specialization, a cache key built as a string of the whole specialization plus the
options, the check of the kernel's globals and the launch metadata (tens of µs per launch, the host cost of
a small microbatch). :class:`Launcher` keeps, per device, the compiled kernels it has seen under a key of
everything Triton's specialization of the arguments depends on, at least as finely as Triton's binder (a
tensor's dtype and 16-byte alignment; an integer's being 1, divisibility by 16 and width; the keyword
arguments — constexprs and launch options — by value; Triton's debug knobs), and launches a known one
directly through its ``CompiledKernel.run`` — the call ``JITFunction.run`` itself ends with. Anything new (a
first launch, a key not seen, an argument of another kind, a kernel still being compiled) goes through
``JITFunction.run``, which compiles when needed, launches and hands back the compiled kernel to remember.
So the kernel launched is always the one ``run`` would launch, with the same arguments (checked against
Triton's own binder in tests/kernels/test_launch.py).

The fast path steps aside where ``run`` would do more than bind and launch: under Triton's interpreter
(``TRITON_INTERPRET=1``, the CPU tests), while a launch hook is registered (a profiler such as Proton; the
empty hook chains Triton installs by default do nothing and are skipped), and for a kernel with pre-run
hooks.
"""

from __future__ import annotations

from torch import Tensor as _Tensor

__all__ = ["Launcher"]


def _cuda_device() -> int:
    import torch

    return torch.cuda.current_device()


def _cuda_stream(device: int) -> int:
    import torch

    return torch._C._cuda_getCurrentRawStream(device)


def _hooked(hook) -> bool:
    """A launch hook that does something: Triton 3.6 installs an empty ``HookChain`` by default, which
    ``JITFunction.run`` calls (with a metadata dict built for it) around every launch, to no effect."""
    return hook is not None and bool(getattr(hook, "calls", True))


_I32_LO, _I32_HI, _U64_LO = -(1 << 31), (1 << 31) - 1, 1 << 63


def _arg_key(a):
    """What Triton's specialization of a positional argument depends on, at least as finely: a tensor's
    dtype and 16-byte alignment; an integer's being 1, divisibility by 16 and width (i32, i64, u64) — whether
    or not the parameter is specialized (finer is safe: at worst one more slow launch); None, a bool or a
    float by type. Anything else raises TypeError (the launch then takes the normal path)."""
    t = type(a)
    if t is int:
        return (a == 1, not a & 15, _I32_LO <= a <= _I32_HI, a >= _U64_LO)
    if a is None or t is bool or t is float:
        return t
    return (a.dtype, not a.data_ptr() & 15) if isinstance(a, _Tensor) else _unknown(a)


def _unknown(a):
    raise TypeError(f"no launch key for {type(a).__name__}")


class Launcher:
    """``Launcher(kernel).launch(grid, *args, **kw)`` = ``kernel[grid](*args, **kw)``, with the compiled
    kernel looked up by the arguments' specialization instead of ``JITFunction.run``'s full path.

    ``device`` / ``stream`` (tests): the current device index and the raw stream of a device (default:
    PyTorch's current CUDA device and stream, as Triton's CUDA driver reads them).
    """

    def __init__(self, kernel, *, device=None, stream=None):
        self.kernel = kernel
        self.slow_launches = 0  # launches that went through JITFunction.run (tests read it)
        self._device = device or _cuda_device
        self._stream = stream or _cuda_stream
        self._caches: dict = {}  # device -> {key: (CompiledKernel, the arguments after the positional ones)}
        self._fast = hasattr(kernel, "device_caches")  # a JITFunction (not the interpreter's function)

    def launch(self, grid, *args, **kw):
        if not self._fast or callable(grid):
            return self.kernel[grid](*args, **kw)
        from triton import knobs

        rt = knobs.runtime
        if _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook) or self.kernel.pre_run_hooks:
            return self._slow(None, None, grid, args, kw)
        device = self._device()
        cache = self._caches.get(device)
        if cache is None:
            cache = self._caches[device] = {}
        try:
            key = (tuple(map(_arg_key, args)), tuple(kw.items()), rt.debug,
                   knobs.compilation.instrumentation_mode)
            hit = cache.get(key)
        except TypeError:  # an argument this key does not describe (or an unhashable constexpr)
            return self._slow(None, None, grid, args, kw)
        if hit is None:
            return self._slow(cache, key, grid, args, kw)
        ck, tail = hit
        self._direct(ck, grid, self._stream(device), args + tail)
        return ck

    def _slow(self, cache, key, grid, args, kw):
        """``JITFunction.run`` (compiles when needed, launches); the compiled kernel is kept under ``key``
        with the arguments after ``args`` in parameter order (keywords and defaults: fixed by the key)."""
        self.slow_launches += 1
        ck = self.kernel.run(*args, grid=grid, warmup=False, **kw)
        # a constexpr given by position would be keyed by its value class, not its value: never cached
        positional_constexpr = any(p.is_constexpr for p in self.kernel.params[:len(args)])
        if cache is not None and ck is not None and not hasattr(ck, "result") and not positional_constexpr:
            binder = self.kernel.device_caches[self._device()][4]
            bound = tuple(binder(*args, **kw)[0].values())
            cache[key] = (ck, bound[len(args):])
        return ck

    @staticmethod
    def _direct(ck, grid, stream, bound):
        """The launch ``JITFunction.run`` ends with (``bound``: every parameter's value in order); no launch
        hook does anything, so none is called and no launch metadata is built for it."""
        n = len(grid)
        ck.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, ck.function,
               ck.packed_metadata, None, None, None, *bound)

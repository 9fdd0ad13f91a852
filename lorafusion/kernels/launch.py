"""Repeated launches of a Triton kernel without ``JITFunction.run``'s per-call work.

``kernel[grid](*args, **kw)`` goes through ``JITFunction.run`` on every call: options and knobs, the
argument binding and specialization, a cache key built as a string of the whole specialization plus the
options, the check of the kernel's globals and the launch metadata (tens of µs per launch, the host cost of
a small microbatch). :class:`Launcher` keeps, per device, the compiled kernels it has seen keyed by
Triton's own specialization of the arguments (the same binder ``run`` uses: dtypes, 16-byte alignment of
pointers, integers that are 1 or divisible by 16, their width, constexpr values) plus the launch options,
and launches a known one directly through its ``CompiledKernel.run`` — the call ``JITFunction.run`` itself
ends with. Anything new (a first launch, a specialization or option not seen, a kernel that is still being
compiled) goes through ``JITFunction.run``, which compiles it, launches it and hands back the compiled
kernel to remember. So the kernel launched is always the one ``run`` would launch, with the same arguments.

The fast path steps aside where ``run`` would do more than bind and launch: under Triton's interpreter
(``TRITON_INTERPRET=1``, the CPU tests), while a launch hook is registered (a profiler such as Proton; the
empty hook chains Triton installs by default do nothing and are skipped), and for a kernel with pre-run
hooks.
"""

from __future__ import annotations

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
        self._caches: dict = {}  # device -> (binder, {key: CompiledKernel})
        self._fast = hasattr(kernel, "device_caches")  # a JITFunction (not the interpreter's function)

    def launch(self, grid, *args, **kw):
        if not self._fast or callable(grid):
            return self.kernel[grid](*args, **kw)
        from triton import knobs

        rt = knobs.runtime
        if _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook) or self.kernel.pre_run_hooks:
            return self._slow(None, None, grid, args, kw)
        device = self._device()
        entry = self._caches.get(device)
        if entry is None:
            # device_caches[device] = (kernel cache, key cache, target, backend, binder)
            binder = self.kernel.device_caches[device][4]
            entry = self._caches[device] = (binder, {})
        binder, cache = entry
        bound, spec, options = binder(*args, **kw)
        key = (tuple(spec), tuple(options.items()), rt.debug, knobs.compilation.instrumentation_mode)
        ck = cache.get(key)
        if ck is None:
            return self._slow(cache, key, grid, args, kw)
        self._direct(ck, grid, self._stream(device), bound)
        return ck

    def _slow(self, cache, key, grid, args, kw):
        """``JITFunction.run`` (compiles when needed, launches); the compiled kernel is kept under ``key``."""
        self.slow_launches += 1
        ck = self.kernel.run(*args, grid=grid, warmup=False, **kw)
        if cache is not None and ck is not None and not hasattr(ck, "result"):  # (not an async future)
            cache[key] = ck
        return ck

    @staticmethod
    def _direct(ck, grid, stream, bound):
        """The launch ``JITFunction.run`` ends with; no launch hook does anything, so none is called and no
        launch metadata is built for it."""
        n = len(grid)
        ck.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, ck.function,
               ck.packed_metadata, None, None, None, *bound.values())

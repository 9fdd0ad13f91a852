"""Counting ops at the dispatcher: what a test needs to show code reads nothing back to the host (each such
read waits for the GPU on CUDA, and a CUDA graph capture refuses it) without a GPU."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

# ops that read a tensor's value on the host: .item(), bool(t), .tolist(), nonzero, equal / allclose
HOST_READS = frozenset({"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default",
                        "aten.item.default", "aten.equal.default", "aten.allclose.default"})


class OpWatch(TorchDispatchMode):
    """While active, appends to ``seen`` the name of every dispatched op in ``flagged``. One ``seen`` list may
    be shared by several watches (a test entering a fresh watch around each step)."""

    def __init__(self, flagged=HOST_READS, seen: list[str] | None = None):
        super().__init__()
        self.flagged = frozenset(flagged)
        self.seen = [] if seen is None else seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.flagged:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))

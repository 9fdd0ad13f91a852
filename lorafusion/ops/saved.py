"""Saved tensors that backward rebuilds instead of keeping: a decoder layer's cheap activations.

A LoRA linear keeps its input X for backward (dA = dSᵀ·drop(X)); its frozen base does not (Megatron's
``LinearWithFrozenWeight`` and the FP8 base save only the weight). Three of those inputs are cheap functions
of a tensor that their producer's own backward keeps anyway:

- linear_fc2's input, the SwiGLU output, of fc1's output (kept by the fused SwiGLU's backward);
- linear_qkv's and linear_fc1's inputs, the RMSNorm outputs, of the norm's input (kept by the RMSNorm's).

The producer marks its output (:func:`mark_rebuildable`: ``out`` equals ``fn(*inputs)`` bit for bit — the
same kernel on the same input); the consumer runs its forward under :func:`rebuild_saved` ``(x)``: a tensor
that autograd saves there and that lives in x's storage is kept as x's recipe (the producer's inputs, which
are kept anyway: no bytes) plus the view's geometry, and rebuilt in backward, once per consumer call however
many views of it were saved, then freed with the consumer's saved tensors. Nothing else changes: the values,
the kernels and the order of the gradients are those of the plain graph (:func:`keep_saved` turns marking
off, which is that graph).

Under sequence parallelism a column-parallel linear's LoRA term runs on the all-gathered input (``full``):
views of it are kept as this rank's shard — or, when the shard is itself a marked norm output, as the
shard's recipe — and all-gathered again in backward (``gather``), as Megatron's SP linears do with their
input for the weight gradient. So an SP rank keeps nothing of the normed input either; backward pays the
norm kernel and the all-gather it paid before.

Hooks in force outside (scripts/count_saved_bytes.py's counting, torch's own checkpoint) still see every
tensor: a saved tensor that is not rebuilt goes to them as it is, and a recipe's inputs go through them.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["REBUILT", "keep_saved", "mark_rebuildable", "rebuild_saved", "recipe_of"]

_ATTR = "_lorafusion_recipe"
_ENABLED = [True]
# saved tensors kept as a recipe since the process started, by source: a marked tensor ("recomputed") or the
# all-gathered input of a sequence-parallel linear ("gathered"); tests read it
REBUILT = {"recomputed": 0, "gathered": 0}


class _Recipe:
    __slots__ = ("fn", "inputs", "versions")

    def __init__(self, fn, inputs):
        self.fn, self.inputs = fn, tuple(inputs)
        self.versions = tuple(t._version for t in self.inputs)


@contextlib.contextmanager
def keep_saved():
    """Within: producers mark nothing, so every saved tensor is kept as is (the plain autograd graph)."""
    prev = _ENABLED[0]
    _ENABLED[0] = False
    try:
        yield
    finally:
        _ENABLED[0] = prev


def _owns_storage(t: torch.Tensor) -> bool:
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def mark_rebuildable(out: torch.Tensor, fn, *inputs: torch.Tensor) -> torch.Tensor:
    """Mark ``out`` as ``fn(*inputs)`` (run under no_grad; bit for bit the same values and layout) for a
    consumer's :func:`rebuild_saved`. Only an output that autograd tracks (so its producer keeps
    ``inputs`` for its own backward) and that owns its storage is marked; returns ``out``."""
    if _ENABLED[0] and out.requires_grad and torch.is_grad_enabled() and _owns_storage(out):
        setattr(out, _ATTR, _Recipe(fn, inputs))
    return out


def recipe_of(t: torch.Tensor):
    """``t``'s recipe (``fn``, ``inputs``), or None when it is not marked."""
    return getattr(t, _ATTR, None) if _ENABLED[0] else None


class _Cell:
    """One rebuilt tensor of one consumer call: built at the first unpack, shared by every saved view; or
    started earlier (:meth:`prefetch`, a cell with ``start``: the all-gather issued asynchronously) and
    waited for at the first unpack."""

    __slots__ = ("build", "kept", "unpack", "versions", "value", "start", "pending")

    def __init__(self, build, inputs, outer, versions, start=None):
        self.build, self.versions, self.value = build, versions, None
        self.start, self.pending = start, None
        self.unpack = outer[1] if outer is not None else None
        self.kept = tuple(outer[0](t) for t in inputs) if outer is not None else tuple(inputs)

    def _args(self) -> list:
        args = [self.unpack(k) for k in self.kept] if self.unpack is not None else list(self.kept)
        if self.versions is not None and any(a._version != v for a, v in zip(args, self.versions)):
            raise RuntimeError("a tensor a saved activation is rebuilt from was modified in place after "
                               "the forward")
        return args

    def prefetch(self) -> None:
        if self.start is not None and self.value is None and self.pending is None:
            with torch.no_grad():
                self.pending = self.start(*self._args())

    def get(self) -> torch.Tensor:
        if self.value is None and self.pending is not None:
            value, work = self.pending
            work.wait()
            self.value, self.pending = value, None
        if self.value is None:
            args = self._args()
            with torch.no_grad():
                self.value = self.build(*args)
        return self.value


class _View:
    __slots__ = ("cell", "size", "stride", "offset")

    def __init__(self, cell, t: torch.Tensor, base: int):
        self.cell, self.size, self.stride, self.offset = cell, t.size(), t.stride(), t.storage_offset() - base

    def get(self) -> torch.Tensor:
        v = self.cell.get()
        return v.as_strided(self.size, self.stride, v.storage_offset() + self.offset)


def _source(like: torch.Tensor, build, inputs, versions, start=None):
    """(storage, first element, dtype, a factory of this call's cell) of a tensor to rebuild."""
    if not like.is_contiguous():
        return None
    return (like.untyped_storage().data_ptr(), like.storage_offset(), like.dtype,
            (build, inputs, versions, start))


class _Prefetch(contextlib.nullcontext):
    """A null context whose :meth:`prefetch` does nothing (nothing to rebuild)."""

    def prefetch(self) -> None:
        pass


def rebuild_saved(x: torch.Tensor, full: torch.Tensor | None = None, gather=None, gather_async=None):
    """A context for a consumer's forward on ``x``: saved views of ``x`` (when marked) are kept as its recipe;
    with ``full`` = ``gather(x)`` (the sequence-parallel all-gather), saved views of ``full`` are kept as x
    (or x's recipe) and gathered again in backward. A null context when there is nothing to rebuild.

    ``gather_async(t)``: ``(gather(t), work)`` with the all-gather issued, not waited for. The context's
    ``prefetch()`` then starts the backward's gather of ``full`` early — called once the forward is done, at a
    point of backward before this consumer's (the next layer's backward that does not wait for it) — and
    the first unpack waits for it; without a call, backward gathers at the first unpack as before."""
    recipe = recipe_of(x)
    sources = []
    if recipe is not None:
        sources.append(("recomputed", _source(x, recipe.fn, recipe.inputs, recipe.versions)))
    if full is not None:
        fn = recipe.fn if recipe is not None else (lambda t: t)
        start = None if gather_async is None else (lambda *a: gather_async(fn(*a)))
        if recipe is not None:
            sources.append(("gathered", _source(full, lambda *a: gather(fn(*a)), recipe.inputs,
                                                recipe.versions, start)))
        else:
            sources.append(("gathered", _source(full, gather, (x,), None, start)))
    sources = [(kind, s) for kind, s in sources if s is not None]
    if not sources:
        return _Prefetch()
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    cells: dict = {}  # source index -> this call's cell (made at the first saved view)

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        for i, (kind, (storage, base, dtype, spec)) in enumerate(sources):
            if ptr == storage and t.dtype == dtype:
                if i not in cells:
                    build, inputs, versions, start = spec
                    # an outer hook may hand back other tensor objects: their version counters are theirs
                    cells[i] = _Cell(build, inputs, outer, versions if outer is None else None, start)
                REBUILT[kind] += 1
                return _View(cells[i], t, base)
        return t if outer is None else outer[0](t)

    def unpack(obj):
        if isinstance(obj, _View):
            return obj.get()
        return obj if outer is None else outer[1](obj)

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    hooks.prefetch = lambda: [cell.prefetch() for cell in list(cells.values())]
    return hooks

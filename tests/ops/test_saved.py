"""lorafusion/ops/saved.py: a saved tensor its producer marked rebuildable is kept as the recipe (no bytes of
its own) and rebuilt once per consumer call in backward, bit for bit; the sequence-parallel gather is
rebuilt from the shard; hooks in force outside still see what is kept; an in-place change of a recipe's
input is an error, not a wrong gradient."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lorafusion.ops.saved import REBUILT, keep_saved, mark_rebuildable, rebuild_saved, recipe_of


class _SavesInput(torch.autograd.Function):
    """Like a LoRA shrink: saves its input (as a 2-D view) for the weight's gradient."""

    @staticmethod
    def forward(ctx, x, a):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, a)
        ctx.shape = x.shape
        return x2 @ a.t()

    @staticmethod
    def backward(ctx, g):
        x2, a = ctx.saved_tensors
        return (g @ a).view(ctx.shape), g.t() @ x2


def _produce(src, builds):
    """sin keeps its input; the recipe counts its runs."""
    return mark_rebuildable(torch.sin(src), lambda t: builds.append(1) or torch.sin(t), src)


def _counting():
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    return seen, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _run(keep: bool, dtype=torch.float32, gather=None):
    g = torch.Generator().manual_seed(0)
    src = torch.randn(6, 2, 8, generator=g, dtype=dtype).requires_grad_(True)
    a = torch.randn(3, 8, generator=g, dtype=dtype).requires_grad_(True)
    builds: list = []
    seen, counting = _counting()
    with keep_saved() if keep else contextlib.nullcontext(), counting:
        x = _produce(src, builds)
        if gather is None:
            with rebuild_saved(x):
                y = _SavesInput.apply(x, a) + 2 * _SavesInput.apply(x, a)  # two saved views, one rebuild
        else:
            full = gather(x)
            with rebuild_saved(x, full, gather):
                y = _SavesInput.apply(full, a)
        kept = x.untyped_storage().data_ptr() in seen
        if gather is not None:
            kept = kept or full.untyped_storage().data_ptr() in seen
        del x
    y.square().sum().backward()
    return src.grad, a.grad, kept, len(builds), src.untyped_storage().data_ptr() in seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_marked_input_is_rebuilt_once_and_gives_the_same_gradients(dtype):
    n0 = REBUILT["recomputed"]
    want_src, want_a, kept, builds, _ = _run(True, dtype)
    assert kept and builds == 0 and REBUILT["recomputed"] == n0
    got_src, got_a, kept, builds, src_seen = _run(False, dtype)
    assert not kept and builds == 1 and REBUILT["recomputed"] == n0 + 2
    assert src_seen  # the outer counting hook saw the recipe's input (kept by sin anyway)
    assert torch.equal(got_src, want_src) and torch.equal(got_a, want_a)


def test_the_gathered_input_is_rebuilt_from_the_shard_or_its_recipe():
    def gather(t):  # stands in for the sequence-parallel all-gather along the first dim
        return torch.cat([t, t.flip(0)])

    n0 = REBUILT["gathered"]
    want = _run(True, gather=gather)
    got = _run(False, gather=gather)
    assert want[2] and not got[2] and REBUILT["gathered"] > n0
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # an unmarked shard: kept itself, the gather rebuilt from it
    src = torch.randn(4, 8, requires_grad=True)
    x = src * 2  # not marked
    a = torch.randn(3, 8, requires_grad=True)
    seen, counting = _counting()
    with counting:
        full = gather(x)
        with rebuild_saved(x, full, gather):
            y = _SavesInput.apply(full, a)
    assert full.untyped_storage().data_ptr() not in seen and x.untyped_storage().data_ptr() in seen
    y.sum().backward()
    assert torch.equal(a.grad, torch.ones(8, 3).t() @ gather(x.detach()))


def test_only_tracked_outputs_are_marked():
    src = torch.randn(4, 8)
    assert recipe_of(mark_rebuildable(torch.sin(src), torch.sin, src)) is None  # no gradient
    src.requires_grad_(True)
    with torch.no_grad():
        assert recipe_of(mark_rebuildable(torch.sin(src), torch.sin, src)) is None
    with keep_saved():
        assert recipe_of(mark_rebuildable(torch.sin(src), torch.sin, src)) is None
    assert recipe_of(mark_rebuildable(torch.sin(src)[:2], torch.sin, src)) is None  # a view: not its storage
    out = mark_rebuildable(torch.sin(src), torch.sin, src)
    assert recipe_of(out) is not None
    with keep_saved():
        assert recipe_of(out) is None


def test_an_input_changed_in_place_after_the_forward_is_an_error():
    src = torch.randn(4, 8, requires_grad=True)
    base = src * 1  # the recipe's input, a non-leaf that can be changed in place
    a = torch.randn(3, 8, requires_grad=True)
    x = _produce(base, [])
    with rebuild_saved(x):
        y = _SavesInput.apply(x, a)
    with torch.no_grad():
        base.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()

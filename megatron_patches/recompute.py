"""Activation recomputation hook: restore per-microbatch state around Megatron's recompute.

Megatron's full recompute (``tensor_parallel.random.CheckpointFunction``) re-runs a block's forward during
backward. State that a forward reads from outside its arguments — lorafusion's LoRA routing of the current
microbatch — has moved on by then under 1F1B. :func:`apply_recompute_state_hook` wraps
``CheckpointFunction.forward``/``backward`` (megatron-core 0.16) so that ``capture()``'s value, taken in
forward, is handed to ``restore(state)`` for the recompute and the state in force before is put back after.
Works on CPU and GPU; idempotent.
"""

from __future__ import annotations

from collections.abc import Callable

_installed: tuple | None = None


def apply_recompute_state_hook(capture: Callable[[], object], restore: Callable[[object], None]) -> None:
    global _installed
    from megatron.core.tensor_parallel import random as mrandom

    cls = mrandom.CheckpointFunction
    if _installed is not None:
        _installed[2][:] = [capture, restore]
        return
    orig_forward, orig_backward = cls.forward, cls.backward
    hooks = [capture, restore]

    def forward(ctx, run_function, distribute_saved_activations, *args):
        # stands in for CheckpointFunction.forward: also remembers the caller's state
        ctx.lorafusion_state = hooks[0]()
        return orig_forward(ctx, run_function, distribute_saved_activations, *args)

    def backward(ctx, *grads):
        # stands in for CheckpointFunction.backward: recompute under the state of the forward
        before = hooks[0]()
        hooks[1](ctx.lorafusion_state)
        try:
            return orig_backward(ctx, *grads)
        finally:
            hooks[1](before)

    cls.forward = staticmethod(forward)
    cls.backward = staticmethod(backward)
    _installed = (orig_forward, orig_backward, hooks)

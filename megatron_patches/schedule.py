"""A hook after every backward step of Megatron's pipeline schedules (megatron-core 0.16).

Both 1F1B schedules in ``megatron.core.pipeline_parallel.schedules`` run a microbatch's backward through the
module-level ``backward_step`` (looked up by name at each call), and send its input gradient to the previous
stage only after it returns. :func:`after_each_backward` wraps that function for the duration of a ``with``
block so ``callback()`` runs right after each backward on this rank, before the gradient leaves: the
per-adapter optimizer of interleaved 1F1B begins its step there (lorafusion/runtime/pipeline.py). Restored on
exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def after_each_backward(callback: Callable[[], None]) -> Iterator[None]:
    from megatron.core.pipeline_parallel import schedules

    original = schedules.backward_step

    def backward_step(*args, **kwargs):
        out = original(*args, **kwargs)
        callback()
        return out

    schedules.backward_step = backward_step
    try:
        yield
    finally:
        schedules.backward_step = original

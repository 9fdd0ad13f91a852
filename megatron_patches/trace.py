"""Where each rank is in Megatron's pipeline schedule, for hangs on GPUs (megatron-core 0.16).

Off unless the environment variable ``LORAFUSION_PIPELINE_TRACE`` names a file prefix: then every process
appends one line per event to ``PREFIX.rank<global rank>`` (line-buffered, so the last line survives a kill):
each p2p call of the schedule (``P2PCommunicator._communicate``: what it sends and receives, with shapes, and
when its shapes are known and its operations issued), each forward and backward step (begin and end, with
Megatron's microbatch and model chunk) and whatever the runtime records (:func:`record`). A hung run's last
lines say which microbatch, model chunk and p2p operation each rank was in. :func:`traced_schedule` installs
the wrappers for the duration of a ``with`` block (nothing when off); restored on exit.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

ENV = "LORAFUSION_PIPELINE_TRACE"
_file = None
_count = 0


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def record(event: str) -> None:
    """Append ``event`` to this rank's trace (nothing when tracing is off)."""
    global _file, _count
    if not enabled():
        return
    if _file is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        _file = open(f"{os.environ[ENV]}.rank{rank}", "a", buffering=1)  # noqa: SIM115 - kept open
    _count += 1
    _file.write(f"{_count} {time.monotonic():.3f} {event}\n")


def _describe(t) -> str:
    return "-" if t is None else "x".join(str(d) for d in t.shape)


@contextlib.contextmanager
def traced_schedule() -> Iterator[None]:
    """Record every p2p call and forward/backward step of Megatron's schedules inside the block (only while
    tracing is on)."""
    if not enabled():
        yield
        return
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    fwd, bwd, comm = schedules.forward_step, schedules.backward_step, P2PCommunicator._communicate

    def forward_step(*args, **kwargs):
        where = f"mb={kwargs.get('current_microbatch')} chunk={kwargs.get('vp_stage')}"
        record(f"F begin {where}")
        out = fwd(*args, **kwargs)
        record(f"F end {where}")
        return out

    def backward_step(*args, **kwargs):
        record("B begin")
        out = bwd(*args, **kwargs)
        record("B end")
        return out

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                     wait_on_reqs=True):
        what = (f"send_next={_describe(tensor_send_next)} send_prev={_describe(tensor_send_prev)} "
                f"recv_prev={int(bool(recv_prev))} recv_next={int(bool(recv_next))} wait={int(wait_on_reqs)}")
        record(f"P2P begin {what} (peers prev={self.prev_rank} next={self.next_rank})")
        out = comm(self, tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
                   recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape,
                   wait_on_reqs=wait_on_reqs)
        got = " ".join(f"{n}={_describe(t)}" for n, t in (("got_prev", out[0]), ("got_next", out[1])))
        record(f"P2P issued {got}")
        return out

    schedules.forward_step, schedules.backward_step = forward_step, backward_step
    P2PCommunicator._communicate = _communicate
    try:
        yield
    finally:
        schedules.forward_step, schedules.backward_step = fwd, bwd
        P2PCommunicator._communicate = comm

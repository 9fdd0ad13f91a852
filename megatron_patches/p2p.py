"""Stream-local synchronisation in Megatron's pipeline p2p (megatron-core 0.16).

``P2PCommunicator._communicate_shapes`` (variable sequence lengths) and ``_communicate`` (with
``batch_p2p_sync``) call ``torch.cuda.synchronize()``: the host waits for *every* stream of the device. The
per-adapter optimizer starts its gradient-norm all-reduce over the model-parallel group asynchronously, on
NCCL's stream, as soon as a stage's backward of a global batch is done; the other stages join it at their
own point in the 1F1B schedule, later. A device-wide synchronise on the last stage then waits for that
all-reduce, whose other members wait for this stage's next gradient send, which comes after the
synchronise: with PP=4 on GPUs the pipeline deadlocks (70B, 2026-11-22: stage 3 in ``_communicate_shapes``,
stage 2 waiting for the gradient whose shape it had received, stages 0-1 in ``recv_backward``).

What these synchronisations protect is the p2p buffers, and after ``req.wait()`` the current stream already
waits for the p2p kernels: synchronising the current stream gives the same guarantee without waiting for
unrelated collectives. :func:`apply_stream_local_p2p_sync` gives the p2p module a ``torch`` whose
``cuda.synchronize`` is exactly that (nothing else in the process changes). Idempotent; on CPU a no-op sync.

Shapes known locally. With ``variable_seq_lengths`` every p2p call first exchanges the shapes of what it
sends (``_communicate_shapes``): in Megatron a ``batch_isend_irecv`` on the pipeline group, waited for, then a
synchronise — a host round trip per call, and under interleaved 1F1B with ``overlap_p2p_comm`` a deadlock
(the exchange queues behind a pending data receive on the same NCCL communicator whose send the peer issues
only after its own exchange; 2x H100, PP=2 x V=2). Yet every rank knows every shape already: the plan, the
same on every rank, gives each microbatch's token count, and the schedule fixes which microbatch each p2p
tensor belongs to. :func:`apply_local_p2p_shapes` replaces ``_communicate_shapes`` by a read of the shape
source that :func:`local_p2p_shapes` installs for one schedule: per channel (activations received from the
previous rank, gradients received from the next one, activations sent to the next one, gradients sent to the
previous one) the shapes in the order the schedule issues them, each with a label naming its microbatch. No
communication, no device synchronisation. Each tensor sent is checked against its planned shape (the peer
receives into a buffer of the planned shape, so a wrong plan fails here, on the host, with the microbatch
named, instead of an NCCL receive of the wrong size hanging or reading garbage); a channel read past its end
or left unread when the schedule ends is an error too. With ``LORAFUSION_P2P_SHAPE_CHECK=1`` (a debug
cross-check) the shapes are also exchanged with the peers over a gloo group of the pipeline's ranks
(:func:`create_pipeline_shape_groups`, collective, after Megatron's parallel state is set up; an activation's
shape and a gradient's on tags of their own, so that a PP=2 ring cannot pair them wrongly) and any
difference from the local source is an error.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator

import torch
import torch.distributed as dist

_applied = False
_shapes_applied = False
# this process's pipeline group over gloo for the debug cross-check (None: none made, or no pipeline) and its
# global ranks
_shape_group = None
_shape_ranks: tuple[int, ...] = ()
FORWARD_TAG = 1   # an activation's shape, sent to the next rank, received from the previous one
BACKWARD_TAG = 2  # a gradient's shape, sent to the previous rank, received from the next one


def _stream_synchronize(device=None) -> None:
    if torch.cuda.is_available():
        torch.cuda.current_stream(device).synchronize()


class _CudaView(types.ModuleType):
    """``torch.cuda`` with a stream-local ``synchronize``."""

    def __init__(self):
        super().__init__("torch.cuda (stream-local synchronize)")

    def __getattr__(self, name):
        return _stream_synchronize if name == "synchronize" else getattr(torch.cuda, name)


class _TorchView(types.ModuleType):
    """``torch`` whose ``cuda`` is :class:`_CudaView`."""

    def __init__(self):
        super().__init__("torch (stream-local cuda.synchronize)")
        self.cuda = _CudaView()

    def __getattr__(self, name):
        return getattr(torch, name)


def apply_stream_local_p2p_sync() -> bool:
    """Make Megatron's pipeline p2p synchronise the current stream instead of the device; True when
    applied."""
    global _applied
    if _applied:
        return True
    from megatron.core.pipeline_parallel import p2p_communication

    p2p_communication.torch = _TorchView()
    _applied = True
    return True


def stream_local_p2p_sync_applied() -> bool:
    return _applied


def create_pipeline_shape_groups(pipelines: list | None = None) -> None:
    """Make a gloo group of each pipeline's ranks, on every rank in the same order (collective over the
    world) and keep this rank's for the shapes' debug cross-check (:func:`shape_check_enabled`).
    ``pipelines``: the global ranks of every pipeline group; None: this rank's pipeline group in Megatron's
    parallel state, gathered from every rank (nothing without a pipeline)."""
    global _shape_group, _shape_ranks
    _shape_group, _shape_ranks = None, ()
    rank = dist.get_rank()
    if pipelines is None:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1:
            return
        own = tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()))
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, own)
        pipelines = gathered
    for ranks in sorted({tuple(int(r) for r in p) for p in pipelines}):
        group = dist.new_group(list(ranks), backend="gloo")
        if rank in ranks:
            _shape_group, _shape_ranks = group, ranks


def forget_pipeline_shape_groups() -> None:
    """Drop this rank's shape group (its process group is destroyed with the default one)."""
    global _shape_group, _shape_ranks
    _shape_group, _shape_ranks = None, ()


def pipeline_shape_group():
    """This rank's pipeline group over gloo, or None."""
    return _shape_group


SHAPE_CHECK_ENV = "LORAFUSION_P2P_SHAPE_CHECK"


def shape_check_enabled() -> bool:
    """Whether the local shapes are cross-checked against the peers' over gloo (``LORAFUSION_P2P_SHAPE_CHECK``
    = 1; a debug aid: a host round trip per p2p call)."""
    return os.environ.get(SHAPE_CHECK_ENV, "") not in ("", "0")


CHANNELS = ("recv_prev", "recv_next", "send_next", "send_prev")


class ShapeSource:
    """One schedule's p2p shapes on this rank: per channel of :data:`CHANNELS` a list of (shape, label) in the
    order the schedule issues that channel's tensors (``label`` names the tensor in errors)."""

    def __init__(self, channels: dict):
        unknown = set(channels) - set(CHANNELS)
        if unknown:
            raise ValueError(f"unknown p2p channels {sorted(unknown)}; expected {CHANNELS}")
        self.queues = {ch: [(tuple(int(d) for d in shape), label) for shape, label in channels.get(ch, ())]
                       for ch in CHANNELS}
        self.used = dict.fromkeys(CHANNELS, 0)

    def take(self, channel: str) -> tuple[tuple[int, ...], str]:
        q, i = self.queues[channel], self.used[channel]
        if i >= len(q):
            raise RuntimeError(f"pipeline p2p shapes: the schedule issued {channel} tensor {i + 1}, the"
                               f" shape source holds {len(q)}: the plan's p2p order and Megatron's schedule"
                               f" disagree")
        self.used[channel] = i + 1
        return q[i]

    def check_done(self) -> None:
        left = {ch: len(q) - self.used[ch] for ch, q in self.queues.items() if len(q) != self.used[ch]}
        if left:
            raise RuntimeError(f"pipeline p2p shapes: the schedule ended with shapes never used {left}: the "
                               f"plan's p2p order and Megatron's schedule disagree")


_source: ShapeSource | None = None


@contextlib.contextmanager
def local_p2p_shapes(channels: dict) -> Iterator[ShapeSource]:
    """Within the block, Megatron's pipeline p2p takes its shapes from ``channels`` ({channel: [(shape,
    label), ...]}, see :class:`ShapeSource`); on a normal exit every shape must have been used."""
    global _source
    if _source is not None:
        raise RuntimeError("pipeline p2p shapes: a shape source is already installed (nested schedules)")
    _source = source = ShapeSource(channels)
    try:
        yield source
        source.check_done()
    finally:
        _source = None


def _checked_send(channel: str, tensor) -> None:
    want, label = _source.take(channel)
    if tuple(tensor.size()) != want:
        raise RuntimeError(f"pipeline p2p shapes: {channel} of {label} is {tuple(tensor.size())}, the plan "
                           f"gives {want} (the peer receives into a buffer of the planned shape)")


def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
    """``P2PCommunicator._communicate_shapes`` from the installed :class:`ShapeSource`: (recv_prev_shape,
    recv_next_shape), [0, 0, 0] for one not received; the tensors sent checked against the source."""
    if _source is None:
        raise RuntimeError("pipeline p2p outside megatron_patches.local_p2p_shapes(): no shape source for "
                           "this schedule")
    if tensor_send_next is not None:
        _checked_send("send_next", tensor_send_next)
    if tensor_send_prev is not None:
        _checked_send("send_prev", tensor_send_prev)
    prev = list(_source.take("recv_prev")[0]) if recv_prev else [0, 0, 0]
    nxt = list(_source.take("recv_next")[0]) if recv_next else [0, 0, 0]
    if shape_check_enabled():
        got = _exchange_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)
        if got != (prev, nxt):
            raise RuntimeError(f"pipeline p2p shapes: the peers sent (recv_prev, recv_next) = {got}, the"
                               f" local source gives {(prev, nxt)} ({SHAPE_CHECK_ENV})")
    return prev, nxt


def _shape_tensor(t) -> torch.Tensor:
    return torch.tensor(list(t.size()), dtype=torch.int64)


def _exchange_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
    """The shapes exchanged with the peers over this rank's gloo pipeline group (the debug cross-check):
    (recv_prev_shape, recv_next_shape), [0, 0, 0] for one not received."""
    peers = [r for r, used in ((self.next_rank, tensor_send_next is not None or recv_next),
                               (self.prev_rank, tensor_send_prev is not None or recv_prev)) if used]
    if peers and (_shape_group is None or any(r not in _shape_ranks for r in peers)):
        raise RuntimeError(f"pipeline shape exchange with ranks {peers}: no gloo pipeline group holds them "
                           f"(this rank's: {list(_shape_ranks)}); call megatron_patches."
                           f"create_pipeline_shape_groups() on every rank after initialize_model_parallel")
    group = _shape_group
    got_prev = torch.zeros(3, dtype=torch.int64) if recv_prev else None
    got_next = torch.zeros(3, dtype=torch.int64) if recv_next else None
    sends = [(_shape_tensor(t), rank, tag)
             for t, rank, tag in ((tensor_send_next, self.next_rank, FORWARD_TAG),
                                  (tensor_send_prev, self.prev_rank, BACKWARD_TAG)) if t is not None]
    works = [dist.isend(t, rank, group=group, tag=tag) for t, rank, tag in sends]
    if got_prev is not None:
        works.append(dist.irecv(got_prev, self.prev_rank, group=group, tag=FORWARD_TAG))
    if got_next is not None:
        works.append(dist.irecv(got_next, self.next_rank, group=group, tag=BACKWARD_TAG))
    for w in works:
        w.wait()
    return (got_prev.tolist() if got_prev is not None else [0, 0, 0],
            got_next.tolist() if got_next is not None else [0, 0, 0])


def apply_local_p2p_shapes() -> bool:
    """Make Megatron's pipeline p2p take its shapes from :func:`local_p2p_shapes` (see the module text);
    True when applied. Idempotent."""
    global _shapes_applied
    if _shapes_applied:
        return True
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    P2PCommunicator._communicate_shapes = _communicate_shapes
    _shapes_applied = True
    return True


def local_p2p_shapes_applied() -> bool:
    return _shapes_applied


_sync_applied = False


def _synchronous(communicate):
    def _communicate(self, *args, **kwargs):
        out = communicate(self, *args, **kwargs)
        if (kwargs.get("wait_on_reqs", True) and not self.config.batch_p2p_comm
                and torch.cuda.is_available()):
            torch.cuda.current_stream().synchronize()
        return out

    _communicate.__wrapped__ = communicate
    return _communicate


def apply_host_synchronous_p2p() -> bool:
    """Make Megatron's unbatched pipeline p2p (interleaved 1F1B without ``overlap_p2p_comm``) return only
    once its transfers are done on the GPU: the host then never launches compute while a p2p kernel of this
    rank spins waiting for a peer. A kernel launched for the first time may need the whole device to be idle
    (CUDA's lazy loading synchronises the context); with a receive in flight whose peer sends only after this
    rank's next p2p call, that launch never returns (2x H200, PP=2 x V=2: one rank's host in a first-time GEMM
    of a one-token microbatch, its GPU spinning in an NCCL receive). Batched p2p (1F1B) keeps its own stream
    synchronise. Idempotent; nothing on CPU."""
    global _sync_applied
    if _sync_applied:
        return True
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    P2PCommunicator._communicate = _synchronous(P2PCommunicator._communicate)
    _sync_applied = True
    return True


def host_synchronous_p2p_applied() -> bool:
    return _sync_applied

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

Shapes on the host. With ``variable_seq_lengths`` every p2p call first exchanges the shapes of what it
sends (``_communicate_shapes``): a ``batch_isend_irecv`` on the pipeline group, waited for, then a
synchronise. Under interleaved 1F1B with ``overlap_p2p_comm`` the data receive of the previous call is still
pending on the same NCCL communicator; NCCL runs a communicator's operations in issue order, so the shape
exchange queues behind a receive whose matching send the peer issues only after its own shape exchange: a
cycle (2x H100, PP=2 x V=2: rank 0 in ``_communicate_shapes``, rank 1 in a forward, both GPUs spinning in NCCL
kernels). On gloo nothing queues like that, which is why CPU runs of the same schedule completed. Also, with
PP=2 the previous and the next rank are one peer and Megatron's shape batch sends an activation's and a
gradient's shape to it on one channel, paired only by program order.

:func:`apply_host_p2p_shapes` replaces ``_communicate_shapes`` by an exchange over a gloo group of the same
pipeline ranks (:func:`create_pipeline_shape_groups`, collective, after Megatron's parallel state is set up):
CPU tensors, never queued behind NCCL data operations, no device synchronisation; activations' shapes (to the
next rank) and gradients' shapes (to the previous rank) on tags of their own, so that a PP=2 ring cannot pair
a forward shape with a backward one. Every send and receive of a call is posted before any is waited for.
The rest of Megatron's p2p (the data, its groups and streams) is untouched. It serves every pipeline schedule
(1F1B included: one host-side exchange instead of a device batch and a stream synchronise per call).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

_applied = False
_shapes_applied = False
_megatron_communicate_shapes = None
# this process's pipeline group over gloo (None: none made, or no pipeline) and its global ranks
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
    world) and keep this rank's for the shape exchange. ``pipelines``: the global ranks of every pipeline
    group; None: this rank's pipeline group in Megatron's parallel state, gathered from every rank (nothing
    without a pipeline)."""
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


def _shape_tensor(t) -> torch.Tensor:
    return torch.tensor(list(t.size()), dtype=torch.int64)


def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
    """``P2PCommunicator._communicate_shapes`` over this rank's gloo pipeline group: (recv_prev_shape,
    recv_next_shape), [0, 0, 0] for one not received."""
    if self.config.use_ring_exchange_p2p:
        return _megatron_communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)
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


def apply_host_p2p_shapes() -> bool:
    """Make Megatron's pipeline p2p exchange shapes over the gloo pipeline group (see the module text);
    True when applied. Idempotent."""
    global _shapes_applied, _megatron_communicate_shapes
    if _shapes_applied:
        return True
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    _megatron_communicate_shapes = P2PCommunicator._communicate_shapes
    P2PCommunicator._communicate_shapes = _communicate_shapes
    _shapes_applied = True
    return True


def host_p2p_shapes_applied() -> bool:
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

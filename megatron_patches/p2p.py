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
"""

from __future__ import annotations

import types

import torch

_applied = False


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

"""Host reads of a microbatch's device tensors inside the pipeline schedule, caught on CPU.

On a GPU the runtime moves each packed microbatch to the device (``PackedBatch.to``) inside the schedule's
forward step. Reading one of those tensors back on the host there (``.tolist()``, ``.item()``, ``bool()``,
``.cpu()``, ``.numpy()``) makes the host wait for the compute stream; under interleaved 1F1B on NCCL that
stream may be waiting for a p2p receive whose peer sends only after this rank's next p2p call, so the host
never gets there: a deadlock that gloo (CPU) cannot show. :func:`install` makes ``PackedBatch.to`` return
tensors that record such reads while :func:`lorafusion.runtime.pipeline.run_schedule` runs (the chunk's one
read of losses and norms after the schedule is outside it), and :data:`reads` lists where they came from.
Operations on those tensors give ordinary tensors: what is caught is a direct host read of the batch's
tensors (``cu_seqlens.tolist()`` in attention or RoPE, say)."""

from __future__ import annotations

import traceback

import torch

reads: list[str] = []
_state = {"watching": False}


def _caller() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "device_reads" not in f.filename]
    return " <- ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                       for f in frames[-4:][::-1])


def _read(name):
    original = getattr(torch.Tensor, name)

    def method(self, *args, **kwargs):
        if _state["watching"]:
            reads.append(f"{name}: {_caller()}")
        return original(self, *args, **kwargs)

    method.__name__ = name
    return method


class DeviceTensor(torch.Tensor):
    """A tensor that on a GPU would live on the device; host reads of it are recorded while watching."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # results of ops are plain tensors


for _name in ("tolist", "item", "__bool__", "cpu", "numpy", "__int__", "__float__", "__index__"):
    setattr(DeviceTensor, _name, _read(_name))


def install():
    """Patch ``PackedBatch.to`` and ``run_schedule`` (module attributes); returns a function undoing it."""
    from lorafusion.data.packing import PackedBatch
    from lorafusion.runtime import pipeline

    to, run_schedule = PackedBatch.to, pipeline.run_schedule

    def device_to(self, device):
        moved = to(self, device)
        for field in ("tokens", "position_ids", "labels", "loss_mask", "cu_seqlens"):
            setattr(moved, field, getattr(moved, field).as_subclass(DeviceTensor))
        return moved

    def watched(*args, **kwargs):
        _state["watching"] = True
        try:
            return run_schedule(*args, **kwargs)
        finally:
            _state["watching"] = False

    PackedBatch.to, pipeline.run_schedule = device_to, watched

    def undo():
        PackedBatch.to, pipeline.run_schedule = to, run_schedule

    return undo

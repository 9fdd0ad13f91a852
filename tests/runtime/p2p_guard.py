"""A check that a training run's pipeline p2p moves data only: every tensor that ``torch.distributed``'s
point to point calls (``isend``, ``irecv``, ``batch_isend_irecv``) carry is checked, and a shape tensor
(int64, what Megatron's own shape exchange and the gloo cross-check send) fails the run. The pipeline's
shapes come from the plan on each rank (megatron_patches.local_p2p_shapes), so no such tensor should ever be
sent. Installed by tests/runtime/sync_guard.py for the two-process pipeline runs; ``enabled`` turns it off
for the others."""

import torch
import torch.distributed as dist

enabled = True
_real = {}


def check(tensor: torch.Tensor, what: str) -> None:
    if enabled and tensor.dtype == torch.int64:
        raise AssertionError(f"a shape exchange in the pipeline p2p ({what} of an int64 tensor of "
                             f"{tensor.numel()} elements): the shapes come from the plan, not from the peer")


def install() -> None:
    """Wrap ``isend``, ``irecv`` and ``batch_isend_irecv`` with :func:`check` (idempotent)."""
    if _real:
        return
    from torch.distributed import distributed_c10d

    for name in ("isend", "irecv"):
        _real[name] = getattr(dist, name)

        def op(tensor, *args, _name=name, **kwargs):
            check(tensor, _name)
            return _real[_name](tensor, *args, **kwargs)
        # both names: a P2POp accepts only the op that distributed_c10d holds
        setattr(dist, name, op)
        setattr(distributed_c10d, name, op)
    _real["batch_isend_irecv"] = dist.batch_isend_irecv

    def batch(ops):
        for o in ops:
            check(o.tensor, "batch_isend_irecv")
        return _real["batch_isend_irecv"](ops)
    dist.batch_isend_irecv = batch

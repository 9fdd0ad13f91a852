"""``python tests/runtime/sync_guard.py train RUN.yaml``: ``lorafusion train`` in which a device-wide
``torch.cuda.synchronize()`` fails the run while any adapter's gradient-norm all-reduce is pending.

On GPUs such a synchronise waits for an NCCL all-reduce that the other pipeline stages join only after
this stage's next send: a deadlock (PP=4, 70B, 2026-11-22). On CPU the all-reduce is gloo's and nothing
hangs, so the two-process PP tests launch through this guard to catch the pattern itself. The guard also
fails any shape exchange in the pipeline p2p (tests/runtime/p2p_guard.py): the shapes come from the plan."""

import sys

import torch

import p2p_guard
from megatron_patches import apply_cpu_patches
from lorafusion.runtime import optim

apply_cpu_patches()  # (idempotent: init_distributed's later call keeps the guard below)
pending: set[int] = set()
enabled = True
begin, end = optim.AdapterOptimizer.begin_step, optim.AdapterOptimizer.end_step


def begin_step(self):
    begin(self)
    if self._work is not None:
        pending.add(id(self))


def end_step(self):
    pending.discard(id(self))
    return end(self)


def synchronize(device=None):
    if enabled and pending:
        raise AssertionError(f"device-wide torch.cuda.synchronize() while {len(pending)} gradient-norm "
                             f"all-reduce(s) are pending: on GPUs this deadlocks the pipeline")


optim.AdapterOptimizer.begin_step, optim.AdapterOptimizer.end_step = begin_step, end_step
torch.cuda.synchronize = synchronize
p2p_guard.install()

if __name__ == "__main__":
    from lorafusion.cli import main

    sys.exit(main())

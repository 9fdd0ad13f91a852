"""Host memory of a run trained without GPUs, torch-free: what a CPU launch needs, what the machine has, and
the one-line refusal of a run that cannot fit (an 8B base on a laptop), given before the model is built (a
run's need at its resolved capacity and recompute: :func:`lorafusion.resolve.check_run_on_host`).

The need counts the tensors the ranks on this host hold, per pipeline stage (:mod:`.memory`'s counts, taken on
the CPU's paths: Megatron's local ops, per-sample attention, no GPU calibration):

    weights + LoRA weights and AdamW state + the microbatches' saved activations in flight
    + the working set: a layer's backward, or on the last stage the loss's logits (CPU: the whole microbatch's
      logits in the model's dtype, their fp32 copy and softmax: ``capacity · vocab · (dtype bytes + 8)``)
    + ``PROCESS_BYTES`` per process (Python, torch, Megatron, gloo)

What the host has: ``MemAvailable`` of ``/proc/meminfo`` (``os.sysconf`` elsewhere), lowered to the room left
under a cgroup's memory limit (a container or a Slurm job's allocation).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .memory import GIB, Coefficients, MemorySetup, stage_memory

__all__ = ["HostNeed", "PROCESS_BYTES", "available_bytes", "gpu_device_seen", "host_need", "no_fit_on_host"]

# one training process beside its tensors: the interpreter with torch, Megatron and gloo imported measured 435
# MiB resident on the 2-core CPU machine; the data, the plans and the allocator's slack take the rest
PROCESS_BYTES = 0.75 * GIB
# counts only: the GPU calibration's constant, margins and activation scale do not describe the CPU's
# allocator
CPU_COUNTS = Coefficients(act_scale=1.0, workspace=1.0, constant_bytes=0.0, margin_frac=0.0, margin_bytes=0.0,
                          source="counted tensors (host memory)")


@dataclass(frozen=True)
class HostNeed:
    """Bytes the ranks on one host need, in total and by part (GiB-printable)."""

    total: float
    parts: dict[str, float]
    processes: int

    def describe(self) -> str:
        return " + ".join(f"{k} {v / GIB:.1f}" for k, v in self.parts.items() if v >= 0.05 * GIB) + " GiB"


def host_need(s: MemorySetup, capacity: int, recompute_layers: int | Sequence[int],
              processes: int) -> HostNeed:
    """What ``processes`` ranks of the run ``s`` on one host hold at their peak, without GPUs. The ranks are
    taken as an even share of the launch's ``tp·pp·dp``: each stage's tensors ``processes / pp`` times."""
    setup = replace(s, fused_ops=False, attention="per-sample")
    rc = [recompute_layers] * s.pp if isinstance(recompute_layers, int) else list(recompute_layers)
    share = processes / s.pp  # copies of each stage's (TP-sharded) tensors on this host
    parts = {"weights": 0.0, "adapters+optimizer": 0.0, "activations": 0.0, "working set": 0.0}
    for k in range(s.pp):
        m = stage_memory(setup, k, capacity, rc[k], CPU_COUNTS)
        logits = capacity * s.arch.vocab_size / s.tp * (s.dtype_bytes + 8) if k == s.pp - 1 else 0.0
        parts["weights"] += share * m.weights
        parts["adapters+optimizer"] += share * (m.lora + m.optimizer_step)
        parts["activations"] += share * m.in_flight * m.per_microbatch
        parts["working set"] += share * max(m.transient, logits)  # the last stage's: the loss's logits
    parts["processes"] = processes * PROCESS_BYTES
    return HostNeed(sum(parts.values()), parts, processes)


def _meminfo_available(meminfo: Path) -> float | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room(root: Path) -> float | None:
    """Bytes left under this process's cgroup memory limit (v2, else v1); None without a limit."""
    for limit, used in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes",
                                                            "memory/memory.usage_in_bytes")):
        try:
            text = (root / limit).read_text().strip()
            if text == "max" or int(text) >= 1 << 60:
                return None
            return max(0.0, float(int(text) - int((root / used).read_text().strip())))
        except (OSError, ValueError):
            continue
    return None


def available_bytes(meminfo: Path = Path("/proc/meminfo"),
                    cgroup: Path = Path("/sys/fs/cgroup")) -> float | None:
    """Host memory a new run may take: MemAvailable (or free pages by ``os.sysconf``), at most the room under
    the cgroup's limit; None when the system does not say."""
    avail = _meminfo_available(meminfo)
    if avail is None:
        try:
            avail = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    room = _cgroup_room(cgroup)
    return avail if room is None else min(avail, room)


def gpu_device_seen(dev: Path = Path("/dev")) -> bool:
    """Whether this process may see a CUDA GPU, known before torch is imported (seconds): an NVIDIA device
    node and ``CUDA_VISIBLE_DEVICES`` not set to none. False means the CPU will train the run."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    try:
        return any(p.name[len("nvidia"):].isdigit() for p in dev.glob("nvidia[0-9]*"))
    except OSError:
        return True  # cannot tell: torch decides


def no_fit_on_host(need: HostNeed, available: float | None, source: str) -> str | None:
    """The one-line refusal when ``need`` exceeds ``available`` bytes (None when it fits or nothing is
    known)."""
    if available is None or need.total <= available:
        return None
    procs = f"{need.processes} processes" if need.processes > 1 else "one process"
    return (f"{source}: the run needs about {need.total / GIB:.1f} GiB of host memory to train on this "
            f"machine's CPU (no CUDA GPU; {procs}: {need.describe()}) and {available / GIB:.1f} GiB is "
            "available — launch it on GPUs (scripts/train.sh on a GPU machine), or lower model.preset / "
            "scheduler.token_capacity")

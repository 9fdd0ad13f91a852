"""Host memory of a CPU run (scheduler/host.py): the need counted from the architecture, what the machine has
(/proc/meminfo, a cgroup's limit), and the one-line refusal."""

import pytest

from lorafusion.core.arch import preset
from lorafusion.scheduler.host import (
    PROCESS_BYTES,
    available_bytes,
    gpu_device_seen,
    host_need,
    no_fit_on_host,
)
from lorafusion.scheduler.memory import GIB, AdapterShape, MemorySetup, stage_weights


def _setup(pp: int = 1) -> MemorySetup:
    return MemorySetup(preset("llama3.1-8b"), (AdapterShape(16),) * 4, dtype="bfloat16", pp=pp)


def test_the_8b_need_counts_its_bf16_weights_the_logits_and_every_process():
    s = _setup()
    need = host_need(s, 4096, 32, processes=1)
    assert need.parts["weights"] == stage_weights(s, 0)
    assert 14.9 * GIB < need.parts["weights"] < 15.1 * GIB  # 8.03 B parameters in bf16
    assert need.parts["working set"] == pytest.approx(4096 * 128256 * (2 + 8))  # the CPU loss's logits
    assert need.parts["processes"] == PROCESS_BYTES
    assert need.total == pytest.approx(sum(need.parts.values()))
    # two pipeline stages on one host hold the same tensors, split, in two processes
    two = host_need(_setup(pp=2), 4096, 16, processes=2)
    assert two.parts["weights"] == pytest.approx(need.parts["weights"])
    assert two.parts["processes"] == 2 * PROCESS_BYTES


def test_the_refusal_names_what_is_needed_and_what_is_there():
    need = host_need(_setup(), 4096, 32, processes=1)
    msg = no_fit_on_host(need, 16 * GIB, "run.yaml")
    assert msg.startswith(f"run.yaml: the run needs about {need.total / GIB:.1f} GiB of host memory")
    assert "and 16.0 GiB is available" in msg and "weights 15.0" in msg and "\n" not in msg
    assert no_fit_on_host(need, need.total + 1, "run.yaml") is None
    assert no_fit_on_host(need, None, "run.yaml") is None  # the system does not say: no refusal


def test_available_memory_is_meminfo_capped_by_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1 kB\nMemAvailable:   20000000 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    assert available_bytes(meminfo, cg) == 20000000 * 1024  # no limit
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text("5\n")
    assert available_bytes(meminfo, cg) == 20000000 * 1024
    (cg / "memory.max").write_text(f"{8 * GIB}\n")
    (cg / "memory.current").write_text(f"{GIB}\n")
    assert available_bytes(meminfo, cg) == 7 * GIB  # a container's 8 GiB, 1 in use


def test_a_gpu_is_seen_from_its_device_node_unless_hidden(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert not gpu_device_seen(tmp_path)
    (tmp_path / "nvidiactl").write_text("")
    assert not gpu_device_seen(tmp_path)
    (tmp_path / "nvidia0").write_text("")
    assert gpu_device_seen(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not gpu_device_seen(tmp_path)

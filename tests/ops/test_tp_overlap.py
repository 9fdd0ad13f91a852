"""The overlapped tensor-parallel linears (lorafusion.ops.tp_overlap): the nano-batch split, and on two gloo
ranks every pattern equal to the unsplit math."""

import sys
from pathlib import Path

import pytest
import torch

from lorafusion.ops.tp_overlap import nano_bounds


@pytest.mark.parametrize("rows,n,multiple", [(37, 3, 8), (4096, 2, 8), (4096, 4, 8), (5, 4, 8), (17, 2, 8),
                                             (100, 7, 1), (1, 2, 1), (0, 2, 8), (64, 16, 8)])
def test_nano_bounds_cover_the_rows_in_order(rows, n, multiple):
    b = nano_bounds(rows, n, multiple)
    assert 1 <= len(b) <= max(1, n) or rows == 0
    assert [a for a, _ in b[1:]] == [e for _, e in b[:-1]]  # contiguous, in order
    assert (b[0][0], b[-1][1]) == (0, rows) if rows else b == []
    assert all(e > a for a, e in b)  # never an empty nano-batch
    assert all(a % multiple == 0 for a, _ in b)  # cuts at whole multiples
    sizes = [e - a for a, e in b]
    if len(b) > 1:  # as equal as the multiple allows
        assert max(sizes[:-1]) - min(sizes[:-1]) <= multiple and sizes[-1] >= 1


def test_nano_bounds_split_evenly_and_refuse_nonsense():
    assert nano_bounds(4096, 2) == [(0, 2048), (2048, 4096)]
    assert nano_bounds(4096, 4) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]
    assert nano_bounds(15, 2, 8) == [(0, 15)]  # below two multiples: no split
    assert nano_bounds(37, 3, 8) == [(0, 8), (8, 24), (24, 37)]
    assert nano_bounds(37, 3) == [(0, 12), (12, 25), (25, 37)]
    assert nano_bounds(1, 4) == [(0, 1)] and nano_bounds(0, 2) == []
    with pytest.raises(ValueError, match="n and multiple"):
        nano_bounds(10, 0)


def _two_ranks(tmp_path, backend: str) -> None:
    from session_shared import launch_two_ranks

    worker = Path(__file__).with_name("tp_overlap_worker.py")
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    codes = launch_two_ranks([sys.executable, str(worker), str(tmp_path), backend], logs, timeout=180)
    assert codes == [0, 0], "\n".join(p.read_text()[-3000:] for p in logs)
    assert (tmp_path / "ok.txt").read_text() == "ok"


@pytest.mark.slow
def test_overlapped_linears_equal_the_unsplit_math_on_two_ranks(tmp_path):
    _two_ranks(tmp_path, "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs")
def test_overlapped_linears_on_two_gpus_over_nccl(tmp_path):
    """The same on two GPUs over NCCL in bf16: collectives in flight on NCCL's stream while the compute stream
    runs the next GEMM (and frees tensors the caching allocator hands out again)."""
    _two_ranks(tmp_path, "nccl")

"""Inside the pipeline schedule nothing reads a microbatch's device tensors back on the host (see
tests/runtime/device_reads.py: under interleaved 1F1B on NCCL such a read can deadlock the pipeline).

The run is fp32, whose attention is the per-sample path on every machine (FlashAttention takes 16-bit only):
the quickstart's case. The model is built with the fused ops' torch implementation, as a GPU run builds it
with their Triton one (the RoPE of packed rows is then ours, not Megatron's, which reads ``cu_seqlens``)."""

import pytest

from device_reads import install, reads
from runtime_utils import three_job_dicts, train_inprocess, write_run


@pytest.fixture
def watch_reads(monkeypatch):
    from lorafusion.models import provider
    from lorafusion.models.fused import resolve_fused_ops

    monkeypatch.setattr(provider, "resolve_fused_ops",
                        lambda mode, device: resolve_fused_ops("torch" if mode is None else mode, device))
    reads.clear()
    undo = install()
    yield reads
    undo()


@pytest.mark.parametrize("recompute", [False, True])
def test_no_host_read_of_batch_tensors_inside_the_schedule(tmp_path, megatron_single, watch_reads,
                                                           recompute):
    run = write_run(tmp_path, three_job_dicts(tmp_path), capacity=160, recompute=recompute)
    _, out = train_inprocess(run)
    assert (out / "metrics.jsonl").read_text().count('"loss"') >= 3  # it trained
    assert not watch_reads, "\n".join(dict.fromkeys(watch_reads))


def test_the_guard_sees_a_host_read(tmp_path, megatron_single, watch_reads, monkeypatch):
    """The check itself: attention reading ``cu_seqlens`` from the batch's tensor is caught."""
    from lorafusion.models import attention

    real = attention.varlen_attention_reference
    monkeypatch.setattr(attention, "varlen_attention_reference",
                        lambda q, k, v, cu, scale, bounds=None: real(q, k, v, cu, scale, None))
    run = write_run(tmp_path, three_job_dicts(tmp_path), capacity=160)
    train_inprocess(run)
    assert any(r.startswith("tolist:") and "attention.py" in r for r in watch_reads), watch_reads[:5]

"""megatron_patches.apply_host_synchronous_p2p: interleaved 1F1B's unbatched p2p returns only once its
transfers are done on the GPU (the current stream synchronised), so the host never launches compute while one
of its p2p kernels spins waiting for a peer; batched p2p and calls that do not wait are left alone."""

from types import SimpleNamespace

import pytest
import torch

from megatron_patches.p2p import _synchronous


class _Stream:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("sync")


@pytest.fixture
def fake_cuda(monkeypatch):
    log = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(log))
    return log


def _communicator(batched: bool):
    return SimpleNamespace(config=SimpleNamespace(batch_p2p_comm=batched))


def _communicate(log):
    def communicate(self, **kwargs):
        log.append("p2p")
        return ("prev", "next")
    return communicate


@pytest.mark.parametrize("batched, wait, expected", [(False, True, ["p2p", "sync"]), (False, False, ["p2p"]),
                                                     (True, True, ["p2p"])])
def test_unbatched_waited_p2p_synchronises_the_stream_after(fake_cuda, batched, wait, expected):
    wrapped = _synchronous(_communicate(fake_cuda))
    out = wrapped(_communicator(batched), tensor_send_next=None, tensor_send_prev=None, recv_prev=True,
                  recv_next=False, tensor_shape=(4, 1, 8), wait_on_reqs=wait)
    assert out == ("prev", "next") and fake_cuda == expected


def test_interleaved_config_does_not_overlap_p2p():
    from lorafusion.core.arch import preset
    from lorafusion.models.spec import transformer_config

    cfg = transformer_config(preset("tiny-llama"), pp=2, virtual_stages=2)
    assert (cfg.overlap_p2p_comm, cfg.batch_p2p_comm) == (False, False)

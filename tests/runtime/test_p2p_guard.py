"""The two-process pipeline runs' p2p guard (tests/runtime/p2p_guard.py) fails a shape tensor sent over
``isend``, ``irecv`` or ``batch_isend_irecv`` and lets the data through; turned off, it lets everything
through."""

import pytest
import torch

import p2p_guard


def test_the_guard_fails_a_shape_tensor_and_passes_data(monkeypatch):
    monkeypatch.setattr(p2p_guard, "enabled", True)
    with pytest.raises(AssertionError, match="a shape exchange in the pipeline p2p"):
        p2p_guard.check(torch.tensor([5, 1, 8], dtype=torch.int64), "isend")
    p2p_guard.check(torch.zeros(5, 1, 8), "isend")
    monkeypatch.setattr(p2p_guard, "enabled", False)
    p2p_guard.check(torch.tensor([5, 1, 8], dtype=torch.int64), "isend")

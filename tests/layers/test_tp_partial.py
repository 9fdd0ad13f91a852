"""The LoRA gradients the TP linears leave partial over the TP ranks (lorafusion.ops.comm): which parameters
they are, the mark, and the refusal to mix the TP path (partial) with Megatron's (full) in one linear.
(Summing them over two ranks, and the results equal to one process: tests/test_parallel.py,
tests/layers/test_tp_switch.py.)"""

from types import SimpleNamespace

import pytest
import torch

from lorafusion.layers.tp_overlap import partial_factors, refuse_partial
from lorafusion.ops.comm import is_partial_grad, mark_partial_grad, sum_partial_grads


def _linear(mode: str, tp: int = 2):
    params = lambda: torch.nn.ParameterDict({"a": torch.nn.Parameter(torch.zeros(2, 3))})  # noqa: E731
    return SimpleNamespace(s_comm_mode=mode, lora_A=params(), lora_B=params(), lora_key="1.linear_x",
                           _tp=lambda: (tp, 0))


def test_the_replicated_factor_is_the_partial_one():
    col, row = _linear("column"), _linear("row")
    assert list(partial_factors(col)) == list(col.lora_A.values())  # A replicated, B sharded by out-rows
    assert list(partial_factors(row)) == list(row.lora_B.values())  # B replicated, A sharded by in-columns


def test_a_linear_whose_grads_went_partial_refuses_megatrons_path():
    lin = _linear("column")
    refuse_partial(lin)  # never on the TP path: Megatron's path is fine
    mark_partial_grad(partial_factors(lin))
    assert is_partial_grad(lin.lora_A["a"]) and not is_partial_grad(lin.lora_B["a"])
    with pytest.raises(RuntimeError, match="1.linear_x ran its TP path before"):
        refuse_partial(lin)
    one = _linear("column", tp=1)
    mark_partial_grad(partial_factors(one))
    refuse_partial(one)  # tp = 1: nothing is partial to mix


def test_sum_partial_grads_does_nothing_on_one_rank():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    mark_partial_grad([p])
    assert sum_partial_grads([p], None) == 0 and torch.equal(p.grad, torch.full((3,), 2.0))

"""Switching ``config.tp_overlap`` between microbatches (as the TP-overlap benchmark does between chunks) at
TP=2 with sequence parallelism: both ranks issue the same collectives in the same order, of the same shapes,
in every microbatch (a rank that took another path than its peer — overlapped on one, Megatron's on the
other, or a saved input re-gathered on one rank only — would pair different collectives and hang NCCL); and
how many collectives of each kind a microbatch issues."""

import json
import sys
from pathlib import Path

import pytest

from hf_utils import write_hf_checkpoint
from lorafusion.core.arch import ModelArch

pytestmark = pytest.mark.slow
ARCH = ModelArch(family="llama", vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4,
                 num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=128)


@pytest.fixture(scope="module")
def tp_switch_ranks(tmp_path_factory):
    """The two ranks' records of tp_switch_worker.py (one launch for the tests of this module)."""
    from session_shared import launch_two_ranks

    d = tmp_path_factory.mktemp("tp_switch")
    write_hf_checkpoint(ARCH, d / "base")
    worker = Path(__file__).with_name("tp_switch_worker.py")
    logs = [d / "rank0.log", d / "rank1.log"]
    # ~15 s; ranks that pair different collectives hang in gloo until the timeout
    codes = launch_two_ranks([sys.executable, str(worker), str(d)], logs, timeout=120)
    assert codes == [0, 0], "\n".join(p.read_text()[-3000:] for p in logs)
    records = [json.loads((d / f"rank{r}.json").read_text()) for r in range(2)]
    # every LoRA linear's cached TP geometry is its rank's
    assert [rec["tp_geometry"] for rec in records] == [[[2, 0]], [[2, 1]]]
    STEP.extend(rec["step"] for rec in records)
    FP8.extend(rec["fp8"] for rec in records)
    return [rec["microbatches"] for rec in records]


STEP: list = []  # the two ranks' sum of partial gradients after the microbatches (see the fixture)
FP8: list = []  # the two ranks' collectives of one microbatch with an FP8 base


def test_tp_overlap_switched_between_microbatches_keeps_the_ranks_collectives_paired(tp_switch_ranks):
    ranks = tp_switch_ranks
    assert [mb["overlap"] for mb in ranks[0]] == [2, 0, 2, 0]
    for step, (a, b) in enumerate(zip(*ranks, strict=True)):
        assert a["collectives"] == b["collectives"], f"microbatch {step}: the ranks' collectives differ"
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        # every decoder linear overlapped while on, none while off (the switch reaches every layer)
        assert a["overlapped"] == b["overlapped"] == (4 * ARCH.num_layers if a["overlap"] else 0)
    on, off = ranks[0][0]["collectives"], ranks[0][1]["collectives"]
    # overlapped or not, the same collectives in the same order (only when each is waited for differs)
    assert [n for n, *_ in on] == [n for n, *_ in off]


def _expected_collectives(layers: int) -> dict[str, int]:
    """The collectives of one microbatch's forward and backward at TP=2 + SP, every linear carrying LoRA
    (the decoder's: ``L`` layers, each two column linears — qkv, fc1 — and two row linears — proj, fc2)."""
    L = layers
    return {
        # forward: one per column linear (base and LoRA term share the gathered input), the output layer's;
        # backward: one of dY per row linear (base and LoRA term share it), one per column linear to rebuild
        # the LoRA term's saved input from this rank's shard (Megatron's path + the LoRA term: 10L + 1)
        "all_gather_into_tensor": 2 * L + 1 + 2 * L + 2 * L,
        # the embedding's, one per row linear (its base and partial LoRA term summed together); backward: the
        # output layer's, one of dX per column linear (base and partial LoRA dX together) but the first
        # layer's qkv, whose input (the frozen embedding) needs none
        "reduce_scatter_tensor": 1 + 2 * L + 1 + 2 * L - 1,
        # the vocabulary-parallel loss's three; no linear's (Megatron's path + the LoRA term: S of each row
        # linear, dS of each column linear, 4L more)
        "all_reduce": 3,
    }


def test_lora_grads_left_partial_are_summed_once_a_step_in_one_all_reduce(tp_switch_ranks):
    """The column linears' A gradients and the row linears' B gradients (replicated factors, partial over TP
    on the TP path) are summed by one all-reduce of one flat buffer of all of them after the microbatches,
    the same on both ranks."""
    a, b = STEP
    assert a == b
    # 2 adapters x all-linear: per layer qkv's and fc1's A, proj's and fc2's B
    assert a["summed"] == 2 * 4 * ARCH.num_layers
    assert [n for n, *_ in a["collectives"]] == ["all_reduce"]


def test_tp_and_sequence_parallel_collectives_per_microbatch(tp_switch_ranks):
    """TP=2 + SP, overlapped or not: a column linear all-gathers its input once in forward (for the base and
    every adapter's LoRA term) and once in backward, reduce-scatters dX once; a row linear all-gathers dY
    once for base and LoRA term. Counted per microbatch on rank 0 (both ranks issue the same, above)."""
    from collections import Counter

    for mb in tp_switch_ranks[0]:
        got = Counter(n for n, *_ in mb["collectives"])
        assert dict(got) == _expected_collectives(ARCH.num_layers), mb["overlap"]


def test_fp8_base_lora_shares_the_base_collectives(tp_switch_ranks):
    """An FP8 base (Megatron's collectives around its own GEMM) at TP=2 + SP: the LoRA term rides on them as
    on the TP path — one all-gather of a column linear's input for base and LoRA term, no all-reduce of S or
    dS, one all-gather of a row linear's dY — so a microbatch issues the same collectives as the bf16 base's.
    (Megatron's path plus the LoRA term on its own: a second all-gather per column linear and per row
    linear's dY, and 4 all-reduces per layer.)"""
    from collections import Counter

    a, b = FP8
    assert a == b
    assert dict(Counter(n for n, *_ in a)) == _expected_collectives(ARCH.num_layers)


def test_saved_input_gathers_are_prefetched_under_the_row_linears_backward(tp_switch_ranks):
    """Without overlap (every base collective in line), the all-gather that rebuilds a column linear's saved
    LoRA input in backward is issued without waiting, right after the all-gather of dY of the row linear after
    it in forward (fc2 for fc1, proj for qkv): one per column linear, running under that row linear's dX GEMM
    and the backward between the two, not in line when the LoRA term's backward needs it."""
    for mb in tp_switch_ranks[0]:
        if mb["overlap"]:
            continue
        calls = mb["collectives"]
        early = [i for i, (n, _, async_op) in enumerate(calls) if async_op]
        assert len(early) == 2 * ARCH.num_layers
        for i in early:
            assert calls[i][0] == calls[i - 1][0] == "all_gather_into_tensor" and not calls[i - 1][2]
            # then the column linear's dX (none for the first layer's qkv: its input, the frozen embedding's)
            assert i + 1 == len(calls) or calls[i + 1][0] == "reduce_scatter_tensor"

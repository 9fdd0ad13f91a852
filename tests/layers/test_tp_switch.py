"""Switching ``config.tp_overlap`` between microbatches (as the TP-overlap benchmark does between chunks) at
TP=2 with sequence parallelism: both ranks issue the same collectives in the same order, of the same shapes,
in every microbatch (a rank that took another path than its peer — overlapped on one, Megatron's on the
other, or a saved input re-gathered on one rank only — would pair different collectives and hang NCCL)."""

import json
import sys
from pathlib import Path

import pytest

from hf_utils import write_hf_checkpoint
from lorafusion.core.arch import ModelArch

pytestmark = pytest.mark.slow
ARCH = ModelArch(family="llama", vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4,
                 num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=128)


def test_tp_overlap_switched_between_microbatches_keeps_the_ranks_collectives_paired(tmp_path):
    from session_shared import launch_two_ranks

    write_hf_checkpoint(ARCH, tmp_path / "base")
    worker = Path(__file__).with_name("tp_switch_worker.py")
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    # ~15 s; ranks that pair different collectives hang in gloo until the timeout
    codes = launch_two_ranks([sys.executable, str(worker), str(tmp_path)], logs, timeout=120)
    assert codes == [0, 0], "\n".join(p.read_text()[-3000:] for p in logs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [mb["overlap"] for mb in ranks[0]] == [2, 0, 2, 0]
    for step, (a, b) in enumerate(zip(*ranks, strict=True)):
        assert a["collectives"] == b["collectives"], f"microbatch {step}: the ranks' collectives differ"
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        # every decoder linear overlapped while on, none while off (the switch reaches every layer)
        assert a["overlapped"] == b["overlapped"] == (4 * ARCH.num_layers if a["overlap"] else 0)
    on, off = ranks[0][0]["collectives"], ranks[0][1]["collectives"]
    # the overlapped column linears reuse the base's gathered input: fewer all-gathers than Megatron's path
    count = lambda seq, name: sum(1 for n, _ in seq if n == name)  # noqa: E731
    assert count(on, "all_gather_into_tensor") < count(off, "all_gather_into_tensor")

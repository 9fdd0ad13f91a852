"""Interleaved 1F1B on four processes: PP=4 x 2 virtual stages (a 10-layer tiny LLaMA split unevenly over the
eight virtual stages through Megatron's pipeline layout, with recompute) trains exactly like one process, with
every p2p shape the ranks take from the plan cross-checked against the one the peer sends
(LORAFUSION_P2P_SHAPE_CHECK). The two-process PP=2 x 2 runs are in test_distributed.py (LAYOUTS pp2_v2*)."""

import json

import pytest

from hf_utils import write_hf_checkpoint
from runtime_utils import assert_trained_alike, three_job_dicts, train_inprocess, train_torchrun, write_run

SPLIT = [2, 1, 1, 1, 1, 1, 2, 1]  # per virtual stage in layer order: rank r holds stages r and 4 + r


@pytest.mark.slow
def test_four_process_pp4_v2_equals_one_process(tmp_path, megatron_single, monkeypatch):
    monkeypatch.setenv("LORAFUSION_P2P_SHAPE_CHECK", "1")
    from lorafusion.core.arch import preset

    base = tmp_path / "base"
    write_hf_checkpoint(preset("tiny-llama", num_layers=10), base)
    jobs = three_job_dicts(tmp_path)
    _, ref = train_inprocess(write_run(tmp_path, jobs, out="one", model_path=base, name="one.yaml"))
    run = write_run(tmp_path, jobs, out="four", model_path=base, name="four.yaml", pp=4, virtual_stages=2,
                    recompute=True, stage_layers=SPLIT)
    four = train_torchrun(run, 4, tmp_path / "four")
    assert_trained_alike(four, ref)
    summary = json.loads((four / "summary.json").read_text())
    assert summary["bubble_ratio"] is not None and 0 <= summary["bubble_ratio"] < 1

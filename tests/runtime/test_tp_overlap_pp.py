"""TP=2 x PP=2 on four processes with the TP collectives overlapped with compute (``parallelism.tp_overlap:
on``; sequence parallelism, recompute) trains exactly like one process: per-step losses, gradient norms and
the final adapters; every p2p shape the ranks take from the plan (a microbatch's tokens over tp under sequence
parallelism) is cross-checked against the one the peer sends (LORAFUSION_P2P_SHAPE_CHECK). (Two-process TP=2
runs with overlap are in test_distributed.py.)"""

import json

import pytest

from runtime_utils import assert_trained_alike, three_job_dicts, train_inprocess, train_torchrun, write_run


@pytest.mark.slow
def test_four_process_tp2_pp2_with_overlap_equals_one_process(tmp_path, megatron_single, monkeypatch):
    monkeypatch.setenv("LORAFUSION_P2P_SHAPE_CHECK", "1")
    jobs = three_job_dicts(tmp_path)
    _, ref = train_inprocess(write_run(tmp_path, jobs, out="one", name="one.yaml"))
    run = write_run(tmp_path, jobs, out="four", name="four.yaml", tp=2, pp=2, sequence_parallel=True,
                    recompute=True, tp_overlap="on")
    four = train_torchrun(run, 4, tmp_path / "four")
    assert_trained_alike(four, ref)
    summary = json.loads((four / "summary.json").read_text())
    assert summary["run_plan"]["tp_overlap"] == 2 and summary["parallelism"]["tp"] == 2

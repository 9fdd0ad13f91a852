"""Interleaved 1F1B on four processes: PP=4 x 2 virtual stages (a 10-layer tiny LLaMA split unevenly over the
eight virtual stages through Megatron's pipeline layout, with recompute) trains exactly like one process. The
two-process PP=2 x 2 runs are in test_distributed.py (LAYOUTS pp2_v2*)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_utils import write_hf_checkpoint
from runtime_utils import assert_close, load_adapter, three_job_dicts, train_inprocess, write_run

ROOT = Path(__file__).resolve().parents[2]
SPLIT = [2, 1, 1, 1, 1, 1, 2, 1]  # per virtual stage in layer order: rank r holds stages r and 4 + r


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda r: (r["job"], r["step"]))


@pytest.mark.slow
def test_four_process_pp4_v2_equals_one_process(tmp_path, megatron_single):
    from lorafusion.core.arch import preset

    base = tmp_path / "base"
    write_hf_checkpoint(preset("tiny-llama", num_layers=10), base)
    jobs = three_job_dicts(tmp_path)
    _, ref = train_inprocess(write_run(tmp_path, jobs, out="one", model_path=base, name="one.yaml"))
    run = write_run(tmp_path, jobs, out="four", model_path=base, name="four.yaml", pp=4, virtual_stages=2,
                    recompute=True, stage_layers=SPLIT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
         "-m", "lorafusion.cli", "train", str(run)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    four = tmp_path / "four"
    ours, theirs = _metrics(four), _metrics(ref)
    assert [(r["job"], r["step"]) for r in ours] == [(r["job"], r["step"]) for r in theirs]
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
    for job in ("rev", "up", "rev2"):
        assert_close(load_adapter(four, job), load_adapter(ref, job), rel=1e-4)
    summary = json.loads((four / "summary.json").read_text())
    assert summary["bubble_ratio"] is not None and 0 <= summary["bubble_ratio"] < 1

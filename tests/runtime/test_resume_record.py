"""`train --resume` continues the run as it was started: the run directory records the effective config
(overrides included); the user passes only what changes, and each change is named on stderr."""

import json
import os
import subprocess
import sys
from pathlib import Path

from runtime_utils import job_dict, write_dataset, write_run

ROOT = Path(__file__).resolve().parents[2]


def _train(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "lorafusion.cli", "train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_resume_needs_only_the_change(tmp_path):
    data = write_dataset(tmp_path / "a.jsonl", 1, rows=40)
    run = write_run(tmp_path, [job_dict("a", data, r=4, steps=4, gbs=4)], out="o")
    first = _train(str(run), "jobs.a.eval_split=0.25", "jobs.a.eval_every=2", "seed=5")
    assert first.returncode == 0, first.stderr[-3000:]
    record = json.loads((tmp_path / "o" / "run_config.json").read_text())
    assert record["effective"]["jobs"][0]["eval_split"] == 0.25 and record["effective"]["seed"] == 5
    again = _train(str(run), "jobs.a.max_steps=6", "--resume", "--json")  # without the first run's overrides
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stderr.splitlines()
    at = next(i for i, line in enumerate(said) if "resuming" in line)
    assert said[at].endswith("with the config it recorded at its start, changed:")
    assert said[at + 1:at + 3] == ["  jobs.a.max_steps: 4 -> 6"] or \
        said[at + 1] == "  jobs.a.max_steps: 4 -> 6" and not said[at + 2].startswith("  jobs")
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert json.loads(again.stdout)["jobs"]["a"]["steps"] == 6  # --json: the summary, alone on stdout
    assert summary["jobs"]["a"]["steps"] == 6 and summary["jobs"]["a"]["best_step"] is not None
    record = json.loads((tmp_path / "o" / "run_config.json").read_text())
    assert record["effective"]["jobs"][0]["max_steps"] == 6 and record["effective"]["seed"] == 5

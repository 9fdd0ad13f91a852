"""`make demo`, shortened, through the installed command line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_demo_learns(tmp_path):
    """Every job's loss falls clearly and adapters are exported."""
    res = subprocess.run([sys.executable, "-m", "lorafusion.cli", "train", str(ROOT / "configs" / "quickstart.yaml"),
                          f"output_dir={tmp_path / 'qs'}", "logging.progress=false",
                          "scheduler.milp_time_limit_s=0.2",  # packing only: the losses do not depend on it
                          *[f"jobs.{i}.max_steps=25" for i in range(3)]],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "qs" / "summary.json").read_text())
    for name, j in summary["jobs"].items():
        assert j["final_loss"] < 0.8 * j["first_loss"], (name, j)
        assert (tmp_path / "qs" / "adapters" / name / "adapter_model.safetensors").is_file()

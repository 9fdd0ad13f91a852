"""`make demo` as shipped, through the command line: the three adapters learn their tasks — each answers at least 90%
of its held-out prompts (configs/quickstart/heldout.jsonl) right — and the run prints no library warning."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_demo_adapters_answer_held_out_prompts(tmp_path):
    from lorafusion.inference.generate import expected_matches

    out = tmp_path / "qs"
    res = subprocess.run([sys.executable, "-m", "lorafusion.cli", "train", str(ROOT / "configs" / "quickstart.yaml"),
                          f"output_dir={out}", "logging.progress=false"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Warning" not in res.stderr and "HiGHS" not in res.stdout, res.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["jobs"]) == {"successor", "shout", "countdown"}
    for name in summary["jobs"]:
        assert (out / "adapters" / name / "adapter_model.safetensors").is_file()
    answers = tmp_path / "answers.jsonl"
    res = subprocess.run([sys.executable, "-m", "lorafusion.cli", "generate", str(out), "--prompts",
                          str(ROOT / "configs" / "quickstart" / "heldout.jsonl"), "--out", str(answers),
                          "--max-new-tokens", "12"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    score = expected_matches([json.loads(line) for line in answers.read_text().splitlines()])
    assert set(score) == {"successor", "shout", "countdown"}
    for job, (right, total) in score.items():
        assert right >= 0.9 * total, (job, score)
    assert "outputs equal to 'expected'" in res.stderr

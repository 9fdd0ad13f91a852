"""The CLI entry points that `make demo` uses."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, cwd):
    return subprocess.run([sys.executable, "-m", "lorafusion.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_train_says_not_yet_and_runs_the_smoke(tmp_path):
    out = _run("train", str(ROOT / "configs" / "quickstart.yaml"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "not built yet" in out.stdout
    for name in ("sql", "summarize", "chat"):
        assert (tmp_path / "outputs/smoke/adapters" / name / "adapter_model.safetensors").is_file()
    first = [float(x.split("=")[1]) for x in out.stdout.split("step 0: ")[1].split("\n")[0].split()]
    last = [float(x.split("=")[1]) for x in out.stdout.split("step 4: ")[1].split("\n")[0].split()]
    assert all(b < a for a, b in zip(first, last)), out.stdout


def test_missing_run_yaml_is_a_clear_error(tmp_path):
    out = _run("train", "nope.yaml", cwd=tmp_path)
    assert out.returncode == 2
    assert "nope.yaml: file not found" in out.stderr

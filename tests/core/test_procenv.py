"""The process environment is set in one place, and the benchmarks that time training set it as `train`
does."""

from __future__ import annotations

import ast
from pathlib import Path

from lorafusion.core.procenv import PROCESS_ENV, set_process_env

ROOT = Path(__file__).resolve().parents[2]


def test_set_process_env_fills_what_is_unset_and_keeps_the_users(monkeypatch):
    for key in PROCESS_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    got = set_process_env()
    assert got["OMP_WAIT_POLICY"] == "ACTIVE"
    assert got["PYTORCH_CUDA_ALLOC_CONF"] == PROCESS_ENV["PYTORCH_CUDA_ALLOC_CONF"]


def _calls_set_process_env(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "set_process_env"
               for n in ast.walk(tree))


def test_train_and_the_training_benchmarks_set_the_same_environment():
    assert _calls_set_process_env(ROOT / "lorafusion/cli/__init__.py")
    for script in ("bench_train.py", "calibrate_memory.py"):
        assert _calls_set_process_env(ROOT / "scripts" / script), script
    for path in [*(ROOT / "lorafusion").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]:
        if path.name != "procenv.py":
            assert "expandable_segments" not in path.read_text(), path  # one home for the setting

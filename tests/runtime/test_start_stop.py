"""A run's start: a stop while it is set up (model build included) ends it within seconds, leaving its output
directory unlocked; a run that cannot fit the host it was launched on is refused before the model is built."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from runtime_utils import job_dict, write_dataset, write_run

ROOT = Path(__file__).resolve().parents[2]

# train, with the model build made slow (a 60 s loop of Python work, like an 8B build on a CPU), announcing it
SLOW_BUILD = """
import sys, time
import lorafusion.models.base as base
real = base.build_base
def slow(*a, **kw):
    print("building", flush=True)
    t = time.monotonic()
    while time.monotonic() - t < 60:
        sum(range(1000))
    return real(*a, **kw)
base.build_base = slow
from lorafusion.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return env


def _stop_during_build(run: Path, sig: int, *extra: str) -> tuple[int, str, float]:
    p = subprocess.Popen([sys.executable, "-c", SLOW_BUILD, "train", str(run), *extra], cwd=ROOT, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "building", p.communicate()[1][-2000:]
    t0 = time.monotonic()
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    return p.returncode, err, time.monotonic() - t0


def test_a_stop_during_the_model_build_exits_within_seconds_leaving_nothing_locked(tmp_path):
    run = write_run(tmp_path, [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=4)], out="o")
    rc, err, took = _stop_during_build(run, signal.SIGTERM)
    assert rc == 0 and took < 20, (rc, took, err[-2000:])  # the build alone: 60 s (loaded: ~11 s)
    assert "stopped by SIGTERM while starting" in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()  # a fresh run stopped before training leaves no directory behind


def test_a_sigint_during_the_build_of_a_resumed_run_leaves_it_resumable(tmp_path):
    from lorafusion.rundir.lock import lock_held
    from lorafusion.rundir.status import read_status

    run = write_run(tmp_path, [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=2)], out="o")
    done = subprocess.run([sys.executable, "-m", "lorafusion.cli", "train", str(run)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    before = (tmp_path / "o" / "status.json").read_text()
    rc, err, took = _stop_during_build(run, signal.SIGINT, "--resume", "jobs.a.max_steps=4")
    assert rc == 130 and took < 20, (rc, took, err[-2000:])  # (the build alone: 60 s)
    assert not lock_held(tmp_path / "o")
    assert (tmp_path / "o" / "status.json").read_text() == before
    assert read_status(tmp_path / "o")["run"]["state"] == "done"  # not "ended without writing its end"


def test_a_run_too_big_for_the_host_is_refused_in_seconds_before_the_model_is_built(tmp_path):
    """The shipped 8B config on a machine without a GPU: one line naming what it needs and what there is."""
    import pytest

    from lorafusion.config import load_run_config
    from lorafusion.resolve import run_need
    from lorafusion.scheduler.host import available_bytes

    (tmp_path / "configs").mkdir()
    cfg = tmp_path / "configs" / "8b.yaml"
    cfg.write_text((ROOT / "configs" / "llama3.1-8b-4adapters.yaml").read_text())
    for name in ("short", "medium", "long", "mixed"):  # the benchmark data (made, not shipped): a few rows
        write_dataset(tmp_path / "data" / "bench" / f"{name}.jsonl", 1, rows=8)
    need = run_need(load_run_config(cfg, ["parallelism.dp=1"]), 1).total
    if (available_bytes() or 0) > need:
        pytest.skip(f"this machine has room for the 8B run on its CPU ({need / 2**30:.1f} GiB)")
    env = dict(_env(), CUDA_VISIBLE_DEVICES="")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "lorafusion.cli", "train", str(cfg)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=10)
    assert p.returncode == 2 and time.monotonic() - t0 < 10, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "GiB of host memory" in lines[0] and "GiB is available" in lines[0] and "weights 15.0" in lines[0]
    assert not (tmp_path / "outputs").exists()

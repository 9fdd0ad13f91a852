"""Online jobs on a real multi-process run: ``lorafusion train --serve`` under torchrun, two
CPU/gloo processes at pp=2; while it trains, a ``lorafusion submit`` process adds a job and a
``lorafusion cancel`` process removes another.

Only global rank 0 reads ``RUN_DIR/requests/``. The other process is the last pipeline stage: it holds the
second half of every adapter and computes every loss, and learns of both requests only through rank 0's
broadcast at a chunk boundary — pp=2 is the layout where that broadcast carries the most (a rank that missed
it would lack the new adapter's layers, or keep training the cancelled one, and the pipeline would hang or
diverge).

No outcome depends on timing: the test acts once ``status.json`` says the run is past its first chunk boundary
(so the requests are taken at a boundary of a running run, not at its start), and the cancelled job has far
more steps than the run takes in the test's time, so the run cannot end before it takes the cancel. The
submission is written first, so it is taken at that boundary or an earlier one. Served, the run can then end
only when its ranks agree that its idle time is over; rank 1's clock runs at half speed (skewed_clock.py,
which also runs sync_guard.py's check), so ranks that each decided on their own clock would hang.
"""

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from runtime_utils import assert_close, job_dict, load_adapter, train_inprocess, write_dataset, write_run

ROOT = Path(__file__).resolve().parents[2]
# lorafusion train through sync_guard.py, rank 1's clock slow
ENTRY = Path(__file__).with_name("skewed_clock.py")
NEVER = 100_000  # max_steps of the job to cancel: it cannot end on its own while the test runs
TIMEOUT_S = 300


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # torchrun sets its own
        env.pop(k, None)
    return env


def _cli(*args: str) -> str:
    """``lorafusion ARGS`` in a process of its own; its stdout (it must succeed)."""
    p = subprocess.run([sys.executable, "-m", "lorafusion.cli", *args], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (args, p.stdout, p.stderr)
    return p.stdout


def _wait_until(cond, proc: subprocess.Popen, log: Path, what: str) -> None:
    """Poll ``cond()`` until it holds; fail at once (with the run's output) if the run exits first."""
    deadline = time.monotonic() + TIMEOUT_S
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {TIMEOUT_S}s:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


def _past_first_boundary(out: Path) -> bool:
    try:  # status.json is replaced atomically: absent, or whole
        return json.loads((out / "status.json").read_text())["run"]["state"] == "running"
    except FileNotFoundError:
        return False


def _late_job(tmp: Path) -> Path:
    d = job_dict("late", write_dataset(tmp / "d" / "late.jsonl", 3), r=4, steps=4)
    d["dataset"]["path"] = "d/late.jsonl"  # relative to the job's YAML, as a user writes it
    path = tmp / "late.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


@contextmanager
def _one_thread():
    """Train in this process on one thread (as the workers do, OMP_NUM_THREADS=1): while two worker processes
    run beside it on a small machine, more threads only wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_submit_and_cancel_reach_every_rank_of_a_pp2_run(tmp_path, megatron_single):
    jobs = [job_dict("keep", write_dataset(tmp_path / "d" / "keep.jsonl", 1), r=4, steps=4),
            job_dict("stop", write_dataset(tmp_path / "d" / "stop.jsonl", 2, kind="upper"), r=8, steps=NEVER)]
    run = write_run(tmp_path, jobs, out="live", pp=2)
    out, late, log = tmp_path / "live", _late_job(tmp_path), tmp_path / "train.log"
    # --serve: once its jobs have ended the run waits for submissions until serve_idle_minutes (here 0.3 s)
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(ENTRY), "train", str(run), "serve_idle_minutes=0.005", "--serve"],
            cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # the reference, while the run starts: the submitted job trained alone (one process)
        alone = yaml.safe_load(late.read_text())
        alone["dataset"]["path"] = str(tmp_path / "d" / "late.jsonl")
        alone["optimizer"]["lr"] = 5e-3
        with _one_thread():
            _, alone_out = train_inprocess(write_run(tmp_path, [alone], out="alone", name="alone.yaml"))
        _wait_until(lambda: _past_first_boundary(out), proc, log, "the first chunk boundary")
        _cli("submit", str(out), str(late), "optimizer.lr=5e-3")
        _cli("cancel", str(out), "--job", "stop")
        _wait_until(lambda: proc.poll() is not None, proc, log,
                    "end of the run (do ranks wait for each other?)")
    finally:
        if proc.poll() is None:  # torchrun and its workers (a killed agent leaves its workers running)
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, log.read_text()[-4000:]

    summary = json.loads((out / "summary.json").read_text())
    jobs = summary["jobs"]
    stopped = jobs["stop"]["steps"]
    assert jobs["keep"]["status"] == "done" and jobs["keep"]["steps"] == 4
    assert jobs["late"]["status"] == "done" and jobs["late"]["steps"] == 4
    assert jobs["stop"]["status"] == "cancelled" and 1 <= stopped < NEVER
    answers = {json.loads(p.read_text())["kind"]: json.loads(p.read_text())["answer"]
               for p in (out / "requests" / "done").glob("*.json")}
    assert answers["submit"].startswith("accepted") and answers["cancel"].startswith("cancelling"), answers
    assert not list((out / "requests").glob("*.json"))  # every request taken

    # the CLI's view of the finished run
    status = json.loads(_cli("status", str(out), "--json"))
    assert status["run"]["state"] == "done"
    assert {n: (r["state"], r["step"]) for n, r in status["jobs"].items()} == \
        {"keep": ("done", 4), "late": ("done", 4), "stop": ("cancelled", stopped)}

    # one metrics row per (job, step), steps 1..N, as many as the summary counts; the submitted job joined
    # a run that was training (its first row comes after rows of the cancelled job)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for name, j in jobs.items():
        assert [r["step"] for r in rows if r["job"] == name] == list(range(1, j["steps"] + 1)), name
    first_late = next(i for i, r in enumerate(rows) if r["job"] == "late")
    assert any(r["job"] == "stop" for r in rows[:first_late])

    # both ranks applied the same requests: each job's newest checkpoint holds both stages' files, and each
    # stage's optimizer took as many steps as rank 0 counted (a rank that missed the broadcast would not)
    for name, j in jobs.items():
        ckpt = out / "checkpoints" / name / f"step_{j['steps']:06d}"
        assert (out / "checkpoints" / name / "latest").read_text().strip() == ckpt.name, name
        assert json.loads((ckpt / "state.json").read_text())["step"] == j["steps"], name
        for stage in range(2):
            saved = torch.load(ckpt / f"rank_tp0_pp{stage}.pt", weights_only=False)
            assert saved["optimizer"]["scheduler"]["last_epoch"] == j["steps"], (name, stage)
    # the cancelled job was checkpointed and exported when it left: its adapter is its last checkpoint's
    ckpt = out / "checkpoints" / "stop" / f"step_{stopped:06d}"
    assert json.loads((ckpt / "state.json").read_text())["status"] == "cancelled"
    assert_close(load_adapter(out, "stop"), load_file(ckpt / "adapter" / "adapter_model.safetensors"), rel=0)

    # the job that joined trained exactly as it does alone (dropout, data order and optimizer are its own)
    assert_close(load_adapter(out, "late"), load_adapter(alone_out, "late"), rel=1e-4)


def test_request_commands_start_without_torch(tmp_path):
    """``submit``, ``cancel`` and ``status`` run beside a busy training run: they import neither torch nor
    megatron (seconds of CPU each on a loaded machine)."""
    code = ("import sys; from lorafusion.cli import main\n"
            "for argv in (['status', sys.argv[1], '--json'], ['cancel', sys.argv[1], '--job', 'x'],\n"
            "             ['submit', sys.argv[1], sys.argv[2]]):\n"
            "    main(argv)\n"
            "print(sorted(m for m in ('torch', 'megatron', 'numpy') if m in sys.modules))")
    run = tmp_path / "run"
    run.mkdir()
    (run / "status.json").write_text(
        json.dumps({"run": {"state": "done", "elapsed_s": 1.0, "tokens_per_s": 0.0,
                            "updated": "-"}, "jobs": {"x": {}}}))
    job = job_dict("y", write_dataset(tmp_path / "y.jsonl", 1), r=4)
    (tmp_path / "y.yaml").write_text(yaml.safe_dump(job))
    p = subprocess.run([sys.executable, "-c", code, str(run), str(tmp_path / "y.yaml")], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout
    assert len(list((run / "requests").glob("*.json"))) == 2

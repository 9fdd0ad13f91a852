"""Preemption: a stop signal finishes the chunk in flight, checkpoints every job and exits 0; ``--resume``
then ends bitwise equal to an uninterrupted run. Default checkpoint policy: timed and at the end, keep the
last K."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime_utils import job_dict, train_inprocess, write_dataset, write_run

ROOT = Path(__file__).resolve().parents[2]


def _jobs(tmp: Path, steps: int = 40) -> list[dict]:
    return [
        job_dict("a", write_dataset(tmp / "d" / "a.jsonl", 1, rows=40), r=4, steps=steps, gbs=4, dropout=0.1),
        job_dict("b", write_dataset(tmp / "d" / "b.jsonl", 2, kind="upper"), r=8, steps=steps // 2, gbs=3)]


def _train(run: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return subprocess.Popen([sys.executable, "-m", "lorafusion.cli", "train", str(run), *extra], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # timings differ between runs
        for k in ("elapsed_s", "tokens_per_s", "max_memory_gib"):
            r.pop(k)
    return rows


def _stop_midway(run: Path, out: Path, sig: int) -> str:
    p = _train(run)
    deadline = time.monotonic() + 300
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
        assert p.poll() is None, p.communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    t0 = time.monotonic()
    p.send_signal(sig)
    text = p.communicate(timeout=120)[0]
    assert p.returncode == 0, text[-3000:]
    assert time.monotonic() - t0 < 60
    assert f"stopped by {signal.Signals(sig).name}" in text, text[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["stopped_by"] == signal.Signals(sig).name
    for job in ("a", "b"):  # every job has a complete checkpoint at the stop
        latest = (out / "checkpoints" / job / "latest").read_text().strip()
        state = json.loads((out / "checkpoints" / job / latest / "state.json").read_text())
        assert state["step"] == summary["jobs"][job]["steps"]
    assert summary["jobs"]["a"]["status"] == "stopped"  # it really stopped midway
    return text


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_is_bitwise_equal(tmp_path):
    # the stop comes within the first chunks; a still crosses an epoch (10 steps)
    jobs = _jobs(tmp_path, steps=16)
    ref_run = write_run(tmp_path, jobs, out="ref", capacity=1024, name="ref.yaml")
    p = _train(ref_run)
    assert p.wait(timeout=600) == 0, p.communicate()[0][-3000:]
    run = write_run(tmp_path, jobs, out="cut", capacity=1024, name="cut.yaml")
    _stop_midway(run, tmp_path / "cut", signal.SIGTERM)
    p = _train(run, "--resume")
    text = p.communicate(timeout=600)[0]
    assert p.returncode == 0, text[-3000:]
    assert _rows(tmp_path / "cut") == _rows(tmp_path / "ref")  # no row repeated, none missing, same values
    for job in ("a", "b"):
        got = (tmp_path / "cut" / "adapters" / job / "adapter_model.safetensors").read_bytes()
        assert got == (tmp_path / "ref" / "adapters" / job / "adapter_model.safetensors").read_bytes()
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    ref = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert summary["status"] == "done" and summary["tokens"] == ref["tokens"]
    assert summary["jobs"] == ref["jobs"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGINT])
def test_usr1_and_sigint_checkpoint_and_exit_0(tmp_path, sig):
    run = write_run(tmp_path, _jobs(tmp_path), out="o", capacity=1024)
    _stop_midway(run, tmp_path / "o", sig)


def test_default_policy_checkpoints_at_the_end_and_on_time_keeping_the_last_k(tmp_path, megatron_single):
    jobs = _jobs(tmp_path, steps=8)
    _, out = train_inprocess(write_run(tmp_path, jobs, out="end", capacity=1024, name="end.yaml"))
    assert [p.name for p in (out / "checkpoints" / "a").glob("step_*")] == ["step_000008"]
    assert [p.name for p in (out / "checkpoints" / "b").glob("step_*")] == ["step_000004"]
    _, out = train_inprocess(write_run(tmp_path, jobs, out="timed", capacity=1024, name="timed.yaml"),
                             ["checkpoint.every_minutes=1e-9", "checkpoint.keep_last=2"])
    assert sorted(p.name
                  for p in (out / "checkpoints" / "a").glob("step_*")) == ["step_000006", "step_000008"]
    assert (out / "checkpoints" / "a" / "latest").read_text().strip() == "step_000008"


def test_resume_after_jobs_finished_with_a_raised_max_steps_and_an_added_job(tmp_path, megatron_single):
    """A resumed run whose jobs had all finished: a job's max_steps raised continues it, an added job starts,
    finished jobs stay as they were; metrics rows never repeat; summary.json covers the whole run."""
    jobs = _jobs(tmp_path, steps=4)
    first, out = train_inprocess(write_run(tmp_path, jobs, out="o", capacity=1024))
    more = [dict(jobs[0], max_steps=6), jobs[1],
            job_dict("c", write_dataset(tmp_path / "d" / "c.jsonl", 3), r=4, steps=2, gbs=2)]
    summary, _ = train_inprocess(write_run(tmp_path, more, out="o", capacity=1024), resume=True)
    assert {n: (j["status"], j["steps"]) for n, j in summary["jobs"].items()} == \
        {"a": ("done", 6), "b": ("done", 2), "c": ("done", 2)}
    assert summary["jobs"]["a"]["first_loss"] == first["jobs"]["a"]["first_loss"]
    assert summary["jobs"]["b"] == first["jobs"]["b"]
    keys = [(r["job"], r["step"]) for r in _rows(out)]
    assert sorted(keys) == sorted({*keys}) and len(keys) == 6 + 2 + 2
    assert summary["tokens"] == sum(j["tokens"] for j in summary["jobs"].values())


@pytest.mark.parametrize("change, field", [
    (lambda j: j["optimizer"].update(lr=3e-3), "jobs.0.optimizer.lr"),
    (lambda j: j["lora"].update(lora_alpha=3.0), "jobs.0.lora.lora_alpha"),
    (lambda j: j["lora"].update(use_rslora=True), "jobs.0.lora.use_rslora"),
    (lambda j: j["lora"].update(r=8), "jobs.0.lora.r"),
    (lambda j: Path(j["dataset"]["path"]).write_text(
        Path(j["dataset"]["path"]).read_text().replace("a", "b")),
     "jobs.0.dataset.path"),
    (None, "seed"),
])
def test_resume_refuses_a_changed_setting_naming_the_field(tmp_path, megatron_single, change, field):
    from lorafusion.core.errors import ConfigError

    jobs = _jobs(tmp_path, steps=2)
    train_inprocess(write_run(tmp_path, jobs, out="o", capacity=1024))
    jobs = [json.loads(json.dumps(j)) for j in jobs]
    if change is not None:
        change(jobs[0])
    run = write_run(tmp_path, jobs, out="o", capacity=1024)
    with pytest.raises(ConfigError) as e:
        train_inprocess(run, ["seed=7"] if change is None else [], resume=True)
    msg = str(e.value)
    assert f": {field}: cannot resume job 'a'" in msg, msg


def _rewrite_state(f, state: dict) -> None:
    """``state.json`` as an older version wrote it, with its manifest entry to match (a resume checks it)."""
    from lorafusion.rundir.atomic import file_sha256

    f.write_text(json.dumps(state))
    manifest = json.loads((f.parent / "manifest.json").read_text())
    (f.parent / "manifest.json").write_text(json.dumps({**manifest, "state.json": file_sha256(f)}))


def test_checkpoint_from_before_per_projection_a_resumes_only_with_shared_fused_a(tmp_path, megatron_single):
    """A checkpoint written before lora.shared_fused_a existed (one A shared by q/k/v and gate/up) is refused
    by the default (an A per projection) with one error saying what to set, and resumes with shared_fused_a:
    true."""
    from lorafusion.core.errors import ConfigError

    jobs = _jobs(tmp_path, steps=2)[:1]
    jobs[0]["lora"]["shared_fused_a"] = True
    train_inprocess(write_run(tmp_path, jobs, out="o", capacity=1024))
    for f in (tmp_path / "o" / "checkpoints" / "a").glob("step_*/state.json"):  # as written before the field
        state = json.loads(f.read_text())
        del state["settings"]["lora.shared_fused_a"]
        _rewrite_state(f, state)
    more = [dict(json.loads(json.dumps(jobs[0])), max_steps=3)]
    del more[0]["lora"]["shared_fused_a"]
    with pytest.raises(ConfigError) as e:
        train_inprocess(write_run(tmp_path, more, out="o", capacity=1024), resume=True)
    assert "jobs.0.lora.shared_fused_a: cannot resume job 'a'" in str(e.value)
    assert "set lora.shared_fused_a: true to resume it" in str(e.value)
    # older still: no settings recorded
    for f in (tmp_path / "o" / "checkpoints" / "a").glob("step_*/state.json"):
        state = json.loads(f.read_text())
        saved = state.pop("settings")
        _rewrite_state(f, state)
    with pytest.raises(ConfigError, match=r"linear_qkv.lora_A is missing or has another shape.*set "
                                          r"lora.shared_fused_a: true"):
        train_inprocess(write_run(tmp_path, more, out="o", capacity=1024), resume=True)
    for f in (tmp_path / "o" / "checkpoints" / "a").glob("step_*/state.json"):
        _rewrite_state(f, {**json.loads(f.read_text()), "settings": saved})
    more[0]["lora"]["shared_fused_a"] = True
    summary, _ = train_inprocess(write_run(tmp_path, more, out="o", capacity=1024), resume=True)
    assert summary["jobs"]["a"]["steps"] == 3

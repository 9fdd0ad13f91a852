"""A run resumes only from checkpoints that agree across its jobs: a checkpoint of all jobs that failed
part-way (a full disk) left them at different boundaries, and the resume repacked them silently (the result
then differs from an uninterrupted run's, which changed packing settings refuse)."""

import json
import shutil
from pathlib import Path

import pytest

from lorafusion.checkpoint.consistent import consistent_picks
from lorafusion.core.errors import ConfigError


def _pick(job, step, together=None):
    return (Path(f"/r/{job}/step_{step:06d}"),
            {"step": step, **({"together": together} if together else {})}, {})


def _older(table):
    return lambda name, path: [c for c in table[name] if c[1]["step"] < int(path.name.split("_")[1])]


def test_the_job_ahead_falls_back_to_where_they_agree():
    table = {"a": [_pick("a", 20, {"a": 20, "b": 20}), _pick("a", 10, {"a": 10, "b": 10})],
             "b": [_pick("b", 10, {"a": 10, "b": 10})]}  # (b's write at step 20 failed)
    said = []
    picks = consistent_picks({"a": table["a"][0], "b": table["b"][0]}, _older(table), source="run.yaml",
                             allow_different_result=False, log=said.append)
    assert {n: p[1]["step"] for n, p in picks.items()} == {"a": 10, "b": 10}
    assert len(said) == 1 and "resuming 'a' from /r/a/step_000010, where they agree" in said[0], said


def test_no_agreeing_checkpoint_is_refused_unless_allowed():
    table = {"a": [_pick("a", 20, {"a": 20, "b": 20})], "b": [_pick("b", 10, {"a": 10, "b": 10})]}
    picks = {"a": table["a"][0], "b": table["b"][0]}
    with pytest.raises(ConfigError, match="no older checkpoint of 'a' agrees.*--allow-different-result"):
        consistent_picks(picks, _older(table), source="run.yaml", allow_different_result=False, log=print)
    said = []
    assert consistent_picks(picks, _older(table), source="run.yaml", allow_different_result=True,
                            log=said.append) == picks
    assert "resumed anyway" in said[0]


def test_jobs_saved_on_their_own_are_not_compared():
    """Checkpoints of save_every jobs (written alone) and of a job that ended carry no set: resumed as
    before."""
    picks = {"a": _pick("a", 15), "b": _pick("b", 14), "c": (None, None, None)}
    assert consistent_picks(picks, _older({}), source="x", allow_different_result=False, log=print) == picks


def test_a_partly_failed_checkpoint_of_a_run_resumes_from_the_last_agreeing_set(
    tmp_path, megatron_single, capsys):
    from runtime_utils import job_dict, train_inprocess, write_dataset, write_run

    jobs = [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=6),
            job_dict("b", write_dataset(tmp_path / "b.jsonl", 2), r=4, steps=6)]
    run = write_run(tmp_path, jobs, out="o")
    ov = ["checkpoint.every_minutes=0.00001", "checkpoint.keep_last=10", "scheduler.lookahead_batches=1"]
    _, out = train_inprocess(run, ov)
    b_steps = sorted((out / "checkpoints" / "b").glob("step_*"))
    assert len(b_steps) >= 3
    states = [json.loads((p / "state.json").read_text()) for p in b_steps]
    assert all(s.get("together", {}).keys() == {"a", "b"} for s in states[:-1]), states
    # b's newest checkpoints were never written (the disk filled while a's were): b is behind a
    for p in b_steps[-2:]:
        shutil.rmtree(p)
    (out / "checkpoints" / "b" / "latest").write_text(b_steps[-3].name + "\n")
    capsys.readouterr()  # (a resume with more steps continues both)
    summary, _ = train_inprocess(run, ov + ["jobs.a.max_steps=8", "jobs.b.max_steps=8"], resume=True)
    said = capsys.readouterr().err
    assert f"resuming 'a' from {out / 'checkpoints' / 'a' / b_steps[-3].name}, where they agree" in said, said
    assert summary["jobs"]["a"]["steps"] == summary["jobs"]["b"]["steps"] == 8

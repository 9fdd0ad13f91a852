"""``lorafusion status RUN_DIR [--json]``: every job's state from ``status.json`` (written by the trainer)."""

import json

from lorafusion.cli import main


def test_status_of_a_finished_run(three_jobs, capsys):
    _, jobs, summary, out = three_jobs
    assert main(["status", str(out), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["run"]["state"] == "done"
    assert set(status["jobs"]) == {j["name"] for j in jobs}
    for name, row in status["jobs"].items():
        s = summary["jobs"][name]
        assert row["state"] == "done" and row["step"] == row["max_steps"] == s["total_steps"]
        assert row["tokens"] == s["tokens"] and row["last_loss"] == s["final_loss"] and row["eta_s"] == 0
        assert row["tokens_per_s"] > 0
    assert main(["status", str(out)]) == 0
    table = capsys.readouterr().err
    assert all(f"{j['name']}" in table for j in jobs) and "done" in table


def test_status_of_a_killed_run_says_stopped(three_jobs, tmp_path, capsys):
    """A status left at "running" with nobody holding the lock: the run was killed."""
    out = three_jobs[3]
    status = json.loads((out / "status.json").read_text())
    status["run"]["state"] = "running"
    first = next(iter(status["jobs"]))
    status["jobs"][first].update(state="running", step=1, eta_s=12.0)
    run = tmp_path / "killed"
    run.mkdir()
    (run / "status.json").write_text(json.dumps(status))
    (run / ".lock").write_text("12345\n")
    assert main(["status", str(run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["run"]["state"] == "stopped" and "lock" in got["run"]["note"]
    assert got["jobs"][first]["state"] == "stopped" and got["jobs"][first]["eta_s"] is None


def test_status_bad_input(tmp_path, capsys):
    """A missing directory, one without a status and a garbled status: one line each, exit 2."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "status.json").write_text("{not json")
    for run, words in ((tmp_path / "nope", "no such run directory"), (tmp_path / "empty", "no status.json"),
                       (tmp_path / "garbled", "not a readable run status")):
        assert main(["status", str(run)]) == 2
        err = capsys.readouterr().err
        assert (words in err and str(run) in err and "Traceback" not in err
                and len(err.strip().splitlines()) == 1)


def test_status_says_waiting_for_a_job_the_policy_holds_back(tmp_path, monkeypatch, megatron_single):
    """Under ``scheduler.policy: fifo`` one job trains at a time: while the first trains, the second
    (admitted, unfinished, none of its batches in the chunk now running) is ``waiting``, with no ETA; then it
    runs."""
    from lorafusion.runtime import pipeline
    from runtime_utils import job_dict, train_inprocess, write_dataset, write_run

    jobs = [job_dict(n, write_dataset(tmp_path / "d" / f"{n}.jsonl", i), r=4, steps=2)
            for i, n in enumerate("ab")]
    out = tmp_path / "out"
    run = write_run(tmp_path, jobs, policy="fifo")
    orig, seen = pipeline.run_chunk, []

    def run_chunk(*a, **kw):  # status.json as this chunk starts
        if (out / "status.json").is_file():
            seen.append(
                {n: (j["state"], j["eta_s"])
                 for n, j in json.loads((out / "status.json").read_text())["jobs"].items()})
        return orig(*a, **kw)

    monkeypatch.setattr(pipeline, "run_chunk", run_chunk)
    summary, _ = train_inprocess(run)
    assert all(j["status"] == "done" for j in summary["jobs"].values())
    states = [{n: s for n, (s, _) in row.items()} for row in seen]
    assert {"a": "running", "b": "waiting"} in states, states
    # then a's adapter is being written in the background (or is written already) while b trains
    assert {"a": "saving", "b": "running"} in states or {"a": "done", "b": "running"} in states, states
    assert all(eta is None for row in seen for s, eta in row.values() if s == "waiting")
    assert json.loads((out / "status.json").read_text())["jobs"]["b"]["state"] == "done"


def test_status_table_shows_eval_loss(tmp_path):
    """The table has an eval column: a job's last and best eval loss (with the best's step); '-' for a job
    without an eval set."""
    from lorafusion.rundir.status import format_status

    status = {"run": {"state": "running", "elapsed_s": 3.0, "tokens_per_s": 100.0, "updated": "now"},
              "jobs": {
                  "a": {"state": "running", "step": 10, "max_steps": 40, "tokens": 1000, "last_loss": 0.5,
                        "tokens_per_s": 50.0, "eta_s": 9.0, "eval_loss": 0.61234, "best_eval_loss": 0.6,
                        "best_step": 8},
                  "b": {"state": "running", "step": 10, "max_steps": 40, "tokens": 1000,
                        "last_loss": 0.7, "tokens_per_s": 50.0, "eta_s": 9.0}}}
    lines = format_status(status, tmp_path).splitlines()
    assert "eval loss" in lines[1] and "best (step)" in lines[1]
    assert "0.6123" in lines[2] and "0.6000 (8)" in lines[2]
    assert lines[3].split()[5:7] == ["-", "-"]


def test_status_lists_submitted_jobs_the_run_has_not_taken_yet(tmp_path, capsys):
    """`lorafusion submit` to a stopped run: the job is listed (state submitted) before the run is resumed,
    and a queued cancel is marked on its job."""
    from lorafusion.rundir.requests import write_request
    from lorafusion.rundir.status import format_status, read_status

    run = tmp_path / "run"
    run.mkdir()
    row = {"state": "stopped", "step": 3, "max_steps": 40, "tokens": 300, "last_loss": 0.5,
           "tokens_per_s": 50.0, "eta_s": None}
    (run / "status.json").write_text(json.dumps({
        "run": {"state": "stopped", "elapsed_s": 3.0, "tokens_per_s": 100.0, "updated": "now"},
        "jobs": {"a": row}}))
    write_request(run, "submit", {"name": "b", "job": {"name": "b", "max_steps": 7}})
    write_request(run, "submit", {"name": "c", "job": {"name": "c", "num_epochs": 2}})
    write_request(run, "cancel", {"job": "a"})
    status = read_status(run)
    assert list(status["jobs"]) == ["a", "b", "c"]
    assert status["jobs"]["b"] == {"state": "submitted", "step": 0, "max_steps": 7, "tokens": 0,
                                   "tokens_per_s": 0.0, "last_loss": None, "eta_s": None}
    assert status["jobs"]["c"]["max_steps"] is None and status["jobs"]["a"]["cancel_requested"] is True
    lines = format_status(status, run).splitlines()
    assert lines[3].split()[:4] == ["b", "submitted", "0/7", "0"]
    assert lines[4].split()[:3] == ["c", "submitted", "0/-"] and "(cancel queued)" in lines[2]

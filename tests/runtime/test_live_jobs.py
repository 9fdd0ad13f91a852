"""Online jobs: ``lorafusion submit`` / ``cancel`` on a running run (taken at chunk boundaries), on a stopped
run before ``--resume``, the queue by priority, and bad requests."""

import json

import pytest
import yaml

import lorafusion.runtime.pipeline as pipeline
from lorafusion.cli import main
from lorafusion.runtime.admission import LiveJobs
from runtime_utils import assert_close, job_dict, load_adapter, train_inprocess, write_dataset, write_run


def _job_yaml(tmp, name, seed, **kw):
    d = job_dict(name, write_dataset(tmp / "d" / f"{name}.jsonl", seed), **kw)
    d["dataset"]["path"] = f"d/{name}.jsonl"  # relative to the job's YAML, as a user writes it
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def _on_chunk(monkeypatch, actions: dict):
    """Run ``actions[k]()`` right after chunk k (1-based) has trained, as a user acting while the run goes
    on."""
    orig, count = pipeline.run_chunk, [0]

    def wrapped(*a, **kw):
        res = orig(*a, **kw)
        count[0] += 1
        if count[0] in actions:
            actions[count[0]]()
        return res

    monkeypatch.setattr(pipeline, "run_chunk", wrapped)


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_submit_and_cancel_on_a_running_run(tmp_path, monkeypatch, megatron_single):
    jobs = [job_dict("rev", write_dataset(tmp_path / "d" / "rev.jsonl", 1), r=4, steps=6),
            job_dict("up", write_dataset(tmp_path / "d" / "up.jsonl", 2, kind="upper"), r=8, steps=6)]
    run = write_run(tmp_path, jobs, out="live")
    late = _job_yaml(tmp_path, "late", 3, r=4, steps=4)
    out = tmp_path / "live"
    _on_chunk(monkeypatch, {1: lambda: (main(["submit", str(out), str(late), "optimizer.lr=5e-3"]),
                                        main(["cancel", str(out), "--job", "up"]))})
    summary, _ = train_inprocess(run)
    js = summary["jobs"]
    assert js["rev"]["status"] == "done" and js["rev"]["steps"] == 6
    # its planned batches ran, no more
    assert js["up"]["status"] == "cancelled" and 2 <= js["up"]["steps"] < 6
    assert js["late"]["status"] == "done" and js["late"]["steps"] == 4
    assert (out / "adapters" / "up" / "adapter_config.json").is_file()
    assert (out / "checkpoints" / "up" / f"step_{js['up']['steps']:06d}").is_dir()
    rows = _rows(out)
    assert max(r["step"] for r in rows if r["job"] == "up") == js["up"]["steps"]
    assert min(r["elapsed_s"] for r in rows if r["job"] == "late") > min(r["elapsed_s"] for r in rows)
    answers = sorted(json.loads(p.read_text())["answer"] for p in (out / "requests" / "done").glob("*.json"))
    assert answers[0].startswith("accepted") and answers[1].startswith("cancelling")
    status = json.loads((out / "status.json").read_text())
    assert {n: r["state"] for n, r in status["jobs"].items()} == {"rev": "done", "up": "cancelled",
                                                                  "late": "done"}
    # the job that joined trained exactly as it would alone (dropout, data order and optimizer are its own)
    alone_job = yaml.safe_load(late.read_text())
    alone_job["dataset"]["path"] = str(tmp_path / "d" / "late.jsonl")
    alone_job["optimizer"]["lr"] = 5e-3
    _, alone = train_inprocess(write_run(tmp_path, [alone_job], out="alone", name="alone.yaml"))
    assert_close(load_adapter(out, "late"), load_adapter(alone, "late"), rel=1e-4)


def test_a_finished_job_is_handed_over_while_the_run_goes_on(tmp_path, monkeypatch, megatron_single):
    """A job whose last step ran is handed over at that chunk boundary: its adapter and optimizer leave the
    model at once, its final checkpoint and adapter are written in the background while the other job trains
    (held back here until two more chunks have run), and ``status`` says ``done`` only once they are."""
    import threading

    import lorafusion.checkpoint.format as checkpoint
    from lorafusion.layers import get_lora_context

    jobs = [job_dict("short", write_dataset(tmp_path / "d" / "short.jsonl", 1), r=4, steps=2),
            job_dict("long", write_dataset(tmp_path / "d" / "long.jsonl", 2, kind="upper"), r=8, steps=6)]
    run = write_run(tmp_path, jobs, out="h", capacity=256)
    out = tmp_path / "h"
    adapter = out / "adapters" / "short" / "adapter_config.json"
    go = threading.Event()
    start = checkpoint.start_job_checkpoint

    def held(*a, **kw):  # the background write waits for the test
        write = start(*a, **kw)
        return lambda: (go.wait(60), write())[1]

    monkeypatch.setattr(checkpoint, "start_job_checkpoint", held)
    orig, seen = pipeline.run_chunk, []

    def wrapped(model, chunk, *a, **kw):  # before each chunk: what the run has handed over so far
        state = json.loads((out / "status.json").read_text())["jobs"]["short"]["state"]
        seen.append((set(chunk.batches), state, adapter.is_file(), set(get_lora_context(model).specs)))
        if sum("short" not in s[0] for s in seen) == 2:
            go.set()
        return orig(model, chunk, *a, **kw)

    monkeypatch.setattr(pipeline, "run_chunk", wrapped)
    summary, _ = train_inprocess(run, ["scheduler.lookahead_batches=1"])
    assert summary["jobs"]["short"]["status"] == "done" and summary["jobs"]["long"]["steps"] == 6
    after = [s for s in seen if "short" not in s[0]]  # the chunks after short's last one
    assert len(after) >= 3 and seen[0][1] == "running" and not seen[0][2]
    assert all(specs == {"long"} for *_, specs in after)  # off the model at once
    assert [(state, exported)
            for _, state, exported, _ in after[:2]] == [("saving", False)] * 2  # training went on
    assert all(state != "done" or exported for _, state, exported, _ in seen)  # done only once written
    assert (out / "checkpoints" / "short" / "step_000002" / "state.json").is_file()
    assert json.loads((out / "status.json").read_text())["jobs"]["short"]["state"] == "done"
    # what was handed over is the job's end state: as trained alone
    _, alone = train_inprocess(write_run(tmp_path, [jobs[0]], out="alone", name="alone.yaml", capacity=256))
    assert_close(load_adapter(out, "short"), load_adapter(alone, "short"), rel=1e-4)


def test_submit_to_a_finished_run_then_resume(tmp_path, megatron_single, capsys):
    jobs = [job_dict("rev", write_dataset(tmp_path / "d" / "rev.jsonl", 1), r=4, steps=3)]
    run = write_run(tmp_path, jobs, out="fin")
    summary, out = train_inprocess(run)
    assert summary["jobs"]["rev"]["status"] == "done"
    assert main(["submit", str(out), str(_job_yaml(tmp_path, "more", 4, r=4, steps=2))]) == 0
    summary, _ = train_inprocess(run, resume=True)
    assert summary["jobs"]["more"]["status"] == "done" and summary["jobs"]["rev"]["steps"] == 3
    # a second resume finds the submitted job in the run directory, finished
    summary, _ = train_inprocess(run, resume=True)
    assert summary["jobs"]["more"] == {**summary["jobs"]["more"], "status": "done", "steps": 2}
    assert (out / "adapters" / "more" / "adapter_model.safetensors").is_file()


def test_queue_admits_by_priority_when_room_appears(tmp_path, monkeypatch, megatron_single):
    """Room for one training job at a time (a stand-in for GPU memory): submissions wait as queued and start
    by priority when a job leaves."""
    def fits(self, name):
        return not any(js.status == "running" and js.steps < js.stream.total_steps
                       for js in self.jobs.values())

    monkeypatch.setattr(LiveJobs, "_fits", fits)
    jobs = [job_dict("first", write_dataset(tmp_path / "d" / "first.jsonl", 1), r=4, steps=4)]
    run = write_run(tmp_path, jobs, out="q")
    out = tmp_path / "q"
    low = _job_yaml(tmp_path, "low", 2, r=4, steps=2)
    high = _job_yaml(tmp_path, "high", 3, r=4, steps=2)
    high_cfg = yaml.safe_load(high.read_text())
    high_cfg["priority"] = 5
    high.write_text(yaml.safe_dump(high_cfg))
    seen = {}

    def submit():
        main(["submit", str(out), str(low)])
        main(["submit", str(out), str(high)])

    def look():
        seen.update({n: r["state"] for n, r in json.loads((out / "status.json").read_text())["jobs"].items()})

    _on_chunk(monkeypatch, {1: submit, 2: look})
    summary, _ = train_inprocess(run)
    assert seen["low"] == "queued" and seen["high"] == "queued"
    assert all(summary["jobs"][n]["status"] == "done" for n in ("first", "low", "high"))
    rows = _rows(out)
    first = {n: min(r["elapsed_s"] for r in rows if r["job"] == n) for n in ("first", "low", "high")}
    last = {n: max(r["elapsed_s"] for r in rows if r["job"] == n) for n in ("first", "low", "high")}
    assert last["first"] < first["high"] and last["high"] < first["low"]


@pytest.mark.parametrize("case", ["unknown_key", "missing_data", "duplicate", "cancel_unknown", "cancel_done",
                                  "no_run"])
def test_bad_requests_are_one_line(tmp_path, capsys, case, three_jobs):
    out = three_jobs[3]
    job = _job_yaml(tmp_path, "extra", 5, r=4)
    if case == "unknown_key":
        job.write_text(job.read_text() + "learning_rate: 3\n")
        argv, words = ["submit", str(out), str(job)], [str(job), "learning_rate"]
    elif case == "missing_data":
        (tmp_path / "d" / "extra.jsonl").unlink()
        argv, words = ["submit", str(out), str(job)], [str(job), "dataset.path", "not found"]
    elif case == "duplicate":
        job.write_text(job.read_text().replace("name: extra", "name: rev"))
        argv, words = ["submit", str(out), str(job)], ["'rev'", "already"]
    elif case == "cancel_unknown":
        argv, words = ["cancel", str(out), "--job", "nope"], ["--job", "'nope'", "rev"]
    elif case == "cancel_done":
        argv, words = ["cancel", str(out), "--job", "rev"], ["--job", "'rev'", "already done"]
    else:
        argv = ["submit", str(tmp_path / "nowhere"), str(job)]
        words = ["nowhere", "not a lorafusion run directory"]
    before = sorted(p.name for p in out.rglob("*"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sorted(p.name for p in out.rglob("*")) == before  # the run is untouched


@pytest.mark.parametrize("state", ["done", "cancelled", "diverged", "early_stopped"])
def test_cancel_of_an_ended_job_is_refused_at_once(tmp_path, state):
    from lorafusion.core.errors import ConfigError
    from lorafusion.rundir.requests import check_cancel

    (tmp_path / "status.json").write_text(
        json.dumps({"run": {}, "jobs": {"j": {"state": state}, "k": {"state": "running"}}}))
    with pytest.raises(ConfigError, match=f"job 'j' is already {state}: nothing to cancel"):
        check_cancel(tmp_path, "j")
    check_cancel(tmp_path, "k")  # a running job may be cancelled

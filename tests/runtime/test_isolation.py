"""One job, one request or one typo never costs anyone else's work: a request the run cannot apply
is refused at the boundary (the reason in requests/done/ and in ``lorafusion status``) or, if applying it
fails, set aside before the run ends, so a resume never meets it again; an adapter that could never fit is
refused before anything is allocated."""

import json

import pytest

import lorafusion.runtime.pipeline as pipeline
from lorafusion.cli import main
from lorafusion.rundir.requests import write_request
from lorafusion.runtime.admission import LiveJobs
from runtime_utils import job_dict, train_inprocess, write_dataset, write_run


def _on_chunk(monkeypatch, k: int, action):
    orig, count = pipeline.run_chunk, [0]

    def wrapped(*a, **kw):
        res = orig(*a, **kw)
        count[0] += 1
        if count[0] == k:
            action()
        return res

    monkeypatch.setattr(pipeline, "run_chunk", wrapped)


def _answers(out) -> dict[str, str]:
    return {json.loads(p.read_text()).get("name") or json.loads(p.read_text()).get("job") or p.name:
            json.loads(p.read_text())["answer"] for p in sorted((out / "requests" / "done").glob("*.json"))}


def test_requests_the_run_cannot_apply_are_refused_and_it_goes_on(tmp_path, monkeypatch,
                                                                  megatron_single, capsys):
    jobs = [job_dict("rev", write_dataset(tmp_path / "d" / "rev.jsonl", 1), r=4, steps=4)]
    run = write_run(tmp_path, jobs, out="o")
    out = tmp_path / "o"
    huge = job_dict("huge", write_dataset(tmp_path / "d" / "huge.jsonl", 2), r=10**12, steps=2)

    def hand_written():
        write_request(out, "submit", {"name": "x", "job": {"name": "x"}})  # no dataset, lora, batch size
        write_request(out, "submit", {"name": "huge", "job": huge})  # (submit checks it; a handmade file not)
        write_request(out, "submit", {"name": "bad", "job": [1, 2]})
        write_request(out, "cancel", {"name": "nobody"})  # no "job"

    _on_chunk(monkeypatch, 1, hand_written)
    summary, _ = train_inprocess(run)
    assert summary["jobs"]["rev"] == {**summary["jobs"]["rev"], "status": "done", "steps": 4}
    assert set(summary["jobs"]) == {"rev"}
    answers = _answers(out)
    assert (answers["x"].startswith("refused: request ")
            and "job: dataset: required field is missing" in answers["x"])
    assert (answers["huge"].startswith("refused: request ")
            and "lora.r: expected an integer <= 65536" in answers["huge"])
    assert (answers["bad"].startswith("refused: request ")
            and "expected a job mapping, got list" in answers["bad"])
    assert answers["nobody"].startswith("refused: --job: no job None")
    assert not list((out / "requests").glob("*.json"))  # nothing left to retry
    capsys.readouterr()
    assert main(["status", str(out)]) == 0
    shown = capsys.readouterr().err
    assert ("submit huge): refused: request " in shown
            and "lora.r: expected an integer <= 65536" in shown), shown
    assert len([ln for ln in shown.splitlines() if ln.startswith("  request ")]) == 4


def test_a_request_that_fails_is_set_aside_and_resume_goes_on(tmp_path, monkeypatch, megatron_single):
    jobs = [job_dict("rev", write_dataset(tmp_path / "d" / "rev.jsonl", 1), r=4, steps=4)]
    run = write_run(tmp_path, jobs, out="o")
    out = tmp_path / "o"
    late = job_dict("late", write_dataset(tmp_path / "d" / "late.jsonl", 2), r=4, steps=2)

    def boom(self, req):
        raise RuntimeError("an allocator stand-in")

    monkeypatch.setattr(LiveJobs, "_submit", boom)
    _on_chunk(monkeypatch, 1, lambda: write_request(out, "submit", {"name": "late", "job": late}))
    with pytest.raises(RuntimeError, match="allocator stand-in"):
        train_inprocess(run)
    assert _answers(out)["late"] == "failed: RuntimeError: an allocator stand-in"
    monkeypatch.undo()
    summary, _ = train_inprocess(run, resume=True)  # the request is not met again
    assert summary["jobs"]["rev"]["status"] == "done" and set(summary["jobs"]) == {"rev"}


def test_an_adapter_that_can_never_fit_is_refused_before_allocation(tmp_path, capsys, megatron_single):
    jobs = [job_dict("rev", write_dataset(tmp_path / "d" / "rev.jsonl", 1), r=4, steps=2)]
    run = write_run(tmp_path, jobs, out="never")
    assert main(["train", str(run), "jobs.0.lora.r=1000000000000"]) == 2
    err = capsys.readouterr().err
    assert (err.startswith("lorafusion train: error: ")
            and "jobs.0.lora.r: expected an integer <= 65536" in err), err
    assert err.count("\n") == 1 and not (tmp_path / "never").exists()


@pytest.mark.parametrize("text, needle", [
    ('{"run": [], "jobs": {}}', "run: missing or of the wrong type ([])"),
    ('[1]', "(top level): expected an object, got list"),
    ('{"run": {"state": "done", "elapsed_s": 1, "tokens_per_s": 1, "updated": "x"}, "jobs": {"a": 3}}',
     "jobs.a: expected an object, got int"),
    ('{"run": {"state": "done", "elapsed_s": 1, "tokens_per_s": 1, "updated": "x"}, "jobs": []}',
     "jobs: missing or of the wrong type"),
    ('{"run": {"state": "done", "elapsed_s": "1", "tokens_per_s": 1, "updated": "x"}, "jobs": {}}',
     "run.elapsed_s: missing or of the wrong type"),
    ('{"run": {"state": "done", "elapsed_s": 1, "tokens_per_s": 1, "updated": "x"}, "jobs": {"a": {"state": '
     '"x"}}}',
     "jobs.a.step: missing"),
])
def test_status_json_of_the_wrong_shape(tmp_path, capsys, text, needle):
    (tmp_path / "status.json").write_text(text)
    assert main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lorafusion status: error: {tmp_path / 'status.json'}: not a readable run status")
    assert needle in err and err.count("\n") == 1, err


def _submit_job(tmp_path, name="extra", **dataset):
    import yaml

    data = write_dataset(tmp_path / "d" / f"{name}.jsonl", 5)
    job = job_dict(name, data, r=4)
    job["dataset"].update(dataset)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path, data


@pytest.mark.parametrize("case",
                         ["invalid_json", "over_capacity", "long_sample", "huge_r", "batch_over_samples",
                          "warmup_over_epochs"])
def test_submit_refuses_what_the_run_would_refuse(tmp_path, capsys, three_jobs, case):
    out = three_jobs[3]
    path, data = _submit_job(tmp_path, max_seq_len=200 if case == "over_capacity" else 64)
    overrides, words = [], []
    if case == "invalid_json":
        data.write_text(data.read_text() + '{"prompt": "x", "response": \n')
        words = [str(data), "line 25", "invalid JSON"]
    elif case == "over_capacity":
        words = ["dataset.max_seq_len 200 exceeds the run's scheduler.token_capacity 96"]
    elif case == "long_sample":
        data.write_text(data.read_text() + json.dumps({"prompt": "p" * 100, "response": "r"}) + "\n")
        words = [str(data), "sample 24 (row 24) is 103 tokens, longer than dataset.max_seq_len = 64"]
    elif case == "batch_over_samples":  # (submit said "submitted"; the run refused it at the boundary)
        overrides, words = ["global_batch_size=1000"], ["job 'extra': global_batch_size: expected at most "
                                                        "the number of samples (24), got 1000"]
    elif case == "warmup_over_epochs":
        overrides = ["max_steps=null", "num_epochs=1", "optimizer.warmup_steps=1000"]
        words = ["job 'extra': optimizer.warmup_steps: expected at most the job's"]
    else:
        overrides, words = ["lora.r=1000000000000"], ["lora.r: expected an integer <= 65536"]
    before = sorted(str(p) for p in out.rglob("*"))
    assert main(["submit", str(out), str(path), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lorafusion submit: error: ") and err.count("\n") == 1, err
    assert all(w in err for w in words), err
    assert sorted(str(p) for p in out.rglob("*")) == before  # nothing queued


# ------------------------------------------------------------------------------------------------ export
def _tree(root) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["run", "adapters", "parent", "checkpoints", "other_run"])
def test_export_never_replaces_the_run_it_reads(tmp_path, capsys, three_jobs, where):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(three_jobs[3], out)
    target = {"run": out, "adapters": out / "adapters", "parent": tmp_path,
              "checkpoints": out / "checkpoints" / "x", "other_run": three_jobs[3]}[where]
    before, other = _tree(out), _tree(three_jobs[3])
    assert main(["export", str(out), "--job", "rev", "--out", str(target), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("--out holds the directory" in err
                                     or "--out is inside the directory" in err
                                     or "--out is a lorafusion run directory" in err), err
    assert _tree(out) == before and _tree(three_jobs[3]) == other
    # from one checkpoint directory: its run is protected too
    step = next((out / "checkpoints" / "rev").glob("step_*"))
    assert main(["export", str(step), "--job", "rev", "--out", str(out / "adapters" / "rev"), "--force"]) == 2
    assert "--out is inside the directory" in capsys.readouterr().err and _tree(out) == before


def test_export_refuses_a_job_path_and_a_truncated_adapter(tmp_path, capsys, three_jobs):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(three_jobs[3], out)
    assert main(["export", str(out), "--job", "../adapters/rev", "--out", str(tmp_path / "e")]) == 2
    assert "--job: expected letters, digits" in capsys.readouterr().err
    weights = out / "adapters" / "rev" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    assert main(["export", str(out), "--job", "rev", "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert f"{weights}: does not match the sha256 the run recorded" in err and err.count("\n") == 1, err
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("files", [{"metrics.jsonl": '{"mine": 1}\n'}, {"notes.txt": "mine"},
                                   {"metrics.jsonl": "x", "plan": None}])
def test_a_fresh_run_never_replaces_a_users_files(tmp_path, capsys, megatron_single, files):
    jobs = [job_dict("rev", write_dataset(tmp_path / "d" / "rev.jsonl", 1), r=4, steps=1)]
    run = write_run(tmp_path, jobs, out="mine")
    (tmp_path / "mine").mkdir()
    for name, text in files.items():
        (tmp_path / "mine" / name).mkdir() if text is None else (tmp_path / "mine" / name).write_text(text)
    before = _tree(tmp_path / "mine")
    assert main(["train", str(run)]) == 2
    err = capsys.readouterr().err
    assert ("output_dir:" in err and "holds files that are not a lorafusion run's" in err
            and err.count("\n") == 1)
    assert (_tree(tmp_path / "mine") == before
            and sorted(p.name for p in (tmp_path / "mine").iterdir()) == sorted(files))

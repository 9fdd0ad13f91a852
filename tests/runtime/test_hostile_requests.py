"""A submitted job never costs the run: what only the run can find wrong refuses that job alone at the
boundary (recorded in requests/done/ and status), a record that no longer validates is set aside at resume
instead of refusing every resume, and the arithmetic over a job's counts never overflows. (An lr of 1e300 or
10**400 steps was accepted by ``submit``, killed the run that admitted it, and every ``--resume`` after it the
same way.)"""

import json
from types import SimpleNamespace

import pytest

from lorafusion.cli import main
from lorafusion.core.errors import UserError
from lorafusion.layers import get_lora_context
from lorafusion.rundir.requests import write_request
from lorafusion.runtime.trainer import Trainer
from runtime_utils import assert_close, job_dict, load_adapter, train_inprocess, write_dataset, write_run
import lorafusion.runtime.pipeline as pipeline


def _after_first_chunk(monkeypatch, action):
    orig, count = pipeline.run_chunk, [0]

    def wrapped(*a, **kw):
        res = orig(*a, **kw)
        count[0] += 1
        if count[0] == 1:
            action()
        return res

    monkeypatch.setattr(pipeline, "run_chunk", wrapped)


def test_a_job_only_the_run_finds_wrong_is_refused_alone(tmp_path, monkeypatch, megatron_single, capsys):
    run = write_run(tmp_path, [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=4)], out="o")
    out = tmp_path / "o"
    huge = job_dict("huge", write_dataset(tmp_path / "h.jsonl", 2), r=4, lr=1e300)  # (no submit check passed)
    boom = job_dict("boom", write_dataset(tmp_path / "b.jsonl", 3), r=4, steps=2)
    _after_first_chunk(monkeypatch, lambda: (write_request(out, "submit", {"name": "huge", "job": huge}),
                                             write_request(out, "submit", {"name": "boom", "job": boom})))
    attach, seen = Trainer._attach, {}

    def failing(self, js):  # its adapter goes on the model, then something unforeseen fails
        attach(self, js)
        if js.cfg.name == "boom":
            seen["model"] = self.model
            raise RuntimeError("an internal failure while adding it")

    monkeypatch.setattr(Trainer, "_attach", failing)
    summary, _ = train_inprocess(run)
    assert set(summary["jobs"]) == {"a"} and summary["jobs"]["a"]["status"] == "done"
    answers = {json.loads(p.read_text())["name"]: json.loads(p.read_text())["answer"]
               for p in (out / "requests" / "done").glob("*.json")}
    assert (answers["huge"].startswith("refused: ")
            and "optimizer.lr: expected a number <= 10.0" in answers["huge"])
    assert answers["boom"].startswith(
        "refused: failed while adding the job (RuntimeError: an internal failure")
    assert "boom" not in get_lora_context(seen["model"]).specs  # taken back off the model
    assert not (out / "submitted").exists()
    capsys.readouterr()
    assert main(["status", str(out)]) == 0
    shown = capsys.readouterr().err
    assert "(submit huge): refused" in shown and "(submit boom): refused" in shown, shown
    summary, _ = train_inprocess(run, resume=True)  # nothing of them is met again
    assert set(summary["jobs"]) == {"a"}


def test_a_submitted_record_that_no_longer_validates_is_set_aside_at_resume(
    tmp_path, megatron_single, capsys):
    run = write_run(tmp_path, [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=2)], out="o")
    _, out = train_inprocess(run)
    (out / "submitted").mkdir()
    bad = job_dict("old", write_dataset(tmp_path / "o.jsonl", 2), r=4,
                   steps=10**400)  # accepted before bounds
    (out / "submitted" / "old.json").write_text(json.dumps(bad))
    (out / "submitted" / "junk.json").write_bytes(b"\xff\xfe")
    (out / "submitted" / "adir.json").mkdir()  # (a directory named like a record: moved aside, not EISDIR)
    summary, _ = train_inprocess(run, resume=True)
    assert set(summary["jobs"]) == {"a"}
    assert not list((out / "submitted").glob("*.json"))
    capsys.readouterr()
    assert main(["status", str(out)]) == 0
    shown = capsys.readouterr().err
    assert ("(submit old): refused at resume: " in shown
            and "max_steps: expected an integer <= 1000000000" in shown)
    assert "(submit junk): refused at resume: " in shown and "not UTF-8" in shown, shown
    assert "(submit adir): refused at resume: " in shown and "a directory" in shown, shown
    summary, _ = train_inprocess(run, resume=True)
    assert set(summary["jobs"]) == {"a"}


def test_remaining_tokens_of_a_job_of_any_size():
    """``feed._remaining_tokens`` turned 10**400 steps into an OverflowError (int too large to convert to
    float)."""
    from lorafusion.runtime.feed import Feed

    def feed(total, gbs=16, mean=7.5):
        js = SimpleNamespace(stream=SimpleNamespace(total_steps=total, steps_done=3), cfg=SimpleNamespace(
            global_batch_size=gbs), mean_len=mean)
        return SimpleNamespace(jobs={"j": js})

    assert Feed._remaining_tokens(feed(10), "j") == 7 * 16 * 7.5
    assert Feed._remaining_tokens(feed(10**400), "j") == round((1 << 53) * 7.5)  # (samples capped at 2**53)


def test_resume_cuts_a_metrics_file_with_damaged_lines(tmp_path):
    """--resume over metrics.jsonl with a non-UTF-8 or non-object line was a UnicodeDecodeError /
    AttributeError."""
    from lorafusion.runtime.telemetry.metrics import cut_metrics

    rows = [{"job": "a", "step": 1}, {"job": "a", "step": 2}, {"job": "b", "step": 5}]
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + b'\xff\xfe\n[1, 2]\nnull\n'
                     b'{"job": "a", "step": "x"}\n' + b"[" * 100_000 + b"\n")
    cut_metrics(path, {"a": 1})
    assert [json.loads(x) for x in path.read_text().splitlines()] == [rows[0], rows[2]]


def test_a_finished_submitted_job_needs_no_data_to_resume(tmp_path, megatron_single, capsys):
    """Deleting the data of a finished submitted job made every later resume refuse (dataset: file not
    found)."""
    import yaml

    run = write_run(tmp_path, [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=2)], out="o")
    _, out = train_inprocess(run)
    late = tmp_path / "late.yaml"
    late.write_text(yaml.safe_dump(job_dict("late", write_dataset(tmp_path / "late.jsonl", 2), r=4, steps=3)))
    assert main(["submit", str(out), str(late)]) == 0
    train_inprocess(run, resume=True)
    before = load_adapter(out, "late")
    (tmp_path / "late.jsonl").unlink()
    capsys.readouterr()
    summary, _ = train_inprocess(run, resume=True)
    assert summary["jobs"]["late"]["status"] == "done" and summary["jobs"]["late"]["steps"] == 3
    assert "job late: resumed as it ended (done) without its data" in capsys.readouterr().out
    assert_close(load_adapter(out, "late"), before, rel=0)
    # a job that has not ended still needs its data: refused, naming it
    (out / "checkpoints" / "late").rename(tmp_path / "gone")
    with pytest.raises(UserError, match="late.jsonl: file not found"):
        train_inprocess(run, resume=True)

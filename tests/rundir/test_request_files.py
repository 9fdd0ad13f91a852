"""Request files and run records read as what anyone may have put there: only a regular file, bounded in size
and depth, UTF-8 JSON objects; anything else is set aside with its reason — never a hang (a FIFO blocked the
run, ``submit`` and ``--resume``), a RecursionError or a crash. ``status`` reads a status.json with non-finite
numbers. CPU, no torch, no training."""

import json
import os
import threading

import pytest

from lorafusion.core.errors import MissingFileError
from lorafusion.rundir.jsonfile import MAX_JSON_BYTES, read_json_file
from lorafusion.rundir.requests import known_job_names, pending_requests, unapplied_requests
from lorafusion.rundir.status import format_status, read_status


def _run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "requests").mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({
        "run": {"state": "done", "elapsed_s": 1.0, "tokens_per_s": 1.0, "updated": "now"},
        "jobs": {"a": {"state": "done", "step": 2, "max_steps": 2, "tokens": 9, "tokens_per_s": 1.0,
                       "last_loss": 1.0, "eta_s": 0.0}}}))
    return run


def _bad_requests(req):
    good = json.dumps({"kind": "cancel", "job": "a"})
    (req / "01-submit-utf.json").write_bytes(b'{"kind": "submit", "name": "\xff\xfe"}')
    (req / "02-submit-dir.json").mkdir()
    (req / "02-submit-dir.json" / "inside").write_text("x")
    (req / "03-submit-deep.json").write_text('{"kind": "submit", "job": ' + "[" * 100_000
                                             + "]" * 100_000 + "}")
    os.mkfifo(req / "04-submit-fifo.json")
    (req / "05-submit-big.json").write_text('{"kind": "submit", "pad": "' + "x" * MAX_JSON_BYTES + '"}')
    (req / "06-submit-list.json").write_text("[1, 2]")
    (req / "07-submit-nan.json").write_text('{"kind": "submit", "job": {"optimizer": {"lr": NaN}}}')
    (req / "08-cancel-a.json").write_text(good)
    return {"01": "not UTF-8", "02": "a directory", "03": "nested more than", "04": "a FIFO", "05": "bytes",
            "06": "not an object", "07": "NaN"}


def _in_time(fn, seconds=20):
    """``fn()``'s result, failing (not hanging) when it blocks."""
    out = []

    def call():
        try:
            out.append((True, fn()))
        except Exception as e:  # noqa: BLE001 - raised again below, in the test's thread
            out.append((False, e))

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} blocked"
    ok, value = out[0]
    if not ok:
        raise value
    return value


def test_requests_that_are_no_json_object_are_set_aside_with_their_reason(tmp_path):
    run = _run_dir(tmp_path)
    why = _bad_requests(run / "requests")
    assert _in_time(lambda: known_job_names(run)) == {"a"}  # what submit and cancel look at
    taken = _in_time(lambda: pending_requests(run))
    assert [(p.name, r) for p, r in taken] == [("08-cancel-a.json", {"kind": "cancel", "job": "a"})]
    answers = {r["file"][:2]: r["answer"] for r in unapplied_requests(run)}
    assert set(answers) == set(why), answers
    for k, needle in why.items():
        assert answers[k].startswith("refused: unreadable request") and needle in answers[k], (k, answers[k])
    assert sorted(p.name for p in (run / "requests").iterdir()) == ["08-cancel-a.json", "done"]
    assert _in_time(lambda: pending_requests(run)) == taken  # nothing met twice


def test_read_json_file_refuses_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "f")
    with pytest.raises(ValueError, match="not a regular file"):
        _in_time(lambda: read_json_file(tmp_path / "f"))
    with pytest.raises(ValueError, match="not a regular file"):
        read_json_file("/dev/zero")
    (tmp_path / "inf").write_text('{"a": 1e999}')
    with pytest.raises(ValueError, match="out of the range"):
        read_json_file(tmp_path / "inf")
    assert read_json_file(tmp_path / "inf", nonfinite_as_none=True) == {"a": None}


def test_status_with_non_finite_numbers(tmp_path, capsys):
    """``"eta_s": Infinity`` was an OverflowError traceback in ``status``."""
    run = _run_dir(tmp_path)
    text = (run / "status.json").read_text().replace('"eta_s": 0.0', '"eta_s": Infinity')
    (run / "status.json").write_text(text.replace('"last_loss": 1.0', '"last_loss": NaN'))
    shown = format_status(read_status(run), run)
    assert shown.splitlines()[-1].split()[-1] == "-", shown
    (run / "status.json").write_text(text.replace('"elapsed_s": 1.0', '"elapsed_s": 1e999'))
    with pytest.raises(MissingFileError, match="run.elapsed_s: missing or of the wrong type"):
        read_status(run)
    (run / "status.json").write_text(text.replace('"eta_s": Infinity', '"eta_s": 0, "best_eval_loss": "x"'))
    with pytest.raises(MissingFileError, match="jobs.a.best_eval_loss: of the wrong type"):
        read_status(run)
    os.unlink(run / "status.json")
    os.mkfifo(run / "status.json")
    with pytest.raises(MissingFileError, match="a FIFO"):
        _in_time(lambda: read_status(run))


def test_cancel_names_a_status_it_cannot_read(tmp_path):
    """A FIFO (or any unreadable file) as status.json made cancel say "no job 'countdown' in this run (jobs:
    none)"."""
    from lorafusion.core.errors import ConfigError
    from lorafusion.rundir.requests import check_cancel

    run = _run_dir(tmp_path)
    os.unlink(run / "status.json")
    os.mkfifo(run / "status.json")
    with pytest.raises(ConfigError, match=r"status.json: not readable \(not a regular file \(a FIFO\)\)"):
        _in_time(lambda: check_cancel(run, "a"))


def test_a_metrics_file_that_is_no_regular_file_is_named_not_waited_on(tmp_path):
    """A FIFO as metrics.jsonl made --resume wait forever (opened for appending)."""
    from lorafusion.runtime.telemetry.metrics import MetricsWriter

    os.mkfifo(tmp_path / "metrics.jsonl")
    with pytest.raises(MissingFileError, match="metrics.jsonl: not a regular file"):
        _in_time(lambda: MetricsWriter(tmp_path, tensorboard=False))


def test_a_full_disk_names_the_file_being_written(tmp_path, monkeypatch):
    """generate's output on a full disk: the error named no file (or the temporary one)."""
    import errno

    import lorafusion.rundir.atomic as atomic

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(atomic, "write_bytes", full)
    with pytest.raises(OSError) as e:
        atomic.write_text_atomic(tmp_path / "answers.jsonl", "x\n")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "answers.jsonl")
    assert list(tmp_path.iterdir()) == []

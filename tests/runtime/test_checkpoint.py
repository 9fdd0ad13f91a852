"""Checkpoints, resume and export: an interrupted run resumed from a checkpoint equals the uninterrupted
run."""

import json
import shutil

from runtime_utils import assert_close, load_adapter, train_inprocess, write_run


def _export(*args) -> int:
    from lorafusion.cli import main

    return main(["export", *args])


def test_checkpoint_resume_equals_uninterrupted_run(three_jobs, tmp_path, capsys):
    tmp, jobs, summary, out = three_jobs
    run = write_run(tmp_path, [dict(jobs[0], save_every=2)], out="full")
    train_inprocess(run)
    ckpt_dir = tmp_path / "full" / "checkpoints" / "rev"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step_000002", "step_000004"]
    assert (ckpt_dir / "latest").read_text().strip() == "step_000004"
    assert (ckpt_dir / "step_000002" / "adapter" / "adapter_model.safetensors").is_file()
    # the data stream is recorded as of the chunk boundary of step 2, although the feed had already drawn
    # the next chunk (steps 3-4) while steps 1-2 trained
    for step in (2, 4):
        state = json.loads((ckpt_dir / f"step_{step:06d}" / "state.json").read_text())
        assert state["step"] == step and state["stream"]["steps_done"] == step, state
    # an interrupted run: only the step-2 checkpoint survived
    part = tmp_path / "part" / "checkpoints" / "rev"
    part.mkdir(parents=True)
    shutil.copytree(ckpt_dir / "step_000002", part / "step_000002")
    (part / "latest").write_text("step_000002\n")
    s, _ = train_inprocess(run, [f"output_dir={tmp_path / 'part'}"], resume=True)
    assert s["jobs"]["rev"]["steps"] == 4
    assert_close(load_adapter(tmp_path / "part", "rev"), load_adapter(tmp_path / "full", "rev"), rel=1e-6)
    # export from a run directory (latest checkpoint) and from one checkpoint
    from safetensors.torch import load_file

    assert _export(str(tmp_path / "full"), "--job", "rev", "--out", str(tmp_path / "exp")) == 0
    assert load_file(tmp_path / "exp" / "adapter_model.safetensors").keys() == load_adapter(
        tmp_path / "full", "rev").keys()
    assert _export(str(ckpt_dir / "step_000002"), "--job", "rev", "--out", str(tmp_path / "exp2")) == 0
    assert (tmp_path / "exp2" / "adapter_config.json").is_file()
    capsys.readouterr()
    assert _export(str(tmp_path / "nothing"), "--job", "rev", "--out", str(tmp_path / "exp3")) == 2
    assert "no checkpoint or adapter of job 'rev'" in capsys.readouterr().err


def test_export_returns_the_final_adapter_says_which_and_never_deletes(tmp_path, capsys, megatron_single):
    from runtime_utils import job_dict, write_dataset

    jobs = [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=5, save_every=2),
            job_dict("b", write_dataset(tmp_path / "b.jsonl", 2), r=4, steps=2)]
    _, out = train_inprocess(write_run(tmp_path, jobs, out="run", capacity=1024))
    final = (out / "adapters" / "a" / "adapter_model.safetensors").read_bytes()
    step4 = (out / "checkpoints" / "a" / "step_000004" / "adapter" / "adapter_model.safetensors").read_bytes()
    assert final != step4
    capsys.readouterr()
    assert _export(str(out), "--job", "a", "--out", str(tmp_path / "e1")) == 0
    assert (tmp_path / "e1" / "adapter_model.safetensors").read_bytes() == final
    assert "exported final adapter of job 'a'" in capsys.readouterr().err
    # an unfinished job: its latest checkpoint, said so
    summary = json.loads((out / "summary.json").read_text())
    summary["jobs"]["a"]["status"] = "stopped"
    (out / "summary.json").write_text(json.dumps(summary))
    assert _export(str(out), "--job", "a", "--out", str(tmp_path / "e2")) == 0
    assert (tmp_path / "e2" / "adapter_model.safetensors").read_bytes() == step4
    assert "latest checkpoint, step 4" in capsys.readouterr().err
    # an existing --out is refused and left as it was; --force replaces an earlier export only (its marker),
    # never a user's own directory, file or symlink (no command replaces what it did not write)
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "mine.txt").write_text("precious")
    (tmp_path / "file.txt").write_text("precious")
    (tmp_path / "link").symlink_to(tmp_path / "e1")
    for existing in ("keep", "file.txt", "link", "e1"):
        assert _export(str(out), "--job", "b", "--out", str(tmp_path / existing)) == 2
        assert "already exists" in capsys.readouterr().err
    for existing, what in (("keep", "not an earlier lorafusion export"), ("file.txt", "is a file"),
                           ("link", "is a symlink")):
        assert _export(str(out), "--job", "b", "--out", str(tmp_path / existing), "--force") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and what in err and "--force replaces only" in err, err
    assert (tmp_path / "keep" / "mine.txt").read_text() == "precious" and (tmp_path / "file.txt").is_file()
    assert (tmp_path / "link").is_symlink() and sorted(p.name for p in tmp_path.iterdir()
                                                       if p.name.startswith("."))\
        == []  # no temporary left
    assert _export(str(out), "--job", "b", "--out", str(tmp_path / "e1"), "--force") == 0  # an earlier export
    assert sorted(p.name for p in (tmp_path / "e1").iterdir()) == [".lorafusion-export.json",
                                                                   ".lorafusion-sha256.json",
                                                                   "adapter_config.json",
                                                                   "adapter_model.safetensors"]
    assert (tmp_path / "e1" / "adapter_model.safetensors").read_bytes() != final  # job b's now
    assert json.loads((tmp_path / "e1" / ".lorafusion-export.json").read_text())["job"] == "b"
    (tmp_path / "empty").mkdir()
    assert _export(str(out), "--job", "b", "--out", str(tmp_path / "empty"),
                   "--force") == 0  # nothing to lose
    # a step directory of another job
    capsys.readouterr()
    assert _export(str(out / "checkpoints" / "a" / "step_000004"), "--job", "b", "--out",
                   str(tmp_path / "e3")) == 2
    assert "is a checkpoint of job 'a', not of --job 'b'" in capsys.readouterr().err
    assert not (tmp_path / "e3").exists()


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys, megatron_single):
    from runtime_utils import job_dict, write_dataset

    jobs = [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=6, save_every=2)]
    _, full = train_inprocess(write_run(tmp_path, jobs, out="full", name="full.yaml", capacity=1024))
    run = write_run(tmp_path, jobs, out="part", name="part.yaml", capacity=1024)
    part = tmp_path / "part" / "checkpoints" / "a"
    part.mkdir(parents=True)
    for step in (2, 4):
        shutil.copytree(full / "checkpoints" / "a" / f"step_00000{step}", part / f"step_00000{step}")
    (part / "latest").write_text("step_000004\n")
    pt = next((part / "step_000004").glob("rank_*.pt"))
    pt.write_bytes(pt.read_bytes()[:100])  # truncated
    capsys.readouterr()
    s, _ = train_inprocess(run, resume=True)
    out = capsys.readouterr().err
    assert "step_000004 is not usable" in out and "does not match the checkpoint's manifest.json" in out \
        and "resuming from" in out, out
    assert s["jobs"]["a"]["steps"] == 6
    assert_close(load_adapter(tmp_path / "part", "a"), load_adapter(full, "a"), rel=1e-6)
    # a garbled state.json is named, and nothing usable at all is one clear error naming the files
    (part / "step_000006" / "state.json").write_bytes(b"\xff{")
    for p in part.glob("step_*/rank_*.pt"):
        p.write_bytes(b"")
    from lorafusion.core.errors import MissingFileError

    try:
        train_inprocess(run, resume=True)
        raise AssertionError("expected an error")
    except MissingFileError as e:
        assert "no usable checkpoint" in str(e) and "state.json: not valid JSON" in str(e), str(e)


def test_resume_without_a_checkpoint_says_so(tmp_path, capsys, megatron_single):
    """--resume of a directory with no checkpoint (a mistyped output_dir?) trained from step 0 without a
    word."""
    from runtime_utils import job_dict, write_dataset

    jobs = [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=1)]
    capsys.readouterr()
    s, out = train_inprocess(write_run(tmp_path, jobs, out="fresh", capacity=1024), resume=True)
    assert s["jobs"]["a"]["steps"] == 1
    assert f"job a: --resume: no checkpoint in {out / 'checkpoints' / 'a'}; it starts from step 0" \
        in capsys.readouterr().err

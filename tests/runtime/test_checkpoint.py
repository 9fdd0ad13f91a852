"""Checkpoints, resume and export: an interrupted run resumed from a checkpoint equals the uninterrupted run."""

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
    assert load_file(tmp_path / "exp" / "adapter_model.safetensors").keys() == load_adapter(tmp_path / "full", "rev").keys()
    assert _export(str(ckpt_dir / "step_000002"), "--job", "rev", "--out", str(tmp_path / "exp2")) == 0
    assert (tmp_path / "exp2" / "adapter_config.json").is_file()
    capsys.readouterr()
    assert _export(str(tmp_path / "nothing"), "--job", "rev", "--out", str(tmp_path / "exp3")) == 2
    assert "no checkpoint or adapter of job 'rev'" in capsys.readouterr().err

"""Resume continues only the same run: the base model by content, every checkpoint file checked
against its manifest, max_steps never below the saved step, packing settings refused unless
--allow-different-result, a changed max_steps' lr schedule from the first resumed step."""

import json
import shutil

import pytest
import yaml

from lorafusion.core.errors import ConfigError, MissingFileError
from runtime_utils import job_dict, train_inprocess, write_dataset, write_run


def _run(tmp_path, steps=2, save_every=None, **kw):
    jobs = [
        job_dict("a", write_dataset(tmp_path / "d" / "a.jsonl", 1), r=4, steps=steps, save_every=save_every)]
    return write_run(tmp_path, jobs, out="o", capacity=1024, **kw)


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_resume_on_another_base_of_the_same_name_is_refused(tmp_path, megatron_single):
    from hf_utils import write_hf_checkpoint
    from lorafusion.core.arch import preset

    arch = preset("tiny-llama")
    write_hf_checkpoint(arch, tmp_path / "one" / "base", seed=0)
    write_hf_checkpoint(arch, tmp_path / "two" / "base", seed=1)  # same shapes, same name, other weights
    run = _run(tmp_path)
    raw = yaml.safe_load(run.read_text())
    raw["model"] = {"path": str(tmp_path / "one" / "base"), "dtype": "float32"}
    run.write_text(yaml.safe_dump(raw))
    train_inprocess(run)
    with pytest.raises(ConfigError, match=r"run.yaml: model.path: cannot resume job 'a' from .*step_000002: "
                                          r"the base model's config or weights differ"):
        train_inprocess(run, [f"model.path={tmp_path / 'two' / 'base'}", "jobs.0.max_steps=3"], resume=True)
    shutil.copytree(tmp_path / "one" / "base", tmp_path / "moved" / "base")  # the same base elsewhere resumes
    summary, _ = train_inprocess(run, [f"model.path={tmp_path / 'moved' / 'base'}", "jobs.0.max_steps=3"],
                                 resume=True)
    assert summary["jobs"]["a"]["steps"] == 3


def test_max_steps_below_the_saved_step_is_refused(tmp_path, megatron_single):
    run = _run(tmp_path, steps=4)
    train_inprocess(run)
    with pytest.raises(ConfigError, match=r"run.yaml: jobs.0.max_steps: cannot resume job 'a' from "
                                          r".*step_000004: it is at step 4, beyond the 2 steps max_steps = 2 "
                                          r"gives"):
        train_inprocess(run, ["jobs.0.max_steps=2"], resume=True)


def test_an_edited_state_json_is_not_believed(tmp_path, megatron_single):
    run = _run(tmp_path)
    _, out = train_inprocess(run)
    state = out / "checkpoints" / "a" / "step_000002" / "state.json"
    state.write_text(state.read_text().replace('"step": 2', '"step": 999'))
    with pytest.raises(MissingFileError, match="state.json: does not match the checkpoint's manifest.json"):
        train_inprocess(run, ["jobs.0.max_steps=3"], resume=True)


def test_a_changed_token_capacity_needs_the_flag(tmp_path, megatron_single):
    run = _run(tmp_path)
    train_inprocess(run)
    with pytest.raises(ConfigError, match=r"scheduler.token_capacity: cannot resume job 'a' .* the "
                                          r"checkpoint has 1024, the config 512; .*--allow-different-result"):
        train_inprocess(run, ["scheduler.token_capacity=512", "jobs.0.max_steps=3"], resume=True)
    summary, _ = train_inprocess(run, ["scheduler.token_capacity=512", "jobs.0.max_steps=3"], resume=True,
                                 allow_different_result=True)
    assert summary["jobs"]["a"]["steps"] == 3


def test_a_raised_max_steps_takes_its_lr_schedule_from_the_first_resumed_step(
    tmp_path, megatron_single, capsys):
    from lorafusion.runtime.optim import lr_lambda

    _, out = train_inprocess(_run(tmp_path, steps=2))
    capsys.readouterr()
    train_inprocess(_run(tmp_path, steps=4), resume=True)
    assert "job a: 2 -> 4 steps (max_steps = 4); its lr schedule spans the new total from step 3" in \
        capsys.readouterr().err
    lrs = {r["step"]: r["lr"] for r in _rows(out)}
    f = lr_lambda("cosine", 1, 4)
    assert lrs[3] == pytest.approx(1e-2 * f(2), rel=1e-12) and lrs[4] == pytest.approx(1e-2 * f(3), rel=1e-12)

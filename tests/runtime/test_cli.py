"""The command line: user errors are one line (exit 2) and write nothing; bugs keep their traceback;
`lorafusion plan` writes its tables and charts."""

import json
from pathlib import Path

import pytest

from runtime_utils import write_run


def _main(*args) -> int:
    from lorafusion.cli import main

    return main(list(args))


def test_world_size_mismatch_is_a_clear_error_and_writes_nothing(three_jobs, tmp_path, capsys, monkeypatch):
    tmp, jobs, *_ = three_jobs
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = write_run(tmp_path, jobs[:1], out="never", tp=2)
    assert _main("train", str(run)) == 2
    assert "parallelism: tp*pp*dp = 2*1*1 = 2, but the launch has 1 process(es)" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_samples_that_cannot_fit_capacity_are_a_clear_error(three_jobs, tmp_path, capsys):
    tmp, jobs, *_ = three_jobs
    run = write_run(tmp_path, jobs[:1], out="never", capacity=8)
    assert _main("train", str(run)) == 2
    err = capsys.readouterr().err
    assert "jobs.0.dataset.max_seq_len: expected at most scheduler.token_capacity (8)" in err
    assert not (tmp_path / "never").exists()


def test_existing_run_is_never_overwritten(three_jobs, capsys):
    tmp, jobs, summary, out = three_jobs
    before = (out / "metrics.jsonl").read_text()
    assert _main("train", str(tmp / "run.yaml")) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == before


def test_plan_command_writes_tables_and_charts(three_jobs, tmp_path, capsys):
    tmp, *_ = three_jobs
    assert _main("plan", str(tmp / "run.yaml"), "--out", str(tmp_path / "plan"), "--windows", "2") == 0
    for f in ("plan.jsonl", "windows.json", "gantt.png", "packing.png"):
        assert (tmp_path / "plan" / f).stat().st_size > 0
    assert "gantt.png, packing.png" in capsys.readouterr().err


def test_plan_windows_must_be_positive(three_jobs, tmp_path, capsys):
    tmp, *_ = three_jobs
    with pytest.raises(SystemExit) as e:
        _main("plan", str(tmp / "run.yaml"), "--out", str(tmp_path / "plan"), "--windows", "0")
    assert e.value.code == 2 and "--windows: expected a positive integer, got 0" in capsys.readouterr().err
    assert not (tmp_path / "plan").exists()


def test_internal_errors_keep_their_traceback(monkeypatch, capsys):
    """A ValueError/KeyError from a bug is not a user error: it propagates (traceback), it is not turned
    into one line and exit 2."""
    import lorafusion.cli as cli
    from lorafusion.core.errors import ConfigError

    def bug(args):
        raise KeyError("internal: no such slot")

    monkeypatch.setattr(cli, "cmd_plan", bug)
    with pytest.raises(KeyError, match="no such slot"):
        cli.main(["plan", "x.yaml"])

    def user_error(args):
        raise ConfigError("run.yaml: seed: expected an integer >= 0, got -1")

    monkeypatch.setattr(cli, "cmd_plan", user_error)
    assert cli.main(["plan", "x.yaml"]) == 2
    assert capsys.readouterr().err == ("lorafusion plan: error: run.yaml: seed: expected an integer >= 0, "
                                       "got -1\n")


def _bad_cases(tmp: Path, jobs: list[dict]):
    good = jobs[0]
    (tmp / "d").mkdir(parents=True, exist_ok=True)
    empty = tmp / "d" / "empty.jsonl"
    empty.write_text("")
    nofield = tmp / "d" / "nofield.jsonl"
    nofield.write_text('{"prompt": "x"}\n')
    return {
        "unknown key": ([dict(good, colour="red")], "colour"),
        "wrong type": ([dict(good, global_batch_size="many")], "global_batch_size"),
        "r <= 0": ([dict(good, lora=dict(good["lora"], r=0))], "lora.r"),
        "PEFT subset with a shared A": ([dict(good, lora=dict(good["lora"], target_modules=["q_proj"],
                                                               shared_fused_a=True))], "target_modules"),
        "missing file": (
            [dict(good, dataset=dict(good["dataset"], path=str(tmp / "nope.jsonl")))], "nope.jsonl"),
        "empty dataset": ([dict(good, dataset=dict(good["dataset"], path=str(empty)))], "empty"),
        "missing field": ([dict(good, dataset=dict(good["dataset"], path=str(nofield)))], "response"),
        "duplicate names": ([good, dict(good)], "duplicate"),
    }


@pytest.mark.parametrize("case",
                         ["unknown key", "wrong type", "r <= 0", "PEFT subset with a shared A",
                          "missing file", "empty dataset", "missing field", "duplicate names"])
def test_bad_run_is_one_clear_error_and_writes_nothing(three_jobs, tmp_path, capsys, case):
    tmp, jobs, *_ = three_jobs
    run_jobs, needle = _bad_cases(tmp_path, jobs)[case]
    run = write_run(tmp_path, run_jobs, out="never")
    assert _main("train", str(run)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[0].startswith("lorafusion train: error: ") and needle in "\n".join(err), err
    assert not (tmp_path / "never").exists()


def test_a_layout_the_model_cannot_take_is_a_user_error():
    from lorafusion.core.arch import preset
    from lorafusion.core.errors import UserError
    from lorafusion.models.spec import transformer_config

    with pytest.raises(UserError, match="parallelism.tp: 3 must divide num_query_groups=2"):
        transformer_config(preset("tiny-llama"), tp=3)
    with pytest.raises(UserError, match="parallelism.pp: 3 must divide num_layers=4"):
        transformer_config(preset("tiny-llama"), pp=3)


def test_resume_flag_goes_anywhere_on_the_command_line(tmp_path, capsys, monkeypatch):
    """`train RUN --resume key=value` parses (it used to be "unrecognized arguments", a SystemExit)."""
    from runtime_utils import job_dict, write_dataset

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = write_run(tmp_path, [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4)], out="never")
    assert _main("train", str(run), "--resume", "parallelism.tp=2", "seed=3") == 2
    assert "tp*pp*dp = 2*1*1 = 2" in capsys.readouterr().err


def test_one_run_per_output_dir(tmp_path, capsys, megatron_single):
    """While a run holds output_dir (its lock), a second one is refused with a clear error and touches
    nothing."""
    import fcntl

    from runtime_utils import job_dict, write_dataset

    run = write_run(tmp_path, [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=2)], out="o")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / ".step_000001.tmp").mkdir()  # the holder's work in progress
    with open(tmp_path / "o" / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        assert _main("train", str(run), "--resume") == 2
        assert "is in use by another lorafusion train (pid 4242)" in capsys.readouterr().err
        assert (tmp_path / "o" / ".step_000001.tmp").is_dir()
        assert not (tmp_path / "o" / "metrics.jsonl").exists()
    # (in-process: cmd_train would tear the session's process group down)
    from runtime_utils import train_inprocess

    summary, _ = train_inprocess(run, resume=True)  # released: the run goes ahead
    assert summary["jobs"]["a"]["status"] == "done"


def test_a_run_that_failed_before_any_checkpoint_can_be_run_again(tmp_path, megatron_single):
    from runtime_utils import job_dict, train_inprocess, write_dataset

    run = write_run(tmp_path, [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=2)], out="o")
    (tmp_path / "o" / "checkpoints").mkdir(parents=True)  # what a failed run leaves behind
    (tmp_path / "o" / "tensorboard").mkdir()
    (tmp_path / "o" / "metrics.jsonl").write_text('{"job": "a", "step": 1, "loss": 9.0}\n')
    (tmp_path / "o" / ".lock").write_text("")  # (a run takes its lock before it writes anything)
    summary, out = train_inprocess(run)
    assert summary["jobs"]["a"]["status"] == "done"
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"] != 9.0


def test_filesystem_and_environment_errors_are_one_line(tmp_path, capsys, megatron_single, monkeypatch):
    import errno

    from runtime_utils import job_dict, write_dataset

    run = write_run(tmp_path, [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=2)], out="o")
    (tmp_path / "afile").write_text("x")
    assert _main("train", str(run), f"output_dir={tmp_path / 'afile'}") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "output_dir: expected a directory" in err and "Traceback" not in err, err
    assert (tmp_path / "afile").read_text() == "x"
    # a full disk while the run writes its metrics
    from lorafusion.runtime.telemetry import metrics

    def full(self, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(metrics.MetricsWriter, "log_step", full)
    assert _main("train", str(run)) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl: No space left on device (ENOSPC)" in err and err.count("\n") == 1, err
    monkeypatch.undo()
    import torch

    if not torch.cuda.is_available():  # no GPU for the fused kernels
        assert _main("train", str(run), "kernels=fused", f"output_dir={tmp_path / 'o2'}") == 2
        assert "kernels: fused needs a CUDA GPU" in capsys.readouterr().err
        assert not (tmp_path / "o2").exists()


def test_plan_prints_the_simulated_pipeline_and_the_best_virtual_stages(tmp_path, capsys):
    """With pp > 1, `lorafusion plan` prints the split it simulates, the steady bubble per stage, and with
    --virtual-sweep the even and auto splits of each V (interleaved plans verified on the way)."""
    from runtime_utils import job_dict, write_dataset

    jobs = [job_dict(f"j{k}", write_dataset(tmp_path / f"d{k}.jsonl", k), r=4, steps=4, gbs=4)
            for k in range(2)]
    run = write_run(tmp_path, jobs, pp=2)
    assert _main("plan", str(run), "parallelism.virtual_stages=2", "parallelism.stage_layers=auto", "--out",
                 str(tmp_path / "plan"), "--windows", "2", "--virtual-sweep", "1,2") == 0
    out = capsys.readouterr().err
    assert "pipeline: pp=2 virtual_stages=2 stage_layers=[1, 1, 1, 1]" in out
    assert "simulated steady bubble" in out and "per stage" in out
    assert "  1  even" in out and "  2  auto" in out and "best: parallelism.virtual_stages=" in out
    rows = json.loads((tmp_path / "plan" / "windows.json").read_text())
    assert all(len(w["simulated_bubble_per_stage"]) == 2 for w in rows)
    assert _main("plan", str(run), "parallelism.virtual_stages=2", "parallelism.stage_layers=[1,2,1,1]") == 2
    assert "parallelism.stage_layers: expected one count >= 1 per virtual stage" in capsys.readouterr().err

"""Bad input and a hostile environment, through the command line as a user meets them: each is one
line on stderr naming the file and the field (or the path) and what was expected, exit 2, no traceback, and
nothing already written (checkpoints, exports, the user's files) changes. Cases tested elsewhere: unknown
keys, wrong types, missing/empty datasets, duplicate names (test_cli.py::test_bad_run_*, test_config.py), plan
--windows 0, a locked or finished output_dir, kernels: fused without CUDA, a full disk while writing metrics
(test_cli.py), export --out existing / of another job's step directory (test_checkpoint.py), --resume with a
changed setting (test_preemption.py, in-process), model.path without tokenizer files (test_config.py)."""

from __future__ import annotations

import hashlib
import json
import resource
import shutil
from pathlib import Path

import pytest
import yaml

from runtime_utils import job_dict, train_inprocess, write_dataset, write_run


def _main(*args) -> int:
    from lorafusion.cli import main

    return main([str(a) for a in args])


def _one_line(capsys, cmd: str, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"lorafusion {cmd}: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
    return err


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (the lock's pid aside) and its hash."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, megatron_single):
    """One finished two-job run (checkpoints at every step); tests work on copies."""
    tmp = tmp_path_factory.mktemp("bad")
    jobs = [job_dict("a", write_dataset(tmp / "a.jsonl", 1), r=4, steps=2, save_every=1),
            job_dict("b", write_dataset(tmp / "b.jsonl", 2), r=4, steps=2)]
    run = write_run(tmp, jobs, out="done", capacity=1024)
    train_inprocess(run)
    return tmp, jobs, run


def _copy_run(finished, tmp_path) -> tuple[Path, Path]:
    src, jobs, _ = finished
    out = tmp_path / "o"
    shutil.copytree(src / "done", out)
    return write_run(tmp_path, jobs, out="o", capacity=1024), out


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("field, text", [("optimizer.lr", ".inf"), ("lora.lora_alpha", ".inf"),
                                         ("lora.lora_dropout", ".nan")])
def test_non_finite_number_in_a_job_yaml(finished, tmp_path, capsys, field, text):
    src, jobs, _ = finished
    section, key = field.split(".")
    job = json.loads(json.dumps(jobs[0]))
    job[section][key] = "PLACEHOLDER"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job).replace("PLACEHOLDER", text))
    run = write_run(tmp_path, ["job.yaml"], out="never")
    assert _main("train", run) == 2
    _one_line(capsys, "train", f"job.yaml: {field}", "finite")
    assert not (tmp_path / "never").exists()


def test_output_dir_that_is_a_file(finished, tmp_path, capsys):
    src, jobs, run = finished
    (tmp_path / "notes.txt").write_text("mine")
    assert _main("train", run, f"output_dir={tmp_path / 'notes.txt'}") == 2
    _one_line(capsys, "train", "run.yaml: output_dir: expected a directory", "notes.txt is a file")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_data_file_that_is_not_utf8(finished, tmp_path, capsys):
    src, jobs, _ = finished
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"prompt": "ok", "response": "fine"}\n{"prompt": "caf\xe9", "response": "x"}\n')
    run = write_run(tmp_path, [dict(jobs[0], dataset=dict(jobs[0]["dataset"], path=str(data)))], out="never")
    assert _main("train", run) == 2
    _one_line(capsys, "train", "job 'a'", str(data), "line 2: not valid UTF-8", "0xe9")
    assert not (tmp_path / "never").exists()


def test_model_config_json_with_a_string_number(finished, tmp_path, capsys):
    from lorafusion.core.arch import arch_to_hf_config, preset

    src, jobs, run = finished
    hf = tmp_path / "hf"
    hf.mkdir()
    cfg = arch_to_hf_config(preset("tiny-llama"))
    cfg["hidden_size"] = "64"
    (hf / "config.json").write_text(json.dumps(cfg))
    raw = yaml.safe_load(run.read_text())
    raw["model"] = {"path": str(hf), "dtype": "float32"}
    raw["output_dir"] = str(tmp_path / "never")
    (tmp_path / "hf.yaml").write_text(yaml.safe_dump(raw))
    assert _main("train", tmp_path / "hf.yaml") == 2
    _one_line(capsys, "train", f"{hf / 'config.json'}: hidden_size: expected a positive integer, got '64'")
    assert not (tmp_path / "never").exists()  # (the run had created it to take its lock)


# ---------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("damage, needle", [
    (lambda s: s.write_text("[]"), "state.json: expected a JSON object, got list"),
    (lambda s: s.write_text("{}"), "state.json: no job, step, stream"),
    (lambda s: s.write_bytes(b"\xff{"), "state.json: not valid JSON"),
    (lambda s: (lambda pt: pt.write_bytes(pt.read_bytes()[:100]))(next(s.parent.glob("rank_*.pt"))),
     "rank_tp0_pp0.pt: does not match the checkpoint's manifest.json (edited or damaged)"),
])
def test_resume_from_a_damaged_only_checkpoint(finished, tmp_path, capsys, damage, needle):
    run, out = _copy_run(finished, tmp_path)
    for p in (out / "checkpoints" / "a").glob("step_*"):
        if p.name != "step_000002":
            shutil.rmtree(p)
    damage(out / "checkpoints" / "a" / "step_000002" / "state.json")
    before = _snapshot(out)
    assert _main("train", run, "jobs.0.max_steps=3", "--resume") == 2
    _one_line(capsys, "train", f"{out / 'checkpoints' / 'a'}: no usable checkpoint", needle)
    assert _snapshot(out) == before


def test_resume_with_a_changed_setting_changes_nothing(finished, tmp_path, capsys):
    run, out = _copy_run(finished, tmp_path)
    before = _snapshot(out)
    assert _main("train", run, "jobs.a.optimizer.lr=0.02", "--resume") == 2
    _one_line(capsys, "train", "run.yaml: jobs.0.optimizer.lr: cannot resume job 'a'", "0.01", "0.02")
    assert _snapshot(out) == before


# ---------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("text, needle", [(b"\xff{", "state.json: not valid JSON"),
                                          (b"[1, 2]", "state.json: expected a JSON object, got list")])
def test_export_of_a_step_directory_with_a_damaged_state(finished, tmp_path, capsys, text, needle):
    src, *_ = finished
    step = tmp_path / "step_000002"
    shutil.copytree(src / "done" / "checkpoints" / "a" / "step_000002", step)
    (step / "state.json").write_bytes(text)
    assert _main("export", step, "--job", "a", "--out", tmp_path / "exp") == 2
    _one_line(capsys, "export", f"{step / 'state.json'}", needle[len("state.json"):])
    assert not (tmp_path / "exp").exists() and not list(tmp_path.glob(".exp*"))


# --------------------------------------------------------------------------------------------- environment
@pytest.mark.parametrize("limit, file", [(40_000, "adapter_model.safetensors"), (120_000, "rank_tp0_pp0.pt")])
def test_file_size_limit_while_checkpointing(finished, tmp_path, capsys, limit, file):
    """``ulimit -f`` (or a full disk) while a checkpoint is written: one line naming the file; no partial
    checkpoint; the directory can be run again. (Python ignores SIGXFSZ: the write fails with EFBIG.)"""
    src, jobs, _ = finished
    run = write_run(tmp_path, [jobs[0]], out="o", capacity=1024)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        rc = _main("train", run)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert rc == 2
    _one_line(capsys, "train", "cannot write", file, "File too large (EFBIG)")
    ckpts = tmp_path / "o" / "checkpoints" / "a"
    assert not ckpts.exists() or not list(ckpts.iterdir())
    # a failed run leaves the directory runnable again (in-process: cmd_train
    summary, _ = train_inprocess(run)
    assert summary["jobs"]["a"]["status"] == "done"  # would tear the session's process group down)

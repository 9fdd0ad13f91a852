"""The training runtime: multi = separate, isolation between jobs, checkpoints/resume, export, CLI errors."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime_utils import job_dict, write_dataset, write_run

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, cwd=None, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "lorafusion.cli", *args], cwd=cwd or ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _train_inprocess(run_yaml: Path, overrides=()):
    from lorafusion.config import load_run_config
    from lorafusion.runtime.trainer import Trainer

    cfg = load_run_config(run_yaml, list(overrides))
    return Trainer(cfg).run(), Path(cfg.output_dir)


def _adapter(out: Path, job: str) -> dict[str, torch.Tensor]:
    return load_file(out / "adapters" / job / "adapter_model.safetensors")


def _assert_close(a, b, rel=1e-5):
    """Relative error ||a - b|| / ||b|| per tensor (AdamW turns fp32 summation-order noise in near-zero
    gradients into single elements that differ more; the tensor-wise error is what training sees)."""
    assert a.keys() == b.keys()
    for k in a:
        err = (a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12)
        assert err <= rel, (k, float(err))


@pytest.fixture(scope="module")
def three_jobs(tmp_path_factory, megatron_single):
    tmp = tmp_path_factory.mktemp("rt")
    jobs = [
        job_dict("rev", write_dataset(tmp / "d" / "rev.jsonl", 1), r=4, dropout=0.1),
        job_dict("up", write_dataset(tmp / "d" / "up.jsonl", 2, kind="upper"), r=8, gbs=3,
                 targets=["q_proj", "k_proj", "v_proj", "o_proj"]),
        job_dict("rev2", write_dataset(tmp / "d" / "rev2.jsonl", 3, rows=17), r=16, gbs=5, dropout=0.2,
                 targets=["gate_proj", "up_proj", "down_proj"]),
    ]
    run = write_run(tmp, jobs, out="together")
    summary, out = _train_inprocess(run)
    return tmp, jobs, summary, out


def test_multi_adapter_run_equals_each_adapter_alone(three_jobs):
    tmp, jobs, summary, out = three_jobs
    assert all(j["steps"] == 4 for j in summary["jobs"].values())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {m["job"] for m in metrics} == {"rev", "up", "rev2"} and len(metrics) == 12
    assert set(metrics[0]) == {"job", "step", "loss", "tokens", "lr", "grad_norm", "elapsed_s"}
    for job in jobs:
        alone = write_run(tmp, [job], out=f"alone_{job['name']}", name=f"alone_{job['name']}.yaml")
        s, out_alone = _train_inprocess(alone)
        _assert_close(_adapter(out_alone, job["name"]), _adapter(out, job["name"]))
        ours = [m["loss"] for m in metrics if m["job"] == job["name"]]
        theirs = [json.loads(x)["loss"] for x in (out_alone / "metrics.jsonl").read_text().splitlines()]
        assert ours == pytest.approx(theirs, rel=1e-5)


def test_other_jobs_hyperparameters_and_tokens_leave_adapter_bit_identical(three_jobs):
    tmp, jobs, summary, out = three_jobs
    changed = [dict(j) for j in jobs]
    up = dict(changed[1])
    up["optimizer"] = dict(up["optimizer"], lr=3e-3)
    up["lora"] = dict(up["lora"], lora_alpha=3.0, lora_dropout=0.3)
    # same lengths, different characters: the scheduler packs identically
    src = Path(up["dataset"]["path"]).read_text().splitlines()
    alt = tmp / "d" / "up_alt.jsonl"
    alt.write_text("".join(json.dumps({k: v.replace("a", "b").replace("C", "D") for k, v in json.loads(line).items()})
                           + "\n" for line in src))
    up["dataset"] = dict(up["dataset"], path=str(alt))
    changed[1] = up
    _, out2 = _train_inprocess(write_run(tmp, changed, out="changed", name="changed.yaml"))
    for name in ("rev", "rev2"):
        a, b = _adapter(out, name), _adapter(out2, name)
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert not all(torch.equal(x, y) for x, y in zip(_adapter(out, "up").values(), _adapter(out2, "up").values()))


def test_checkpoint_resume_equals_uninterrupted_run(three_jobs, tmp_path):
    import shutil

    tmp, jobs, summary, out = three_jobs
    run = write_run(tmp_path, [dict(jobs[0], save_every=2)], out="full")
    _train_inprocess(run)
    ckpt_dir = tmp_path / "full" / "checkpoints" / "rev"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step_000002", "step_000004"]
    assert (ckpt_dir / "latest").read_text().strip() == "step_000004"
    assert (ckpt_dir / "step_000002" / "adapter" / "adapter_model.safetensors").is_file()
    # an interrupted run: only the step-2 checkpoint survived
    part = tmp_path / "part" / "checkpoints" / "rev"
    part.mkdir(parents=True)
    shutil.copytree(ckpt_dir / "step_000002", part / "step_000002")
    (part / "latest").write_text("step_000002\n")
    from lorafusion.config import load_run_config
    from lorafusion.runtime.trainer import Trainer

    cfg = load_run_config(run, [f"output_dir={tmp_path / 'part'}"])
    Trainer(cfg, resume=True).run()
    _assert_close(_adapter(tmp_path / "part", "rev"), _adapter(tmp_path / "full", "rev"), rel=1e-6)
    # export from a run directory (latest checkpoint) and from one checkpoint
    res = _cli("export", str(tmp_path / "full"), "--job", "rev", "--out", str(tmp_path / "exp"))
    assert res.returncode == 0, res.stderr
    assert load_file(tmp_path / "exp" / "adapter_model.safetensors").keys() == _adapter(tmp_path / "full", "rev").keys()
    res = _cli("export", str(ckpt_dir / "step_000002"), "--job", "rev", "--out", str(tmp_path / "exp2"))
    assert res.returncode == 0 and (tmp_path / "exp2" / "adapter_config.json").is_file()
    res = _cli("export", str(tmp_path / "nothing"), "--job", "rev", "--out", str(tmp_path / "exp3"))
    assert res.returncode == 2 and "no checkpoint or adapter of job 'rev'" in res.stderr


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(pp=2), dict(dp=2), dict(tp=2), dict(pp=2, recompute=True)])
def test_two_process_runs_equal_single_process(three_jobs, tmp_path, layout):
    tmp, jobs, summary, out = three_jobs
    name = "_".join(f"{k}{v}" for k, v in layout.items())
    run = write_run(tmp_path, jobs, out=name, **layout)
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "lorafusion.cli", "train", str(run)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-4000:]
    # Same training: per-step losses and full-adapter gradient norms (clipping input) agree to fp32
    # noise; final weights agree tensor-wise to 1e-4 (AdamW scales gradient noise of ~eps-sized elements
    # by lr/eps, and TP/PP sum partial products in another order than one process).
    ours = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    key = lambda r: (r["job"], r["step"])  # noqa: E731
    ours, ref = sorted(ours, key=key), sorted(ref, key=key)
    assert [key(r) for r in ours] == [key(r) for r in ref]
    for a, b in zip(ours, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
        assert a["tokens"] == b["tokens"] and a["lr"] == pytest.approx(b["lr"], rel=1e-12)
    for job in ("rev", "up", "rev2"):
        _assert_close(_adapter(tmp_path / name, job), _adapter(out, job), rel=1e-4)
    s = json.loads((tmp_path / name / "summary.json").read_text())
    if layout.get("pp"):
        assert s["bubble_ratio"] is not None and 0 <= s["bubble_ratio"] < 1


def test_activation_recompute_trains_the_same(three_jobs, tmp_path):
    """Full recompute on one stage: the first stage's adapters still get gradients (frozen embeddings give
    the checkpoint no input that requires grad) and the routing of the recomputed microbatch is its own."""
    tmp, jobs, summary, out = three_jobs
    _, out_r = _train_inprocess(write_run(tmp_path, jobs, out="recompute", recompute=True))
    for job in ("rev", "up", "rev2"):
        _assert_close(_adapter(out_r, job), _adapter(out, job), rel=1e-5)


def test_world_size_mismatch_is_a_clear_error_and_writes_nothing(three_jobs, tmp_path):
    tmp, jobs, *_ = three_jobs
    run = write_run(tmp_path, jobs[:1], out="never", tp=2)
    res = _cli("train", str(run))
    assert res.returncode == 2
    assert "parallelism: tp*pp*dp = 2*1*1 = 2, but the launch has 1 process(es)" in res.stderr
    assert not (tmp_path / "never").exists()


def test_samples_that_cannot_fit_capacity_are_a_clear_error(three_jobs, tmp_path):
    tmp, jobs, *_ = three_jobs
    run = write_run(tmp_path, jobs[:1], out="never", capacity=8)
    res = _cli("train", str(run))
    assert res.returncode == 2 and "jobs.0.dataset.max_seq_len: expected at most scheduler.token_capacity (8)" in res.stderr
    assert not (tmp_path / "never").exists()


def test_existing_run_is_never_overwritten(three_jobs):
    tmp, jobs, summary, out = three_jobs
    before = (out / "metrics.jsonl").read_text()
    res = _cli("train", str(tmp / "run.yaml"))
    assert res.returncode == 2 and "already holds a run" in res.stderr
    assert (out / "metrics.jsonl").read_text() == before


def test_plan_command_writes_tables_and_charts(three_jobs, tmp_path):
    tmp, *_ = three_jobs
    res = _cli("plan", str(tmp / "run.yaml"), "--out", str(tmp_path / "plan"), "--windows", "2")
    assert res.returncode == 0, res.stderr
    for f in ("plan.jsonl", "windows.json", "gantt.png", "packing.png"):
        assert (tmp_path / "plan" / f).stat().st_size > 0


def test_quickstart_demo_learns(tmp_path):
    """A shortened `make demo`: every job's loss falls clearly and adapters are exported."""
    res = _cli("train", str(ROOT / "configs" / "quickstart.yaml"), f"output_dir={tmp_path / 'qs'}",
               "logging.progress=false", *[f"jobs.{i}.max_steps=25" for i in range(3)])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "qs" / "summary.json").read_text())
    for name, j in summary["jobs"].items():
        assert j["final_loss"] < 0.8 * j["first_loss"], (name, j)
        assert (tmp_path / "qs" / "adapters" / name / "adapter_model.safetensors").is_file()


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
        "PEFT subset": ([dict(good, lora=dict(good["lora"], target_modules=["q_proj"]))], "target_modules"),
        "missing file": ([dict(good, dataset=dict(good["dataset"], path=str(tmp / "nope.jsonl")))], "nope.jsonl"),
        "empty dataset": ([dict(good, dataset=dict(good["dataset"], path=str(empty)))], "empty"),
        "missing field": ([dict(good, dataset=dict(good["dataset"], path=str(nofield)))], "response"),
        "duplicate names": ([good, dict(good)], "duplicate"),
    }


@pytest.mark.parametrize("case", ["unknown key", "wrong type", "r <= 0", "PEFT subset", "missing file",
                                  "empty dataset", "missing field", "duplicate names"])
def test_bad_run_is_one_clear_error_and_writes_nothing(three_jobs, tmp_path, capsys, case):
    from lorafusion.cli import main

    tmp, jobs, *_ = three_jobs
    run_jobs, needle = _bad_cases(tmp_path, jobs)[case]
    run = write_run(tmp_path, run_jobs, out="never")
    assert main(["train", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[0].startswith("lorafusion train: error: ") and needle in "\n".join(err), err
    assert not (tmp_path / "never").exists()

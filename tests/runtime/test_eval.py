"""Evaluation during training (runtime/evaluate.py): the eval loss is the token mean of the model with the
job's adapter over its eval set (no dropout), whatever it is packed with; eval_split is fixed by the seed and
disjoint from training; early stopping, the best-eval checkpoint (kept by pruning, ``export --best``), config
errors; PP=2 gives the single-process eval losses."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime_utils import job_dict, write_dataset, write_run


def _eval_jobs(tmp: Path) -> list[dict]:
    """Job a: eval_split of its file (dropout in training); job b: its own eval file."""
    a = job_dict("a", write_dataset(tmp / "d" / "a.jsonl", 1, rows=30), r=4, steps=4, gbs=4, dropout=0.1)
    a.update(eval_split=0.2, eval_every=2)
    b = job_dict("b", write_dataset(tmp / "d" / "b.jsonl", 2, kind="upper"), r=8, steps=4, gbs=3)
    b.update(eval_dataset={"path": str(write_dataset(tmp / "d" / "b_eval.jsonl", 5, rows=7, kind="upper")),
                           "format": "prompt_response", "max_seq_len": 64}, eval_every=2)
    return [a, b]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, megatron_single):
    """(trainer after its run, summary, output_dir) of the two eval jobs."""
    from lorafusion.config import load_run_config
    from lorafusion.runtime.trainer import Trainer

    tmp = tmp_path_factory.mktemp("eval")
    cfg = load_run_config(write_run(tmp, _eval_jobs(tmp)))
    trainer = Trainer(cfg)
    summary = trainer.run()
    return trainer, summary, Path(cfg.output_dir), tmp


def _direct(model, name: str, samples) -> float:
    """Token mean of the next-token cross-entropy over the response tokens of ``samples``, each sample alone
    through the model (logits, no labels), model.eval() (no dropout)."""
    from lorafusion.data.packing import pack_microbatch
    from lorafusion.layers import set_batch

    total, count = 0.0, 0
    model.eval()
    try:
        with torch.no_grad():
            for toks, plen in samples:
                b = pack_microbatch([(name, toks)])
                set_batch(model, b.routing, b.adapters)
                logits = model(b.tokens, b.position_ids, attention_mask=None,
                               packed_seq_params=b.packed_seq_params())
                first = max(plen, 1)  # the first target token: the first response token
                target = torch.tensor(toks[first:])
                ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1])[first - 1:len(toks) - 1].double(),
                                     target, reduction="sum")
                total += float(ce)
                count += len(target)
    finally:
        set_batch(model, None, ())
        model.train()
    return total / count


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_eval_loss_equals_direct_computation(trained):
    trainer, summary, out, _ = trained
    evals = [r for r in _rows(out) if "eval_loss" in r]
    assert [(r["job"], r["step"]) for r in evals] == [("a", 2), ("b", 2), ("a", 4), ("b", 4)]
    for name in ("a", "b"):
        js = trainer.jobs[name]
        want = _direct(trainer.model, name, js.eval_samples)  # the model at the end: the step-4 evaluation
        last = [r for r in evals if r["job"] == name][-1]
        assert last["eval_loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert last["eval_tokens"] == sum(len(t) - max(p, 1) for t, p in js.eval_samples)
        assert summary["jobs"][name]["eval_loss"] == last["eval_loss"]
        assert summary["jobs"][name]["best_eval_loss"] == min(r["eval_loss"] for r in evals
                                                              if r["job"] == name)
    status = json.loads((out / "status.json").read_text())["jobs"]
    assert status["a"]["best_step"] == summary["jobs"]["a"]["best_step"]


def test_packing_with_another_jobs_eval_changes_nothing(trained):
    from lorafusion.runtime.evaluate import eval_losses, pack_eval

    trainer, *_ = trained
    a, b = trainer.jobs["a"].eval_samples, trainer.jobs["b"].eval_samples
    cap = 80  # small: several microbatches, some holding samples of both jobs
    assert any(len(mb.adapters) == 2 for mb in pack_eval({"a": a, "b": b}, cap))
    timers = trainer.model.config.timers  # given to the model when it was built; paused during evaluations
    assert timers is trainer.timers
    timers.reset()
    alone = eval_losses(trainer.model, {"a": a}, cap)["a"]
    together = eval_losses(trainer.model, {"b": b, "a": a}, cap)
    one_per_mb = eval_losses(trainer.model, {"a": a}, 64)["a"]
    assert together["a"][1] == alone[1]
    assert together["a"][0] == pytest.approx(alone[0], rel=1e-6)
    assert one_per_mb[0] == pytest.approx(alone[0], rel=1e-6)
    assert together["b"][0] == pytest.approx(eval_losses(trainer.model, {"b": b}, cap)["b"][0], rel=1e-6)
    assert trainer.model.config.timers is timers and timers.reset() == {}


def test_eval_split_is_fixed_by_the_seed_and_disjoint_from_training(trained):
    from lorafusion.data import build_tokenizer, load_job_samples
    from lorafusion.data.evalset import split_eval

    train, held = split_eval(30, 0.2, 1234, "a")
    assert (train, held) == split_eval(30, 0.2, 1234, "a")
    assert len(held) == 6 and not set(train) & set(held) and sorted(train + held) == list(range(30))
    assert split_eval(30, 0.2, 99, "a")[1] != held and split_eval(30, 0.2, 1234, "b")[1] != held
    trainer, *_ = trained
    js = trainer.jobs["a"]
    everything = load_job_samples(js.cfg, build_tokenizer(trainer.cfg.tokenizer)).samples
    assert js.eval_samples == [everything[i] for i in held] and js.samples == [everything[i] for i in train]
    assert js.stream.num_samples == 24  # the stream draws from the training samples only


def test_early_stopping_best_checkpoint_survives_pruning_and_export_best(tmp_path, megatron_single,
                                                                         monkeypatch, capsys):
    """Scripted eval losses 3, 2, 2.5, 2.1 with patience 2: best at the 2nd evaluation (step 2), stop after
    the 4th (step 4); keep_last 1 keeps the best checkpoint; the other job runs to its end."""
    from lorafusion import cli
    from lorafusion.runtime.evaluate import Evaluator
    from runtime_utils import train_inprocess

    script = iter([3.0, 2.0, 2.5, 2.1, 1.0, 1.0])
    monkeypatch.setattr(Evaluator, "losses", lambda self, names, cap: {n: (next(script), 10) for n in names})
    a = job_dict("a", write_dataset(tmp_path / "d" / "a.jsonl", 1), r=4, steps=8, gbs=2)
    a.update(eval_split=0.25, eval_every=1, early_stopping_patience=2)
    b = job_dict("b", write_dataset(tmp_path / "d" / "b.jsonl", 2, kind="upper"), r=4, steps=6, gbs=2)
    summary, out = train_inprocess(write_run(tmp_path, [a, b]),
                                   ["scheduler.lookahead_batches=1", "checkpoint.keep_last=1"])
    ja = summary["jobs"]["a"]
    assert (ja["status"], ja["steps"], ja["best_step"], ja["best_eval_loss"], ja["eval_loss"]) == \
        ("early_stopped", 4, 2, 2.0, 2.1)
    assert summary["jobs"]["b"]["status"] == "done" and summary["jobs"]["b"]["steps"] == 6
    rows = _rows(out)
    assert [r["eval_loss"] for r in rows if "eval_loss" in r] == [3.0, 2.0, 2.5, 2.1]
    assert max(r["step"] for r in rows if r["job"] == "a") == 4
    assert json.loads((out / "status.json").read_text())["jobs"]["a"]["state"] == "early_stopped"
    ckpts = out / "checkpoints" / "a"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000002", "step_000004"]
    assert (ckpts / "best").read_text().strip() == "step_000002"
    assert (out / "adapters" / "a" / "adapter_model.safetensors").is_file()  # its state at the stop
    capsys.readouterr()
    assert cli.main(
        ["export", str(out), "--job", "a", "--best", "--out", str(tmp_path / "best"), "--json"]) == 0
    assert "step 2" in json.loads(capsys.readouterr().out)["exported"]
    assert (tmp_path / "best" / "adapter_model.safetensors").read_bytes() == \
        (ckpts / "step_000002" / "adapter" / "adapter_model.safetensors").read_bytes()
    assert cli.main(["export", str(out), "--job", "b", "--best", "--out", str(tmp_path / "nob")]) == 2
    err = capsys.readouterr().err
    assert "no best-eval checkpoint of job 'b'" in err and "no eval set" in err
    # a resume keeps the job early-stopped, with its best (no more evaluations, no more steps)
    summary, _ = train_inprocess(write_run(tmp_path, [a, b]), ["scheduler.lookahead_batches=1",
                                                               "checkpoint.keep_last=1"], resume=True)
    assert summary["jobs"]["a"] == ja
    assert [r["eval_loss"] for r in _rows(out) if "eval_loss" in r] == [3.0, 2.0, 2.5, 2.1]


def test_eval_rows_are_strict_json_with_a_tensorboard_scalar(tmp_path):
    from lorafusion.runtime.telemetry.metrics import MetricsWriter

    w = MetricsWriter(tmp_path, tensorboard=True)
    w.log_eval(
        {"job": "a", "step": 3, "eval_loss": 1.5, "eval_tokens": 10, "best_eval_loss": 1.5, "best_step": 3})
    w.log_eval({"job": "a", "step": 6, "eval_loss": float("nan"), "eval_tokens": 10, "best_eval_loss": 1.5,
                "best_step": 3})
    w.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["eval_loss"] == 1.5 and rows[1]["eval_loss"] is None
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("a/eval_loss")] == [(3, 1.5)]


def test_best_pointer_survives_pruning(tmp_path):
    from lorafusion.checkpoint.format import best_checkpoint, mark_best, prune_checkpoints

    for s in range(1, 6):
        (tmp_path / f"step_{s:06d}").mkdir()
        (tmp_path / f"step_{s:06d}" / "state.json").write_text("{}")
    (tmp_path / "latest").write_text("step_000005\n")
    mark_best(tmp_path, 2)
    prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000004", "step_000005"]
    assert best_checkpoint(tmp_path).name == "step_000002"


@pytest.mark.parametrize("change, field, words", [
    (dict(eval_split=0.1, eval_dataset="X"), "eval_split", "not both"),
    (dict(eval_split=1.0), "eval_split", "< 1"),
    (dict(eval_split=0.0), "eval_split", "> 0"),
    (dict(eval_every=5), "eval_every", "needs an eval set"),
    (dict(eval_split=0.1, early_stopping_patience=2), "early_stopping_patience", "needs eval_every"),
    (dict(eval_dataset="missing"), "eval_dataset.path", "not found"),
])
def test_config_errors_are_one_clear_line(tmp_path, change, field, words):
    from lorafusion.config import load_run_config
    from lorafusion.core.errors import ConfigError

    job = job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4)
    for k, v in change.items():
        job[k] = {"path": str(tmp_path / ("b.jsonl" if v == "X" else "nope.jsonl")),
                  "format": "prompt_response"} \
            if k == "eval_dataset" else v
    write_dataset(tmp_path / "b.jsonl", 2)
    with pytest.raises(ConfigError) as e:
        load_run_config(write_run(tmp_path, [job]))
    msg = str(e.value)
    assert "\n" not in msg and f"jobs.0.{field}" in msg and words in msg, msg


def test_an_empty_eval_set_is_one_clear_error(tmp_path):
    from lorafusion.config import load_run_config
    from lorafusion.core.errors import ConfigError
    from lorafusion.runtime.jobs import load_jobs

    job = job_dict("a", write_dataset(tmp_path / "a.jsonl", 1, rows=8), r=4)
    job.update(eval_split=0.05)  # 0.4 of a sample
    with pytest.raises(ConfigError) as e:
        load_jobs(load_run_config(write_run(tmp_path, [job])))
    assert "\n" not in str(e.value) and "eval_split" in str(e.value) and "empty eval set" in str(e.value)
    (tmp_path / "empty.jsonl").write_text("")
    job.update(eval_split=None,
               eval_dataset={"path": str(tmp_path / "empty.jsonl"), "format": "prompt_response"})
    with pytest.raises(ConfigError) as e:
        load_jobs(load_run_config(write_run(tmp_path, [job])))
    assert "\n" not in str(e.value) and "eval_dataset" in str(e.value) and "empty" in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.two_process(name, jobs=_eval_jobs, guard=bool(layout.get("pp")),
                                                     **layout))
    for name, layout in {"eval_pp2": dict(pp=2), "eval_pp2_v2": dict(pp=2, virtual_stages=2),
                         "eval_dp2": dict(dp=2)}.items()])
def test_two_process_eval_losses_equal_single_process(trained, two_process, name):
    """PP=2 (Megatron's forward-only pipeline schedule; also interleaved over two model chunks a rank, its
    microbatches padded with no-ops to a multiple of pp, the p2p shapes from the plan) and DP=2 (the eval
    microbatches split over the replicas, one padded with a no-op) give the single-process eval rows. (Both
    ranks of ``lorafusion train`` from the shared two-process launch, tests/runtime/conftest.py.)"""
    _, _, out, _ = trained
    ours = [r for r in _rows(two_process(name)) if "eval_loss" in r]
    ref = [r for r in _rows(out) if "eval_loss" in r]
    assert [(r["job"], r["step"], r["eval_tokens"]) for r in ours] == [(r["job"], r["step"], r["eval_tokens"])
                                                                       for r in ref]
    for x, y in zip(ours, ref):
        assert x["eval_loss"] == pytest.approx(y["eval_loss"], rel=1e-5), (x, y)

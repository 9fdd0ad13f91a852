"""A run reads its config and never writes it: every ``auto`` is made a value in the RunPlan (summary.json's
``run_plan``, the same as ``lorafusion plan`` resolves), a submitted job joins the job registry, not the
config."""

from __future__ import annotations

import pytest

from runtime_utils import job_dict, write_dataset, write_run


def test_a_run_with_autos_and_a_submission_leaves_its_config_as_loaded(tmp_path,
                                                                       megatron_single, monkeypatch):
    import yaml

    import lorafusion.runtime.pipeline as pipeline
    from lorafusion.cli import main
    from lorafusion.config import load_run_config
    from lorafusion.resolve import World, resolve
    from lorafusion.runtime.trainer import Trainer

    jobs = [job_dict("a", write_dataset(tmp_path / "d" / "a.jsonl", 1), r=4, steps=4)]
    run = write_run(tmp_path, jobs, capacity="auto", dp="auto", recompute=True, recompute_layers="auto")
    late = job_dict("late", write_dataset(tmp_path / "d" / "late.jsonl", 2), r=4, steps=2)
    (tmp_path / "late.yaml").write_text(yaml.safe_dump(late))
    orig, count = pipeline.run_chunk, [0]

    def run_chunk(*a, **kw):  # a submission while the run trains
        res = orig(*a, **kw)
        count[0] += 1
        if count[0] == 1:
            assert main(["submit", str(tmp_path / "out"), str(tmp_path / "late.yaml")]) == 0
        return res

    monkeypatch.setattr(pipeline, "run_chunk", run_chunk)
    cfg = load_run_config(run)
    before = cfg.model_dump()
    summary = Trainer(cfg).run()
    assert summary["jobs"]["late"]["status"] == "done"  # it trained, from the registry
    assert cfg.model_dump() == before and [j.name for j in cfg.jobs] == ["a"]
    assert cfg.scheduler.token_capacity == "auto" and cfg.parallelism.dp == "auto"
    assert summary["run_plan"] == resolve(load_run_config(run), World(1), None).to_dict()
    assert summary["parallelism"]["dp"] == 1 and summary["run_plan"]["token_capacity"] == 5120


def test_the_loaded_config_refuses_writes():
    from pathlib import Path

    from pydantic import ValidationError

    from lorafusion.config import load_run_config

    cfg = load_run_config(Path(__file__).resolve().parents[2] / "configs/quickstart.yaml", check_files=False)
    for write in (lambda: setattr(cfg.scheduler, "token_capacity", 8192), lambda: setattr(cfg, "serve", True),
                  lambda: setattr(cfg.parallelism, "dp", 2),
                  lambda: setattr(cfg.jobs[0].optimizer, "lr", 1.0)):
        with pytest.raises(ValidationError, match="frozen"):
            write()

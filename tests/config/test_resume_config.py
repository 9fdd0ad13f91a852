"""A resumed run's config (config/resume.py): the one recorded at its start, overrides included, plus only
what changed since — the YAML's edits and the overrides given now — each change named."""

from pathlib import Path

import pytest
import yaml

from lorafusion.config import load_run_config
from lorafusion.config.resume import config_record, resume_config
from lorafusion.core.errors import ConfigError


def _run(tmp: Path, steps: int = 4, capacity: int = 256) -> Path:
    data = tmp / "a.jsonl"
    data.write_text("".join(f'{{"prompt": "p{i}", "response": "r{i}"}}\n' for i in range(8)))
    run = {"model": {"preset": "tiny-llama", "dtype": "float32"}, "tokenizer": {"type": "byte"},
           "scheduler": {"token_capacity": capacity},
           "jobs": [
               {"name": n, "dataset": {"path": str(data), "format": "prompt_response", "max_seq_len": 64},
                "lora": {"r": 4, "lora_alpha": 8}, "global_batch_size": 2, "max_steps": steps}
               for n in ("a", "b")],
           "output_dir": str(tmp / "out")}
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(run, sort_keys=False))
    return path


def _record(path: Path, overrides: list[str]) -> dict:
    return config_record(path, overrides, load_run_config(path, overrides))


def test_a_resume_keeps_the_starting_overrides_and_names_only_the_new_ones(tmp_path):
    path = _run(tmp_path)
    record = _record(path, ["jobs.a.eval_split=0.25", "seed=7"])
    cfg, changes = resume_config(path, [], record)
    assert cfg.jobs[0].eval_split == 0.25 and cfg.seed == 7 and changes == []
    cfg, changes = resume_config(path, ["jobs.a.max_steps=6"], record)
    assert cfg.jobs[0].max_steps == 6 and cfg.jobs[0].eval_split == 0.25 and cfg.seed == 7
    assert changes == ["jobs.a.max_steps: 4 -> 6"]


def test_edits_of_the_yaml_since_the_start_are_carried_and_named(tmp_path):
    path = _run(tmp_path)
    record = _record(path, ["jobs.b.optimizer.lr=0.5"])
    _run(tmp_path, steps=9, capacity=512)  # the YAML edited: every job's max_steps, the capacity
    raw = yaml.safe_load(path.read_text())
    raw["jobs"] = raw["jobs"][:1]  # and job b removed
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg, changes = resume_config(path, [], record)
    assert [j.name for j in cfg.jobs] == ["a"] and cfg.jobs[0].max_steps == 9
    assert cfg.scheduler.token_capacity == 512
    assert changes == ["jobs.b: removed", "jobs.a.max_steps: 4 -> 9", "scheduler.token_capacity: 256 -> 512"]


def test_a_bad_override_on_resume_is_one_error_naming_the_file(tmp_path):
    path = _run(tmp_path)
    with pytest.raises(ConfigError, match=r"run.yaml: override 'jobs.c.lr=1': no job 'c'"):
        resume_config(path, ["jobs.c.lr=1"], _record(path, []))
    with pytest.raises(ConfigError, match=r"jobs.0.max_steps"):
        resume_config(path, ["jobs.a.max_steps=0"], _record(path, []))

"""Shared helpers for config tests (tests/config/, test_hostile_paths.py): a run YAML, its job file and data
in a tmp dir."""

import copy
import json
from pathlib import Path

import yaml

DEL = object()

JOB = {
    "name": "rev",
    "dataset": {"path": "data/rev.jsonl", "format": "prompt_response", "max_seq_len": 64},
    "lora": {"r": 8, "lora_alpha": 16},
    "optimizer": {"lr": 1e-3},
    "global_batch_size": 4,
    "max_steps": 10,
}
RUN = {
    "model": {"preset": "tiny-llama", "dtype": "float32"},
    "tokenizer": {"type": "byte"},
    "parallelism": {"tp": 1, "pp": 1, "dp": 1},
    "scheduler": {"token_capacity": 1024},
    "jobs": ["jobs/rev.yaml"],
    "output_dir": "out",
}


def _set(d: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d[int(k)] if isinstance(d, list) else d.setdefault(k, {})
    if value is DEL:
        del d[keys[-1]]
    else:
        d[keys[-1]] = value


def make_tree(tmp: Path, run_edits=(), job_edits=(), run_text=None, job_text=None) -> Path:
    """tmp/run.yaml → tmp/jobs/rev.yaml → tmp/jobs/data/rev.jsonl; returns the run YAML path."""
    (tmp / "jobs" / "data").mkdir(parents=True, exist_ok=True)
    with open(tmp / "jobs" / "data" / "rev.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": f"reverse {w}=", "response": w[::-1]}) + "\n"
                     for w in ("abc", "hello", "xyz", "lorafusion", "kit"))
    run, job = copy.deepcopy(RUN), copy.deepcopy(JOB)
    for k, v in run_edits:
        _set(run, k, v)
    for k, v in job_edits:
        _set(job, k, v)
    (tmp / "jobs" / "rev.yaml").write_text(job_text if job_text is not None else yaml.safe_dump(job))
    (tmp / "run.yaml").write_text(run_text if run_text is not None else yaml.safe_dump(run))
    return tmp / "run.yaml"

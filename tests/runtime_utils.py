"""Helpers for runtime tests: tiny datasets and run YAMLs written to a temp dir."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import yaml


def load_file_module(path: Path, name: str):
    """The module in the file ``path`` (a script or a worker that is no package's), imported as ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_dataset(path: Path, seed: int, rows: int = 24, kind: str = "reverse") -> Path:
    rnd = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(rows):
            word = "".join(rnd.choice("abcdefghij") for _ in range(rnd.randint(3, 9)))
            resp = word[::-1] if kind == "reverse" else word.upper()
            f.write(json.dumps({"prompt": f"{kind} {word}:", "response": resp}) + "\n")
    return path


def job_dict(name: str, data: Path, r: int, *, steps: int = 4, gbs: int = 4, dropout: float = 0.0,
             lr: float = 1e-2, alpha: float | None = None, targets="all-linear", save_every=None) -> dict:
    return {
        "name": name,
        "dataset": {"path": str(data), "format": "prompt_response", "max_seq_len": 64},
        "lora": {"r": r, "lora_alpha": alpha or 2 * r, "lora_dropout": dropout, "target_modules": targets},
        # eps 1e-5: AdamW divides by sqrt(v)+eps, so with eps 1e-8 a gradient element that is ~0 has its
        # fp32 summation-order noise (packing differs between runs) scaled up to a full lr-sized update;
        # comparisons of whole runs would then measure that noise rather than the training
        "optimizer": {"lr": lr, "warmup_steps": 1, "schedule": "cosine", "max_grad_norm": 1.0,
                      "weight_decay": 0.01, "eps": 1e-5},
        "global_batch_size": gbs,
        "max_steps": steps,
        "save_every": save_every,
    }


def write_run(tmp: Path, jobs: list[dict], *, out: str = "out", tp=1, pp=1, dp=1, capacity=96,
              name="run.yaml",
              preset="tiny-llama", recompute=False, sequence_parallel=False, solver="greedy",
              policy="together",
              recompute_layers=None, stage_layers=None, base_precision=None, virtual_stages=1,
              model_path=None, tp_overlap=None) -> Path:
    """A run YAML of ``jobs``. Plans are greedy by default: they do not depend on the machine's load (a
    time-limited MILP can stop at different points in two runs on a busy CI machine), so two runs compared
    by a test get the same packing; the MILP in a real run is covered by tests/runtime/test_readme.py (`make
    demo` as shipped) and tests/scheduler. ``base_precision`` (e.g. "fp8") sets model.base_precision and
    model.dtype bfloat16."""
    run = {
        "model": {**({"path": str(model_path)} if model_path else {"preset": preset}),
                  "dtype": "bfloat16" if base_precision else "float32", "recompute": recompute,
                  **({"recompute_layers": recompute_layers} if recompute_layers else {}),
                  **({"base_precision": base_precision} if base_precision else {})},
        "tokenizer": {"type": "byte"},
        "parallelism": {"tp": tp, "pp": pp, "dp": dp,
                        **({"sequence_parallel": True} if sequence_parallel else {}),
                        **({"stage_layers": stage_layers} if stage_layers else {}),
                        **({"virtual_stages": virtual_stages} if virtual_stages != 1 else {}),
                        **({"tp_overlap": tp_overlap} if tp_overlap else {})},
        "scheduler": {"token_capacity": capacity, "milp_time_limit_s": 0.2, "solver": solver,
                      "policy": policy},
        "kernels": "reference",
        "jobs": jobs,
        "output_dir": str(tmp / out),
        "seed": 1234,
        "logging": {"tensorboard": False, "progress": False},
    }
    path = tmp / name
    path.write_text(yaml.safe_dump(run, sort_keys=False))
    return path


def train_inprocess(run_yaml: Path, overrides=(), **trainer_kw):
    """Train a run YAML in this process; (summary, output_dir)."""
    from lorafusion.config import load_run_config
    from lorafusion.runtime.trainer import Trainer

    cfg = load_run_config(run_yaml, list(overrides))
    return Trainer(cfg, **trainer_kw).run(), Path(cfg.output_dir)


def checkout_env() -> dict:
    """This process's environment with the checkout first on PYTHONPATH (for a child Python process)."""
    root = Path(__file__).resolve().parents[1]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))


def train_torchrun(run_yaml: Path, nproc: int, out: Path) -> Path:
    """Train a run YAML with ``lorafusion train`` under torchrun on ``nproc`` CPU processes; ``out``."""
    root = Path(__file__).resolve().parents[1]
    env = checkout_env()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
         "-m", "lorafusion.cli", "train", str(run_yaml)], cwd=root, env=env, capture_output=True, text=True,
        timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    return out


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda r: (r["job"], r["step"]))


def assert_trained_alike(ours: Path, ref: Path, jobs=("rev", "up", "rev2")) -> None:
    """Two runs' per-step losses (rel 1e-6), gradient norms (1e-5) and final adapters (1e-4) agree."""
    import pytest

    mine, theirs = _metrics(ours), _metrics(ref)
    assert [(r["job"], r["step"]) for r in mine] == [(r["job"], r["step"]) for r in theirs]
    for a, b in zip(mine, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
    for job in jobs:
        assert_close(load_adapter(ours, job), load_adapter(ref, job), rel=1e-4)


def load_adapter(out: Path, job: str) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "adapters" / job / "adapter_model.safetensors")


def assert_close(a: dict, b: dict, rel: float = 1e-5) -> None:
    """Relative error ||a - b|| / ||b|| per tensor (AdamW turns fp32 summation-order noise in near-zero
    gradients into single elements that differ more; the tensor-wise error is what training sees)."""
    assert a.keys() == b.keys()
    for k in a:
        err = (a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12)
        assert err <= rel, (k, float(err))


def three_job_dicts(tmp: Path) -> list[dict]:
    """Three jobs with different ranks, batch sizes, dropout and targets (the runtime tests' workload)."""
    return [
        job_dict("rev", write_dataset(tmp / "d" / "rev.jsonl", 1), r=4, dropout=0.1),
        job_dict("up", write_dataset(tmp / "d" / "up.jsonl", 2, kind="upper"), r=8, gbs=3,
                 targets=["q_proj", "k_proj", "v_proj", "o_proj"]),
        job_dict("rev2", write_dataset(tmp / "d" / "rev2.jsonl", 3, rows=17), r=16, gbs=5, dropout=0.2,
                 targets=["gate_proj", "up_proj", "down_proj"]),
    ]

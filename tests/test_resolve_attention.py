"""model.attention in the run plan (torch-free): the memory model counts the path the runtime selected, or
without one what this machine would run; an unknown choice is refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafusion import resolve as rs
from lorafusion.config import load_run_config
from lorafusion.core.errors import ConfigError
from lorafusion.resolve import GpuMemory, World, attention_guess, resolve
from lorafusion.scheduler.memory import GIB

C8 = Path(__file__).resolve().parents[1] / "configs/llama3.1-8b-4adapters.yaml"
GPU = GpuMemory(76 * GIB, 80 * GIB)


def _cfg(*overrides):
    return load_run_config(C8, list(overrides), check_files=False)


def test_the_runtimes_selection_is_what_the_plan_counts():
    cfg = _cfg()
    fa4, fa2 = resolve(cfg, World(1), GPU, attention="fa4"), resolve(cfg, World(1), GPU, attention="varlen")
    assert (fa4.attention, fa4.setup.attention, fa2.attention) == ("fa4", "fa4", "varlen")
    assert "attention" in fa4.auto and "attention fa4 (auto)" in "\n".join(fa4.lines())
    # fa4 keeps grouped k and v: less per token than torch's op with k, v expanded, so at least as much fits
    per_token = [p.memory.stages[0].per_microbatch / p.token_capacity for p in (fa4, fa2)]
    assert per_token[0] < per_token[1] and fa4.token_capacity >= fa2.token_capacity


def test_without_the_runtime_the_plan_guesses_from_what_is_installed(monkeypatch):
    monkeypatch.setattr(rs, "_installed", lambda dist: False)
    assert attention_guess(_cfg()) == "varlen" and attention_guess(_cfg(), gpu=False) == "per-sample"
    assert resolve(_cfg(), World(1), GPU).attention == "varlen"
    assert resolve(_cfg(), World(1), None).attention == "per-sample"
    assert attention_guess(_cfg("model.attention=fa4")) == "fa4"  # chosen: counted even where not installed
    assert attention_guess(_cfg("model.attention=per-sample")) == "per-sample"
    assert attention_guess(_cfg("model.dtype=float32")) == "per-sample"  # the varlen kernels take 16 bits
    monkeypatch.setattr(rs, "_installed", lambda dist: dist == "flash-attn-4")
    assert attention_guess(_cfg()) == "fa4" and attention_guess(_cfg("model.attention=fa2")) == "varlen"


def test_an_unknown_choice_names_the_field():
    with pytest.raises(ConfigError, match="model.attention"):
        _cfg("model.attention=fa3")

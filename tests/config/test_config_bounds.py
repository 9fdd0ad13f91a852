"""Every number a run trains with is bounded where it enters (YAML, override, submit, request file): a value
the arithmetic downstream cannot hold (an lr over fp32's range, 10**400 steps, a rank of 10**400) is one
ConfigError naming the field — it was accepted, and killed the run that admitted it (and every resume after).
Nested YAML is one error too, not a RecursionError. CPU, no training."""

import pytest

from lorafusion.config import ConfigError, load_job_config, load_run_config
from lorafusion.config.load import job_config_from
from config_utils import JOB, make_tree

HUGE = "1" + "0" * 400


@pytest.mark.parametrize("override, field", [
    ("optimizer.lr=1e300", "optimizer.lr"), ("optimizer.lr=1e39", "optimizer.lr"),
    ("optimizer.lr=11", "optimizer.lr"),
    (f"max_steps={HUGE}", "max_steps"), (f"lora.r={HUGE}", "lora.r"), ("lora.r=100000", "lora.r"),
    ("lora.lora_alpha=1e300", "lora.lora_alpha"), ("global_batch_size=2000000", "global_batch_size"),
    ("optimizer.eps=1e300", "optimizer.eps"), ("optimizer.weight_decay=1e300", "optimizer.weight_decay"),
    ("optimizer.max_grad_norm=1e300", "optimizer.max_grad_norm"), (f"optimizer.warmup_steps={HUGE}",
                                                                   "optimizer.warmup_steps"),
    (f"num_epochs={HUGE}", "num_epochs"), (f"save_every={HUGE}", "save_every"),
    (f"priority={HUGE}", "priority"),
    (f"priority=-{HUGE}", "priority"), ("dataset.max_seq_len=100000000", "dataset.max_seq_len"),
    ("max_nonfinite_steps=10000000", "max_nonfinite_steps"),
    # each bound alone holds, their product (the job's tokens, counted in int64) does not
    ("max_steps=1000000000", "max_steps"),
])
def test_a_value_out_of_bounds_is_one_line_naming_the_field(tmp_path, monkeypatch, override, field):
    monkeypatch.chdir(tmp_path)
    make_tree(tmp_path)
    extra = ["global_batch_size=1000000",
             "dataset.max_seq_len=10000000"] if override == "max_steps=1000000000" else []
    with pytest.raises(ConfigError) as e:
        load_job_config(tmp_path / "jobs" / "rev.yaml", [override, *extra])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"jobs/rev.yaml: {field}: "), msg
    assert len(msg) < 400, msg  # (the override's 400 digits are not repeated whole)


@pytest.mark.parametrize("section, key, value", [
    ("scheduler", "milp_time_limit_s", 1e300), ("scheduler", "lookahead_batches", 10**12),
    ("parallelism", "tp", 10**400), ("parallelism", "dp", 10**400), ("checkpoint", "every_minutes", 1e300),
    ("checkpoint", "keep_last", 10**400), ("logging", "log_every", 10**400),
    ("logging", "log_every_s", 1e300),
])
def test_run_fields_are_bounded(tmp_path, monkeypatch, section, key, value):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_run_config(make_tree(tmp_path, run_edits=[(f"{section}.{key}", value)]))
    assert "\n" not in str(e.value) and f"{section}.{key}: expected" in str(e.value), str(e.value)


def test_the_largest_allowed_values_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_tree(tmp_path)
    job = load_job_config(tmp_path / "jobs" / "rev.yaml",
                          ["optimizer.lr=10", "lora.r=65536", "max_steps=1000000000",
                                                          "priority=-1000000000"])
    assert job.optimizer.lr == 10 and job.lora.r == 65536 and job.max_steps == 10**9


def test_a_request_files_job_is_bounded_too():
    """A job handed over as a request file (JSON: 1e400 reads as inf, an integer of 400 digits as itself)."""
    for edit, field in (({"optimizer": {"lr": 1e300}}, "optimizer.lr"),
                        ({"lora": {"r": 10**400, "lora_alpha": 8}}, "lora.r"),
                        ({"max_steps": 10**400}, "max_steps")):
        with pytest.raises(ConfigError) as e:
            job_config_from({**JOB, **edit}, "request x.json: job")
        assert str(e.value).startswith(f"request x.json: job: {field}: expected"), str(e.value)


@pytest.mark.parametrize("text", [
    "a: " + "[" * 800 + "]" * 800 + "\n",
    "".join("  " * i + "k:\n" for i in range(800)) + "  " * 800 + "x: 1\n",
    "a: " + "{b: " * 500 + "1" + "}" * 500 + "\n",
])
def test_yaml_nested_too_deep_is_one_error(tmp_path, monkeypatch, text):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "deep.yaml").write_text(text)
    with pytest.raises(ConfigError) as e:
        load_run_config(tmp_path / "deep.yaml")
    assert str(e.value) == ("deep.yaml: invalid YAML: nested more than 64 levels deep; "
                            "expected a config"), str(e.value)


def test_an_override_nested_too_deep_is_one_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_run_config(make_tree(tmp_path), ["seed=" + "[" * 900 + "]" * 900])
    msg = str(e.value)
    assert "\n" not in msg and "value is not valid YAML (nested more than 64 levels deep" in msg \
        and len(msg) < 300, msg

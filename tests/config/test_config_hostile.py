"""Hostile config input: each case is one ConfigError, in well under a second, naming the file and
the field — alias bombs, names that no file system takes, paths that cannot be used, numbers out of range."""

import time

import pytest
import yaml

from lorafusion.config import ConfigError, load_job_config, load_run_config
from lorafusion.core.lora import ADAPTER_NAME_MAX
from config_utils import make_tree


def _error(run, overrides=()) -> str:
    with pytest.raises(ConfigError) as ei:
        load_run_config(run, overrides)
    assert "\n" not in str(ei.value), str(ei.value)
    return str(ei.value)


def test_nested_alias_bomb_is_refused_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\nmodel: {preset: tiny-llama}\njobs: [*a9]\n"
                                        "output_dir: o\n")
    t = time.perf_counter()
    msg = _error(tmp_path / "bomb.yaml")
    assert time.perf_counter() - t < 0.5
    assert msg.startswith("bomb.yaml: invalid YAML: the document expands to more than"), msg


def test_a_few_aliases_still_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = make_tree(tmp_path)
    text = run.read_text().replace("seed", "#") + "logging: &l {progress: false}\n"
    run.write_text(text)
    assert load_run_config(run).logging.progress is False


@pytest.mark.parametrize("name, needle", [
    ("rev\n", "expected letters, digits, '_' or '-', got 'rev\\n'"),
    ("x" * (ADAPTER_NAME_MAX + 1), f"expected at most {ADAPTER_NAME_MAX} characters"),
])
def test_job_names_every_file_system_takes(tmp_path, monkeypatch, name, needle):
    monkeypatch.chdir(tmp_path)
    run = make_tree(tmp_path, job_edits=[("name", name)])
    assert _error(run).startswith(f"jobs/rev.yaml: name: {needle}")
    with pytest.raises(ConfigError, match="name: expected"):
        load_job_config(tmp_path / "jobs" / "rev.yaml")


def test_longest_name_fits_every_derived_file_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = "n" * ADAPTER_NAME_MAX
    assert load_run_config(make_tree(tmp_path, job_edits=[("name", name)])).jobs[0].name == name
    # the longest derived name: a submit request's temporary file
    (tmp_path / f".{'0' * 20}-submit-{name}.json.tmp").write_text("")


def test_empty_output_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = make_tree(tmp_path, run_edits=[("output_dir", "")])
    assert _error(run).startswith("run.yaml: output_dir: expected a directory path")
    assert "set by override 'output_dir='" in _error(make_tree(tmp_path), ["output_dir="])


def test_seed_beyond_64_bits(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _error(make_tree(tmp_path, run_edits=[("seed", 2**70)])).startswith(
        "run.yaml: seed: expected an integer <= 9223372036854775807, got 1180591620717411303424")


def test_float_fields_do_not_ask_for_integers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = _error(make_tree(tmp_path, job_edits=[("optimizer.lr", 0)]))
    assert msg.startswith("jobs/rev.yaml: optimizer.lr: expected a number > 0"), msg


@pytest.mark.parametrize("where", ["yaml", "override"])
@pytest.mark.parametrize("key", ["output_dir", "dataset.path"])
@pytest.mark.parametrize("bad, needle", [("~nosuchuser_lf/x.jsonl", "cannot expand '~nosuchuser_lf'"),
                                         ("LOOP/x.jsonl", "too many levels of symbolic links")])
def test_unusable_paths(tmp_path, monkeypatch, where, key, bad, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "la").symlink_to("lb")
    (tmp_path / "lb").symlink_to("la")
    bad = bad.replace("LOOP", str(tmp_path / "la"))
    if where == "override":
        msg = _error(make_tree(tmp_path), [f"{'' if key == 'output_dir' else 'jobs.0.'}{key}={bad}"])
        start = "run.yaml: override"
    elif key == "output_dir":
        msg, start = _error(make_tree(tmp_path, run_edits=[("output_dir", bad)])), "run.yaml: output_dir: "
    else:
        msg, start = (_error(make_tree(tmp_path, job_edits=[("dataset.path", bad)])),
                      "jobs/rev.yaml: dataset.path: ")
    assert msg.startswith(start) and needle in msg, msg


def test_a_job_file_that_is_a_symlink_loop(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = make_tree(tmp_path, run_edits=[("jobs", ["jobs/loop.yaml"])])
    (tmp_path / "jobs" / "loop.yaml").symlink_to("loop.yaml")
    assert _error(run).startswith("run.yaml: jobs.0: jobs/loop.yaml: too many levels of symbolic links")
    assert yaml  # (imported for make_tree's users)


def test_a_key_given_twice_in_overrides_is_refused_naming_it(tmp_path, monkeypatch):
    """``seed=1 seed=2``: the last won silently; the same key by index and by name, or a key inside
    a mapping also set whole, is the same key."""
    monkeypatch.chdir(tmp_path)
    run = make_tree(tmp_path)
    for overrides, words in (
        (["seed=1", "seed=2"], "override 'seed=2': seed is already set by override 'seed=1'"),
        (["jobs.0.lora.r=4", "jobs.rev.lora.r=8"], "jobs.0.lora.r is already set"),
        (["jobs.0.optimizer={lr: 0.1}", "jobs.0.optimizer.lr=0.2"],
         "jobs.0.optimizer.lr is already set by override 'jobs.0.optimizer={lr: 0.1}'")):
        msg = _error(run, overrides)
        assert msg.startswith("run.yaml: ") and words in msg and "give each key once" in msg, msg
    assert load_run_config(run, ["seed=1", "jobs.0.lora.r=4", "jobs.rev.lora.lora_alpha=8"]).seed == 1
    with pytest.raises(ConfigError, match="optimizer.lr is already set by override 'optimizer.lr=1'"):
        load_job_config(tmp_path / "jobs" / "rev.yaml", ["optimizer.lr=1", "optimizer.lr=2"])


def test_warmup_longer_than_the_job_is_refused(tmp_path, monkeypatch):
    """warmup_steps > max_steps: the lr never reached its value, silently (HF and torchtune accept it too)."""
    monkeypatch.chdir(tmp_path)
    run = make_tree(tmp_path)
    msg = _error(run, ["jobs.0.optimizer.warmup_steps=11"])
    assert "jobs/rev.yaml: optimizer.warmup_steps: expected at most max_steps (10), got 11" in msg, msg
    assert load_run_config(run, ["jobs.0.optimizer.warmup_steps=10"]).jobs[0].optimizer.warmup_steps == 10
    # num_epochs: the job's steps are known once its data is read (5 samples / batch 4 = 1 step an epoch)
    from lorafusion.runtime.jobs import load_jobs

    cfg = load_run_config(run,
                          ["jobs.0.max_steps=null", "jobs.0.num_epochs=2", "jobs.0.optimizer.warmup_steps=3"])
    with pytest.raises(ConfigError,
                       match="job 'rev': optimizer.warmup_steps: expected at most the job's 2 steps"):
        load_jobs(cfg)


def test_a_huge_token_capacity_names_token_capacity(tmp_path, monkeypatch):
    """scheduler.token_capacity=10**23 was refused as 'lora.r = 8: its adapter needs about 8e16 GiB'."""
    monkeypatch.chdir(tmp_path)
    run = make_tree(tmp_path)
    msg = _error(run, ["scheduler.token_capacity=99999999999999999999999"])
    assert "scheduler.token_capacity: expected at most 16,777,216 tokens a microbatch or 'auto'" in msg, msg
    assert load_run_config(run, [f"scheduler.token_capacity={1 << 24}"]).scheduler.token_capacity == 1 << 24


def test_a_run_yaml_given_as_a_job_yaml_is_one_line(tmp_path, monkeypatch):
    """submit RUN run.yaml listed every run key as unknown, one line each (13 lines)."""
    monkeypatch.chdir(tmp_path)
    run = make_tree(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_job_config(run)
    assert str(e.value) == ("run.yaml: is a run config (it lists jobs); "
                            "expected one adapter job's YAML (name, ...)")


def test_an_output_dir_name_over_255_bytes_names_output_dir(tmp_path, monkeypatch):
    """output_dir=/tmp/ooo...(300) was 'cannot access ...: File name too long' from a stat in train, no
    field."""
    monkeypatch.chdir(tmp_path)
    run = make_tree(tmp_path)
    msg = _error(run, [f"output_dir={tmp_path / ('o' * 300)}"])
    assert "run.yaml: output_dir: a name in it is 300 bytes, over the file system's 255" in msg, msg

"""Run/job YAML config: every malformed input is ONE ConfigError naming file, field and expectation;
overrides; relative paths; the quickstart config."""

import copy
import os
import time
from pathlib import Path

import pytest
import yaml

from lorafusion.config import ConfigError, JobConfig, RunConfig, load_job_config, load_run_config
from lorafusion.core.lora import LoRASpec
from lorafusion.core.targets import MEGATRON_TARGETS
from config_utils import DEL, JOB, RUN, make_tree

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _error(run: Path, overrides=()) -> str:
    with pytest.raises(ConfigError) as ei:
        load_run_config(run, overrides)
    assert type(ei.value) is ConfigError or issubclass(type(ei.value), ConfigError)
    return str(ei.value)


# (id, run edits, job edits, raw run text, raw job text, overrides, expected substrings)
BAD = [
    ("unknown-top-key", [("seeed", 3)], [], None, None, [], ["run.yaml: unknown key 'seeed'", "seed"]),
    ("unknown-model-key", [("model.bar", 1)], [], None, None, [], ["run.yaml: model: unknown key 'bar'"]),
    ("unknown-job-key", [], [("epochs", 2)], None, None, [], ["jobs/rev.yaml: unknown key 'epochs'"]),
    ("unknown-lora-key", [], [("lora.rank", 8)], None, None, [],
     ["jobs/rev.yaml: lora: unknown key 'rank'", "lora_alpha"]),
    ("unknown-dataset-key", [], [("dataset.fields", {})], None, None, [],
     ["jobs/rev.yaml: dataset: unknown key 'fields'"]),
    ("wrong-type-seed", [("seed", "x")], [], None, None, [],
     ["run.yaml: seed: expected an integer, got 'x'"]),
    ("wrong-type-gbs", [], [("global_batch_size", "8")], None, None, [],
     ["jobs/rev.yaml: global_batch_size: expected an integer, got '8'"]),
    ("wrong-type-bool", [("logging", {"progress": "yes please"})], [], None, None, [],
     ["run.yaml: logging.progress: expected true or false"]),
    ("wrong-type-lr", [], [("optimizer.lr", [1])], None, None, [],
     ["jobs/rev.yaml: optimizer.lr: expected a number"]),
    ("r-zero", [], [("lora.r", 0)], None, None, [],
     ["jobs/rev.yaml: lora.r: expected an integer > 0, got 0"]),
    ("alpha-negative", [], [("lora.lora_alpha", -1)], None, None, [],
     ["jobs/rev.yaml: lora.lora_alpha: expected"]),
    ("dropout-one", [], [("lora.lora_dropout", 1.0)], None, None, [],
     ["jobs/rev.yaml: lora.lora_dropout: expected a number < 1", "got 1.0"]),
    ("peft-subset-shared-a", [],
     [("lora.target_modules", ["q_proj", "v_proj"]), ("lora.shared_fused_a", True)],
     None, None, [], ["jobs/rev.yaml: lora.target_modules: q_proj, v_proj is part of the fused linear_qkv"]),
    ("unknown-target", [], [("lora.target_modules", "mlp")], None, None, [],
     ["jobs/rev.yaml: lora.target_modules: unknown module 'mlp'"]),
    ("no-stop-rule", [], [("max_steps", DEL)], None, None, [],
     ["jobs/rev.yaml: max_steps: expected max_steps or num_epochs"]),
    ("gbs-zero", [], [("global_batch_size", 0)], None, None, [],
     ["jobs/rev.yaml: global_batch_size: expected an integer >= 1"]),
    ("bad-name", [], [("name", "my job")], None, None, [], ["jobs/rev.yaml: name: expected letters, digits"]),
    ("missing-field", [], [("lora.r", DEL)], None, None, [],
     ["jobs/rev.yaml: lora.r: required field is missing"]),
    ("bad-format", [], [("dataset.format", "alpaca")], None, None, [],
     ["jobs/rev.yaml: dataset.format: expected one of 'prompt_response', 'chat' or 'text'"]),
    ("betas-len", [], [("optimizer.betas", [0.9])], None, None, [],
     ["jobs/rev.yaml: optimizer.betas: expected a list of two"]),
    ("tp-zero", [("parallelism.tp", 0)], [], None, None, [],
     ["run.yaml: parallelism.tp: expected an integer >= 1, got 0"]),
    ("pp-neg", [("parallelism.pp", -2)], [], None, None, [],
     ["run.yaml: parallelism.pp: expected an integer >= 1"]),
    ("dp-zero", [("parallelism.dp", 0)], [], None, None, [], ["run.yaml: parallelism.dp:"]),
    ("dp-word", [("parallelism.dp", "all")], [], None, None, [],
     ["run.yaml: parallelism.dp: expected an integer >= 1 or 'auto', got 'all'"]),
    ("sp-without-tp", [("parallelism.sequence_parallel", True)], [], None, None, [],
     ["run.yaml: parallelism.sequence_parallel: true needs tp > 1"]),
    ("overlap-without-tp", [("parallelism.tp_overlap", "on")], [], None, None, [],
     ["run.yaml: parallelism.tp_overlap: on needs tp > 1"]),
    ("overlap-word", [("parallelism.tp", 2), ("parallelism.tp_overlap", "always")], [], None, None, [],
     ["run.yaml: parallelism.tp_overlap: expected one of 'auto', 'on' or 'off'"]),
    ("overlap-chunks", [("parallelism.tp", 2), ("parallelism.tp_overlap_chunks", 1)], [], None, None, [],
     ["run.yaml: parallelism.tp_overlap_chunks: expected an integer >= 2"]),
    ("capacity", [("scheduler.token_capacity", "lots")], [], None, None, [],
     ["run.yaml: scheduler.token_capacity: expected a positive integer or 'auto'"]),
    ("seq-over-capacity", [("scheduler.token_capacity", 32)], [], None, None, [],
     ["jobs/rev.yaml: dataset.max_seq_len: expected at most scheduler.token_capacity (32)", "got 64"]),
    ("kernels", [("kernels", "triton")], [], None, None, [], ["run.yaml: kernels: expected one of 'auto'"]),
    ("preset-and-path", [("model.path", "x")], [], None, None, [],
     ["run.yaml: model: expected exactly one of"]),
    ("stage-layers-count", [("parallelism.pp", 2), ("parallelism.stage_layers", [1, 2, 1])], [], None, None,
     [], ["run.yaml: parallelism.stage_layers: expected one count per pipeline stage (pp = 2)"]),
    ("stage-layers-virtual", [("parallelism.pp", 2), ("parallelism.virtual_stages", 2),
                              ("parallelism.stage_layers", [1, 2, 1])], [], None, None, [],
     ["run.yaml: parallelism.stage_layers: expected one count per virtual stage (pp x virtual_stages = 4"]),
    ("virtual-stages-no-pp", [("parallelism.virtual_stages", 2)], [], None, None, [],
     ["run.yaml: parallelism.virtual_stages: 2 needs a pipeline (pp > 1)"]),
    ("recompute-layers-alone", [("model.recompute_layers", 2)], [], None, None, [],
     ["run.yaml: model.recompute_layers: 2 needs recompute: true"]),
    ("recompute-layers-zero", [("model.recompute", True), ("model.recompute_layers", 0)], [], None, None, [],
     ["run.yaml: model.recompute_layers: expected an integer >= 1"]),
    ("unknown-preset", [("model.preset", "gpt-5")], [], None, None, [],
     ["run.yaml: model.preset: expected one of", "gpt-5"]),
    ("no-jobs", [("jobs", [])], [], None, None, [], ["run.yaml: jobs: expected at least 1"]),
    ("missing-job-file", [("jobs", ["jobs/nope.yaml"])], [], None, None, [],
     ["run.yaml: jobs.0: file not found", "nope.yaml"]),
    ("missing-dataset", [], [("dataset.path", "data/nope.jsonl")], None, None, [],
     ["jobs/rev.yaml: dataset.path: dataset file not found", "nope.jsonl"]),
    ("dataset-ext", [], [("dataset.path", "data/rev.txt")], None, None, [],
     ["jobs/rev.yaml: dataset.path: cannot tell the file type", "dataset.file_type"]),
    ("missing-model-dir", [("model", {"path": "nowhere"})], [], None, None, [],
     ["run.yaml: model.path: expected a HF model directory, not found"]),
    ("hf-tokenizer-no-path", [("tokenizer.type", "hf")], [], None, None, [],
     ["run.yaml: tokenizer.path: expected a HF"]),
    ("sp-tokenizer-missing", [("tokenizer", {"type": "sentencepiece", "path": "sp.model"})], [], None, None,
     [], ["run.yaml: tokenizer.path: expected a sentencepiece model file", "sp.model"]),
    ("duplicate-names", [("jobs", ["jobs/rev.yaml", "jobs/rev.yaml"])], [], None, None, [],
     ["run.yaml: jobs: duplicate job name 'rev'"]),
    ("duplicate-inline",
     [("jobs", ["jobs/rev.yaml", dict(JOB, dataset=dict(JOB["dataset"], path="jobs/data/rev.jsonl"))])],
     [], None, None, [], ["duplicate job name 'rev'", "jobs.0 in jobs/rev.yaml", "jobs.1 in run.yaml"]),
    ("yaml-syntax-run", [], [], "model: {preset: tiny-llama\nseed: [1,\n", None, [],
     ["run.yaml: line 2", "invalid YAML"]),
    ("yaml-syntax-job", [], [], None, "name: rev\nlora:\n  r: 8\n   lora_alpha: 16\n", [],
     ["jobs/rev.yaml: line 4", "invalid YAML"]),
    ("yaml-duplicate-key", [], [], None, "name: rev\nname: rev2\n", [],
     ["jobs/rev.yaml: line 2", "duplicate key 'name'"]),
    ("yaml-not-mapping", [], [], "- model\n", None, [], ["run.yaml: expected a mapping"]),
    ("yaml-empty-job", [], [], None, "", [], ["jobs/rev.yaml: expected a mapping", "empty file"]),
    ("override-unknown", [], [], None, None, ["scheduler.token_capacty=8"],
     ["run.yaml: override 'scheduler.token_capacty=8': unknown key scheduler.token_capacty"]),
    ("override-unknown-job-key", [], [], None, None, ["jobs.0.lora.rank=4"],
     ["unknown key jobs.0.lora.rank"]),
    ("override-bad-job", [], [], None, None, ["jobs.3.lora.r=4"], ["job index 3 out of range"]),
    ("override-no-equals", [], [], None, None, ["seed"], ["override 'seed': expected key=value"]),
    ("override-bad-value", [], [], None, None, ["jobs.rev.lora.r=0"],
     ["jobs/rev.yaml: lora.r: expected an integer > 0, got 0 (set by override 'jobs.rev.lora.r=0')"]),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_malformed_config_is_one_clear_error(in_tmp, case):
    _, run_edits, job_edits, run_text, job_text, overrides, expected = case
    run = make_tree(in_tmp, run_edits, job_edits, run_text, job_text)
    msg = _error(Path("run.yaml"), overrides)
    for s in expected:
        assert s in msg, f"{s!r} not in:\n{msg}"
    assert "Traceback" not in msg and "pydantic" not in msg.lower()
    assert run.exists()


def test_several_errors_are_one_exception_one_line_each(in_tmp):
    make_tree(in_tmp, job_edits=[("lora.r", 0), ("optimizer.lr", -1)])
    msg = _error(Path("run.yaml"))
    lines = msg.splitlines()
    assert len(lines) == 2 and all(ln.startswith("jobs/rev.yaml: ") for ln in lines), msg


def test_valid_tree_loads_with_absolute_paths(in_tmp):
    make_tree(in_tmp)
    cfg = load_run_config("run.yaml")
    job = cfg.jobs[0]
    assert os.path.isabs(job.dataset.path)
    assert Path(job.dataset.path) == (in_tmp / "jobs" / "data" / "rev.jsonl").resolve()
    assert job.dataset.builder == "json"
    assert cfg.scheduler.token_capacity == 1024 and cfg.kernels == "auto" and cfg.seed == 1234
    assert job.optimizer.betas == (0.9, 0.999) and job.lora.target_modules == MEGATRON_TARGETS


def test_relative_paths_resolve_against_containing_file_not_cwd(in_tmp, tmp_path_factory, monkeypatch):
    make_tree(in_tmp)
    # inline job in the run YAML: its dataset path is relative to the run YAML's directory
    run = copy.deepcopy(RUN)
    run["jobs"] = ["jobs/rev.yaml",
                   dict(JOB, name="inline", dataset=dict(JOB["dataset"], path="jobs/data/rev.jsonl"))]
    (in_tmp / "run.yaml").write_text(yaml.safe_dump(run))
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    monkeypatch.chdir(elsewhere)
    cfg = load_run_config(in_tmp / "run.yaml")
    want = (in_tmp / "jobs" / "data" / "rev.jsonl").resolve()
    assert [Path(j.dataset.path) for j in cfg.jobs] == [want, want]


def test_overrides(in_tmp):
    make_tree(in_tmp)
    cfg = load_run_config("run.yaml", ["seed=3", "jobs.0.optimizer.lr=1e-4",
                                       "jobs.rev.lora.target_modules=[q_proj, k_proj, v_proj]",
                                       "logging.log_every=5", "scheduler.token_capacity=auto",
                                       "jobs.0.num_epochs=2", "jobs.0.optimizer.betas=[0.8, 0.95]"])
    assert cfg.scheduler.token_capacity == "auto" and cfg.seed == 3 and cfg.logging.log_every == 5
    job = cfg.jobs[0]
    assert job.optimizer.lr == 1e-4 and job.num_epochs == 2 and job.optimizer.betas == (0.8, 0.95)
    assert job.lora.target_modules == ("linear_qkv",)
    # an override path is relative to the current directory
    (in_tmp / "other.jsonl").write_text((in_tmp / "jobs/data/rev.jsonl").read_text())
    cfg = load_run_config("run.yaml", ["jobs.0.dataset.path=other.jsonl"])
    assert Path(cfg.jobs[0].dataset.path) == (in_tmp / "other.jsonl").resolve()


def test_inline_job_errors_name_the_run_file(in_tmp):
    make_tree(in_tmp)
    run = copy.deepcopy(RUN)
    run["jobs"] = [
        dict(JOB, lora={"r": -1, "lora_alpha": 8}, dataset=dict(JOB["dataset"], path="jobs/data/rev.jsonl"))]
    (in_tmp / "run.yaml").write_text(yaml.safe_dump(run))
    assert "run.yaml: jobs.0.lora.r: expected an integer > 0, got -1" in _error(Path("run.yaml"))


def test_missing_run_file_names_it(in_tmp):
    assert "nope.yaml: file not found" in _error(Path("nope.yaml"))


def test_lora_section_is_the_lora_spec_and_world_size(in_tmp, monkeypatch):
    make_tree(in_tmp, job_edits=[("lora", {"r": 16, "lora_alpha": 32, "use_rslora": True,
                                           "target_modules": ["gate_proj", "up_proj", "down_proj"]})])
    cfg = load_run_config("run.yaml", ["parallelism.dp=2"])
    spec = cfg.jobs[0].lora
    assert type(spec) is LoRASpec  # the one LoRA schema: the config validates through it
    assert spec.r == 16 and spec.target_modules == ("linear_fc1", "linear_fc2")
    assert abs(spec.scaling - 32 / 4) < 1e-12
    cfg.check_world_size(2)
    with pytest.raises(ConfigError,
                       match=r"^run.yaml: parallelism: tp\*pp\*dp = 1\*1\*2 = 2, but the launch has 4 "):
        cfg.check_world_size(4)
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun / Slurm say how many processes were launched
    cfg.check_world_size()
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError, match="the launch has 1 process"):
        cfg.check_world_size()


def test_load_job_config_alone(in_tmp):
    make_tree(in_tmp)
    job = load_job_config("jobs/rev.yaml")
    assert isinstance(job, JobConfig) and Path(job.dataset.path).is_absolute()
    (in_tmp / "bad.yaml").write_text("name: x\n")
    with pytest.raises(ConfigError, match="bad.yaml: dataset: required field is missing"):
        load_job_config("bad.yaml")


def test_programmatic_models_validate_too():
    with pytest.raises(Exception, match="duplicate job name"):
        RunConfig.model_validate({"model": {"preset": "tiny-llama"}, "output_dir": "o",
                                  "jobs": [dict(JOB), dict(JOB)]})


def test_quickstart_config_loads():
    cfg = load_run_config(ROOT / "configs" / "quickstart.yaml")
    assert [j.name for j in cfg.jobs] and len(cfg.jobs) == 3
    assert sorted(j.lora.r for j in cfg.jobs) == [8, 16, 32]
    assert cfg.model.preset == "tiny-llama" and cfg.model.dtype == "float32" and cfg.tokenizer.type == "byte"
    assert (cfg.parallelism.tp, cfg.parallelism.pp, cfg.parallelism.dp) == (1, 1, 1)
    assert cfg.kernels == "auto" and Path(cfg.output_dir) == ROOT / "outputs" / "quickstart" / "run"
    assert cfg.scheduler.token_capacity == 1024
    assert {j.dataset.format for j in cfg.jobs} >= {"prompt_response", "chat"}
    for j in cfg.jobs:
        assert Path(j.dataset.path).is_file()
        assert isinstance(j.lora, LoRASpec)


def test_import_is_light():
    import subprocess
    import sys

    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", ("import sys, lorafusion.config; "
                          "print('torch' in sys.modules, 'megatron' in sys.modules)")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    assert time.time() - t0 < 10


def test_yaml_exponent_floats_are_numbers(in_tmp):
    # PyYAML (YAML 1.1) would read `lr: 1e-4` as a string; the config loader reads it as YAML 1.2 does
    text = yaml.safe_dump(JOB).replace("lr: 0.001", "lr: 1e-4")
    assert "lr: 1e-4" in text
    make_tree(in_tmp, job_text=text)
    assert load_run_config("run.yaml").jobs[0].optimizer.lr == 1e-4


@pytest.mark.parametrize("field, text", [
    ("optimizer.lr", ".inf"), ("lora.lora_alpha", ".inf"), ("lora.lora_dropout", ".nan"),
    ("optimizer.weight_decay", ".nan"), ("optimizer.eps", ".inf"), ("optimizer.max_grad_norm", ".inf"),
    ("optimizer.min_lr_ratio", ".nan"), ("optimizer.betas", "[.nan, 0.9]"),
])
def test_non_finite_floats_are_rejected_in_job_fields(in_tmp, field, text):
    make_tree(in_tmp)
    section, key = field.split(".")
    msg = _error(Path("run.yaml"), [f"jobs.0.{field}={text}"])
    assert f"{section}." in msg and key.split("_")[0] in msg and "finite" in msg, msg


@pytest.mark.parametrize("field", ["scheduler.milp_time_limit_s", "checkpoint.every_minutes"])
def test_non_finite_floats_are_rejected_in_run_fields(in_tmp, field):
    make_tree(in_tmp)
    msg = _error(Path("run.yaml"), [f"{field}=.inf"])
    assert field in msg and "finite" in msg, msg


def test_model_path_without_tokenizer_uses_its_tokenizer_or_one_clear_error(in_tmp):
    """Never byte ids on a real model's vocabulary: the directory's tokenizer files, else an error naming
    it."""
    run = make_tree(in_tmp, run_edits=[("model", {"path": "hf", "dtype": "float32"}), ("tokenizer", DEL)])
    (in_tmp / "hf").mkdir()
    (in_tmp / "hf" / "config.json").write_text("{}")
    msg = _error(run)
    assert "run.yaml: tokenizer: model.path" in msg and "has no tokenizer files" in msg, msg
    (in_tmp / "hf" / "tokenizer.json").write_text("{}")
    cfg = load_run_config(run)
    assert cfg.tokenizer.type == "hf" and cfg.tokenizer.path is None
    (in_tmp / "hf" / "tokenizer.json").unlink()
    (in_tmp / "hf" / "tokenizer.model").write_bytes(b"")
    cfg = load_run_config(run)
    assert cfg.tokenizer.type == "sentencepiece" and Path(cfg.tokenizer.path) == (
        in_tmp / "hf" / "tokenizer.model").resolve()


def test_relative_output_dir_resolves_against_the_yaml_and_overrides_against_the_cwd(in_tmp, tmp_path_factory,
                                                                                        monkeypatch):
    make_tree(in_tmp)
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    monkeypatch.chdir(elsewhere)
    assert Path(load_run_config(in_tmp / "run.yaml").output_dir) == (in_tmp / "out").resolve()
    assert Path(load_run_config(in_tmp / "run.yaml", ["output_dir=o2"]).output_dir).resolve() == \
        (elsewhere / "o2").resolve()


def test_dp_auto_is_the_launch_over_tp_times_pp(in_tmp, monkeypatch):
    make_tree(in_tmp)
    cfg = load_run_config("run.yaml", ["parallelism.dp=auto", "parallelism.pp=2", "parallelism.tp=2",
                                       "parallelism.sequence_parallel=true"])
    assert cfg.parallelism.dp == "auto" and cfg.parallelism.sequence_parallel
    assert cfg.check_world_size(8) == 2
    assert cfg.parallelism.dp == "auto"  # the config is not written: lorafusion.resolve records the value
    cfg = load_run_config("run.yaml", ["parallelism.dp=auto", "parallelism.pp=4"])
    with pytest.raises(ConfigError, match=r"^run.yaml: parallelism.dp: auto needs tp\*pp = 1\*4 = 4 to "
                                          r"divide the launch's 6 process"):
        cfg.check_world_size(6)
    monkeypatch.setenv("WORLD_SIZE", "8")  # the plan command and the trainer read the launch the same way
    from lorafusion.resolve import World, resolve

    assert resolve(cfg, World.from_env(), None).scheduler.dp_size == 2


def test_shipped_configs_fit_their_readme_launch_lines():
    """README: the 8B config on one 8-GPU node (scripts/train.sh), the 70B config on two (slurm, 16 GPUs);
    the 32B config on the 2 GPUs of its benchmark."""
    import yaml

    from lorafusion.config.schema import ParallelismConfig

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    assert "scripts/train.sh configs/llama3.1-8b-4adapters.yaml" in readme
    assert "--nodes=2 slurm/train.sbatch configs/llama3.1-70b-4adapters.yaml" in readme
    for name, world in [("llama3.1-8b-4adapters", 8), ("llama3.1-70b-4adapters", 16),
                        ("qwen2.5-32b-4adapters", 2), ("quickstart", 1)]:
        # (the bench configs' data is made by scripts/make_bench_data.py, so only their layout is read here)
        p = ParallelismConfig(
            **yaml.safe_load((root / "configs" / f"{name}.yaml").read_text())["parallelism"])
        assert p.tp * p.pp * p.resolve_dp(world) == world, name

"""A config, override or job-file error is reported before torch or Megatron is imported (so in well under a
second), one line naming the field as typed; a normal run prints no library warning or solver banner."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QS = ROOT / "configs" / "quickstart.yaml"

_PROBE = """
import contextlib, io, json, sys
from lorafusion.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    out.append({"rc": rc, "err": err.getvalue()})
heavy = sorted(m for m in ("torch", "megatron", "megatron.core", "transformers", "matplotlib")
               if m in sys.modules)
print(json.dumps({"cases": out, "heavy": heavy}))
"""


def _probe(cases: list[list[str]]) -> dict:
    res = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cases)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_config_override_and_job_errors_import_neither_torch_nor_megatron(tmp_path):
    bad_job = tmp_path / "bad.yaml"
    bad_job.write_text(
        (ROOT / "configs" / "quickstart" / "countdown.yaml").read_text().replace("r: 32", "r: 0")
                       .replace("data/countdown.jsonl",
                                str(ROOT / "configs" / "quickstart" / "data" / "countdown.jsonl")))
    here = QS.read_text().replace("quickstart/", str(ROOT / "configs" / "quickstart") + "/")
    run = tmp_path / "run.yaml"
    run.write_text(here.replace(str(ROOT / "configs" / "quickstart" / "countdown.yaml"), str(bad_job)))
    typo = tmp_path / "typo.yaml"
    typo.write_text(here.replace("token_capacity", "token_capacty"))
    cases = [
        ["train", str(QS), "sed=3"],                                   # unknown override key
        ["train", str(QS), "jobs.countdown.optimizer.lr=abc"],             # bad override value
        ["train", str(run), f"output_dir={tmp_path / 'never'}"],       # bad job file
        ["train", str(typo)],                                          # typo in the run YAML
        ["plan", str(QS), "scheduler.token_capacity=0"],
        ["submit", str(tmp_path), str(ROOT / "configs" / "quickstart" / "countdown.yaml"), "optimizer.lrr=1"],
        # layout vs the launch (1 process)
        ["train", str(QS), "parallelism.dp=2", f"output_dir={tmp_path / 'never'}"],
        ["plan", str(QS), "parallelism.pp=2", "parallelism.dp=auto", "--gpus",
         "3"],  # dp: auto that 3 cannot give
    ]
    got = _probe(cases)
    assert got["heavy"] == [], f"a config error imported {got['heavy']}"
    errs = [c["err"] for c in got["cases"]]
    assert all(c["rc"] == 2 for c in got["cases"]), errs
    assert all(e.count("\n") == 1 and ": error: " in e for e in errs), errs
    assert "unknown key sed" in errs[0]
    assert "jobs.countdown.optimizer.lr=abc" in errs[1] and "optimizer.lr: expected a number" in errs[1]
    assert f"{bad_job.name}: lora.r: expected an integer > 0, got 0" in errs[2]
    assert "unknown key 'token_capacty'" in errs[3]
    assert "scheduler.token_capacity" in errs[4]
    # submit names the field as the user typed it, with the job file
    assert ("countdown.yaml: override 'optimizer.lrr=1': unknown key optimizer.lrr; expected one of: lr,"
            in errs[5])
    assert "jobs.0" not in errs[5]
    assert "parallelism: tp*pp*dp = 1*1*2 = 2, but the launch has 1 process(es)" in errs[6]
    assert "parallelism.dp: auto needs tp*pp = 1*2 = 2 to divide the launch's 3 process(es)" in errs[7]
    assert not (tmp_path / "never").exists() and not (tmp_path / "requests").exists()


def test_missing_bench_data_names_the_command_that_makes_it(tmp_path):
    """The shipped large configs read data/bench/*.jsonl, which scripts/make_bench_data.py writes."""
    from lorafusion.config import ConfigError, load_run_config

    run = tmp_path / "configs" / "big.yaml"
    run.parent.mkdir()
    run.write_text((ROOT / "configs" / "llama3.1-8b-4adapters.yaml").read_text())
    with pytest.raises(ConfigError, match=r"dataset file not found: .*data/bench/short.jsonl \(the benchmark "
                                          r"datasets are made, not shipped: python "
                                          r"scripts/make_bench_data.py --out .*data/bench\)"):
        load_run_config(run)


def test_submit_override_value_error_names_the_override(tmp_path, capsys):
    from lorafusion.config import ConfigError, load_job_config

    with pytest.raises(ConfigError) as e:
        load_job_config(ROOT / "configs" / "quickstart" / "countdown.yaml", ["lora.r=0"])
    assert str(e.value).endswith(
        "countdown.yaml: lora.r: expected an integer > 0, got 0 (set by override 'lora.r=0')")


def test_highs_banner_is_not_printed():
    """HiGHS prints a banner from the C++ constructor of a process's first Highs(), whatever msg=False
    says."""
    pytest.importorskip("highspy")
    code = ("import pulp\nfrom lorafusion.scheduler import milp\nassert milp._use_highs('auto')\n"
            "p = pulp.LpProblem('x', pulp.LpMinimize); x = pulp.LpVariable('x', 0, 1, cat='Binary')\n"
            "p += x; p += x >= 0; p.solve(pulp.HiGHS(msg=False, timeLimit=1.0)); print('solved')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 0, res.stderr
    assert res.stdout == "solved\n" and "HiGHS" not in res.stderr


def test_model_config_does_not_warn():
    """megatron-core's TransformerConfig default cuda_graph_scope="full" warns "full scope is deprecated"."""
    import warnings

    import megatron.core.transformer.transformer_config  # noqa: F401  (its import-time warnings are not ours)

    from lorafusion.core.arch import preset
    from lorafusion.models.spec import transformer_config

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        transformer_config(preset("tiny-llama"))

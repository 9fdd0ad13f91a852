"""`lorafusion plan` on the shipped configs as written: the layout is the config's own (dp: auto = one
replica) or --gpus N processes; a sweep says how far it got on stderr."""

import json
from pathlib import Path

import pytest

from runtime_utils import write_dataset

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))


def _data_overrides(config: Path, tmp: Path) -> list[str]:
    """The benchmark configs read data/bench (made, not shipped): a small file for each of their jobs."""
    import yaml

    jobs = yaml.safe_load(config.read_text())["jobs"]
    if not all(isinstance(j, dict) and "bench" in j["dataset"]["path"] for j in jobs):
        return []
    data = write_dataset(tmp / "bench.jsonl", 1, rows=64)
    return [f"jobs.{k}.dataset.path={data}" for k in range(len(jobs))]


def _plan(config: Path, tmp: Path, *extra: str) -> int:
    from lorafusion.cli import main

    return main(
        ["plan", str(config), *_data_overrides(config, tmp), "--out", str(tmp / "plan"), "--windows", "1",
         *extra])


@pytest.mark.parametrize("name", SHIPPED)
def test_plan_runs_on_every_shipped_config_as_written(name, tmp_path, capsys, monkeypatch):
    import yaml

    model_path = (yaml.safe_load((ROOT / "configs" / name).read_text()).get("model") or {}).get("path")
    if model_path and not (ROOT / "configs" / model_path).is_dir():  # a real model (`make real-model`)
        pytest.skip(f"{name} reads the model directory {model_path}, which `make real-model` writes")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _plan(ROOT / "configs" / name, tmp_path) == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (tmp_path / "plan" / "plan.jsonl").read_text().splitlines()]
    assert rows and {r["dp_rank"] for r in rows} == {0}  # dp: auto = one replica when nothing is launched


def test_gpus_sets_the_process_count_and_a_sweep_shows_its_progress(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = ROOT / "configs" / "llama3.1-70b-4adapters.yaml"  # pp=4, dp: auto
    assert _plan(config, tmp_path, "--gpus", "8", "--virtual-sweep", "1,2") == 0
    out, err = capsys.readouterr()
    rows = [json.loads(x) for x in (tmp_path / "plan" / "plan.jsonl").read_text().splitlines()]
    assert {r["dp_rank"] for r in rows} == {0, 1}  # 8 processes / (tp*pp = 4) = 2 replicas
    assert "plan: run: planning up to 1 chunks" in err and "plan: virtual_stages=2: planning up to 1" in err
    assert "plan: virtual_stages=1: planning" not in err  # the run's own V is planned once, not again
    assert "  2  auto" in err and "best: parallelism.virtual_stages=" in err and out == ""  # (people: stderr)
    assert _plan(config, tmp_path, "--gpus", "6") == 2
    assert "parallelism.dp: auto needs tp*pp = 1*4 = 4 to divide the launch's 6 process(es)" in \
        capsys.readouterr().err


def test_one_output_convention_lines_for_people_on_stderr_json_on_stdout(tmp_path, capsys, monkeypatch):
    """plan, submit, cancel and status: nothing on stdout but --json's one document."""
    from lorafusion.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = ROOT / "configs" / "quickstart.yaml"
    plan = ["plan", str(config), "--out", str(tmp_path / "plan"), "--windows", "1"]
    assert main(plan) == 0
    out, err = capsys.readouterr()
    assert out == "" and "written to" in err
    assert main([*plan, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["dir"] == str(tmp_path / "plan") and len(got["windows"]) == 1
    run = tmp_path / "run"
    run.mkdir()
    (run / "status.json").write_text(json.dumps({
        "run": {"state": "stopped", "elapsed_s": 1.0, "tokens_per_s": 1.0, "updated": "-"},
        "jobs": {"successor": {"state": "stopped", "step": 1, "max_steps": 40, "tokens": 10, "last_loss": 1.0,
                               "tokens_per_s": 1.0, "eta_s": None}}}))
    job = ROOT / "configs" / "quickstart" / "countdown.yaml"
    assert main(["submit", str(run), str(job), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["submitted"] == "countdown" and "submitted job 'countdown'" in err
    for argv in (["cancel", str(run), "--job", "successor"], ["status", str(run)]):
        assert main(argv) == 0
        out, err = capsys.readouterr()
        assert out == "" and err, argv
    assert main(["status", str(run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["jobs"]["countdown"]["state"] == "submitted" and got["jobs"]["successor"]["cancel_requested"]

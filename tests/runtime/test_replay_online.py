"""scripts/replay_online.py: a trace replayed for real (a serving run, jobs submitted at their arrival
times)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

TRACE = """\
jobs:
  - {name: a, arrival_s: 0.0, dataset: {profile: short}, lora: {r: 4}, global_batch_size: 2, max_steps: 3,
     seed: 1}
  - {name: b, arrival_s: 0.4, dataset: {profile: mixed}, lora: {r: 8}, global_batch_size: 2, max_steps: 2,
     seed: 2}
"""


def test_job_files_hold_the_traces_lengths(tmp_path):
    """A profile job's data file has the trace's sample lengths in tokens (byte tokenizer), cut to the
    capacity."""
    import replay_online

    from lorafusion.config.load import load_job_config
    from lorafusion.config.schema import TokenizerConfig
    from lorafusion.data import build_tokenizer, load_job_samples
    from lorafusion.scheduler.trace import dataset_lengths, load_trace

    (tmp_path / "t.yaml").write_text(TRACE)
    trace = load_trace(tmp_path / "t.yaml")
    for tj in trace.jobs:
        job = load_job_config(replay_online.job_yaml(trace, tj, tmp_path / "w", 256), check_files=True)
        got = [len(t)
               for t, _ in load_job_samples(job, build_tokenizer(TokenizerConfig(type="byte"))).samples]
        want = [min(n, 256) for n in dataset_lengths(tj, trace.base_dir, 2 * tj.max_steps, 0)]
        assert got == want and job.lora.r == tj.r and job.max_steps == tj.max_steps


@pytest.mark.slow
def test_replay_submits_at_arrival_times_and_measures_every_jobs_completion(tmp_path):
    (tmp_path / "t.yaml").write_text(TRACE)
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "replay_online.py"), "--config",
                    str(ROOT / "configs" / "quickstart.yaml"), "--trace", str(tmp_path / "t.yaml"),
                    "--out", str(out),
                    "--policies", "separate,shortest_first", "--poll-s", "0.05",
                    "scheduler.token_capacity=512",
                    "scheduler.lookahead_batches=1"], check=True, cwd=ROOT, capture_output=True, timeout=600)
    policies = json.loads(out.read_text())["policies"]
    res = policies["shortest_first"]
    assert res["exit_code"] == 0 and set(res["finish_s"]) == {"a", "b"}
    assert res["arrival_s"]["a"] == 0 and 0.4 <= res["arrival_s"]["b"] < 5
    for n, jct in res["jct_s"].items():
        assert jct == pytest.approx(res["finish_s"][n] - res["arrival_s"][n], abs=2e-3) and jct > 0
    metrics = tmp_path / "r.work" / "shortest_first" / "run" / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert sorted((r["job"], r["step"]) for r in rows) == [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2)]
    assert res["tokens"] == sum(r["tokens"] for r in rows)
    # today's practice: one run per job in arrival order, each paying its setup; b waits for a's run to exit
    sep = policies["separate"]
    assert (set(sep["finish_s"]) == set(sep["setup_s"]) == {"a", "b"}
            and sep["arrival_s"]["b"] == pytest.approx(0.4))
    assert sep["finish_s"]["a"] < sep["finish_s"]["b"] and sep["jct_s"]["b"] > sep["setup_s"]["b"] > 0
    assert sep["tokens"] == res["tokens"] and res["mean_jct_speedup_vs_separate"] == pytest.approx(
        sep["mean_jct_s"] / res["mean_jct_s"])
    for n in "ab":
        assert (tmp_path / "r.work" / "separate" / n / "adapters" / n / "adapter_config.json").is_file()
    # nothing is overwritten: the work directory exists now
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "replay_online.py"), "--config",
                        str(ROOT / "configs" / "quickstart.yaml"), "--trace", str(tmp_path / "t.yaml"),
                        "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=120)


def test_scheduler_settings_of_the_run_come_from_the_last_override_then_the_yaml():
    """The simulated side must see the run as launched (online.sh overrides lookahead_batches to 1)."""
    import replay_online

    base = {"scheduler": {"token_capacity": 1024, "lookahead_batches": 2}}
    over = ["scheduler.lookahead_batches=4", "scheduler.lookahead_batches=1"]
    assert replay_online.scheduler_int(base, over, "lookahead_batches", 2) == 1
    assert replay_online.scheduler_int(base, over, "token_capacity", 4096) == 1024
    assert replay_online.scheduler_int({"scheduler": {"token_capacity": "auto"}}, [],
                                       "token_capacity", 4096) == 4096

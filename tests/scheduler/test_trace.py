"""trace.py (arrival traces: parse, validate, generate) and replay.py (policies are consistent)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from lorafusion.core.errors import UserError
from lorafusion.core.lengths import LENGTH_PROFILES, profile_lengths
from lorafusion.scheduler import CostModel, JobSpec, SchedulerConfig
from lorafusion.scheduler.replay import SimCost, alone_times, run_policies, sequential, shared
from lorafusion.scheduler.trace import (
    Trace,
    TraceError,
    TraceJob,
    job_spec,
    load_trace,
    poisson_trace,
    save_trace,
    trace_specs,
)

GOOD = """\
seed: 3
jobs:
  - name: b
    arrival_s: 5
    dataset: {profile: short}
    lora: {r: 8}
    global_batch_size: 4
    max_steps: 3
  - name: a
    arrival_s: 0.5
    dataset: {path: rows.jsonl}
    global_batch_size: 2
    max_steps: 2
    priority: 1
"""


def write(tmp_path, text, name="t.yaml"):
    p = tmp_path / name
    p.write_text(text)
    (tmp_path / "rows.jsonl").write_text(
        '{"prompt": "abc", "response": "de"}\n{"text": "hello"}\n{"num_tokens": 40}\n')
    return p


def test_yaml_trace_parses_sorted_by_arrival_with_defaults(tmp_path):
    t = load_trace(write(tmp_path, GOOD))
    assert [j.name for j in t.jobs] == ["a", "b"]
    a, b = t.jobs
    assert (a.arrival_s, a.r, a.priority, a.path, a.profile) == (0.5, 16, 1, "rows.jsonl", None)
    assert (b.r, b.global_batch_size, b.max_steps, b.profile) == (8, 4, 3, "short")
    specs = trace_specs(t)
    # path dataset: bytes of prompt+response (or text) + bos + eos, or num_tokens; rows cycled in order
    assert [n for batch in specs[0].global_batches for _, n in batch] == [7, 7, 40, 7]
    assert specs[0].priority == 1 and specs[1].rank == 8 and len(specs[1].global_batches) == 3


def test_jsonl_trace_and_round_trip(tmp_path):
    t = poisson_trace(9, seed=5, rate_per_s=0.1)
    for name in ("x.yaml", "x.jsonl"):
        save_trace(t, tmp_path / name)
        back = load_trace(tmp_path / name)
        assert back.jobs == t.jobs
    lines = (tmp_path / "x.jsonl").read_text().splitlines()
    assert len(lines) == 9 and json.loads(lines[0])["name"] == "j00"


@pytest.mark.parametrize("edit, field", [
    (("max_steps: 3", "max_steps: 0"), "jobs[0].max_steps"),
    (("max_steps: 3", "max_steps: many"), "jobs[0].max_steps"),
    (("arrival_s: 5", "arrival_s: -1"), "jobs[0].arrival_s"),
    (("{profile: short}", "{profile: huge}"), "jobs[0].dataset.profile"),
    (("{profile: short}", "{profile: short, path: x}"), "jobs[0].dataset"),
    (("lora: {r: 8}", "lora: {r: 8, alpha: 3}"), "jobs[0].lora"),
    (("lora: {r: 8}", "lora: {r: 0}"), "jobs[0].lora.r"),
    (("    global_batch_size: 4\n", ""), "jobs[0].global_batch_size: missing"),
    (("  - name: b", "  - name: a"), "jobs[1].name: 'a' repeats jobs[0]"),
    (("    max_steps: 3\n", "    max_steps: 3\n    epochs: 2\n"), "jobs[0].epochs: unknown field"),
    (("seed: 3\n", "seeds: 3\n"), "seeds: unknown top-level field"),
])
def test_bad_field_names_file_and_field(tmp_path, edit, field):
    p = write(tmp_path, GOOD.replace(*edit))
    with pytest.raises(TraceError) as e:
        load_trace(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: ") and field in msg, msg
    assert isinstance(e.value, UserError) and "\n" not in msg


def test_bad_files(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "nope.yaml")
    with pytest.raises(TraceError, match=r"t.yaml: jobs: expected a non-empty list"):
        load_trace(write(tmp_path, "jobs: []\n"))
    with pytest.raises(TraceError, match=r"t.jsonl: line 2: not JSON"):
        load_trace(write(tmp_path, '{"name": "a"}\n{oops\n', "t.jsonl"))
    with pytest.raises(TraceError, match="not valid YAML"):
        load_trace(write(tmp_path, "jobs: [\n"))
    t = load_trace(write(tmp_path, GOOD.replace("rows.jsonl", "missing.jsonl")))
    with pytest.raises(TraceError, match="job 'a': dataset.path: no such file"):
        trace_specs(t)


def test_poisson_generator_is_deterministic_by_seed():
    a, b, c = poisson_trace(12, seed=1), poisson_trace(12, seed=1), poisson_trace(12, seed=2)
    assert a.jobs == b.jobs and a.jobs != c.jobs
    assert [job_spec(j) for j in a.jobs] == [job_spec(j) for j in b.jobs]  # sample lengths too
    assert a.jobs[0].arrival_s == 0.0
    arr = [j.arrival_s for j in a.jobs]
    assert arr == sorted(arr) and len({j.name for j in a.jobs}) == 12
    # a rate only rescales arrivals: the jobs are the same
    fast = poisson_trace(12, seed=1, rate_per_s=4.0)
    assert [replace(j, arrival_s=0) for j in fast.jobs] == [replace(j, arrival_s=0) for j in a.jobs]
    assert np.allclose([j.arrival_s * 4 for j in fast.jobs], arr, atol=2e-3)
    mixed = {(j.profile, j.r, j.global_batch_size, j.max_steps) for j in poisson_trace(16, seed=0).jobs}
    assert (len({m[0] for m in mixed}) > 1 and len({m[1] for m in mixed}) > 1
            and len({m[3] for m in mixed}) > 1)


def test_profile_lengths_match_bench_data_draws():
    rng = np.random.default_rng(0)
    got = profile_lengths("medium", 1000, rng)
    assert got.min() >= 16 and got.max() <= 4094
    assert abs(np.median(got) - LENGTH_PROFILES["medium"][0]) < 60


def small_jobs(pp: int):
    rng = np.random.default_rng(pp)
    jobs = []
    for k, (steps, gbs, r) in enumerate([(3, 4, 8), (2, 8, 64), (4, 2, 16), (1, 6, 32)]):
        batches = [[(f"{k}:{s}:{i}", int(rng.integers(100, 2000))) for i in range(gbs)] for s in range(steps)]
        jobs.append(JobSpec(f"job{k}", batches, gbs, rank=r))
    return jobs


CFG = {pp: SchedulerConfig(pipeline_depth=pp, token_capacity=4096, lookahead_batches=2, solver="greedy")
       for pp in (1, 4)}


@pytest.mark.parametrize("pp", [1, 4])
def test_policies_conserve_work_and_respect_alone_times(pp):
    jobs, cfg = small_jobs(pp), CFG[pp]
    arrival = {"job0": 0.0, "job1": 0.05, "job2": 0.3, "job3": 0.31}
    linear = SimCost(CostModel(a=0.0, b=1e-5, c=0.0, gamma=0.0), p2p_s=0.0)
    res = run_policies(jobs, arrival, cfg, linear)
    tokens = sum(n for j in jobs for b in j.global_batches for _, n in b)
    for r in res.values():
        assert r.tokens == tokens and set(r.finish) == set(arrival)
        # cost linear in tokens, no penalty: the same compute in every policy, whatever the packing
        assert r.busy_s == pytest.approx(3 * 1e-5 * tokens, rel=1e-9)  # forward + 2x backward, all stages
    cost = SimCost(mixed_penalty=1.05)
    res = run_policies(jobs, arrival, cfg, cost)
    alone = alone_times(jobs, cfg, cost)
    for r in res.values():
        assert 0 < r.busy_fraction <= 1
        for n, jct in r.jct.items():
            # alone = the job's batches with a flush each; at PP > 1 the online stream runs a job's
            # batches in one schedule (S - 1 idle slots between them instead of a full drain, and the
            # microbatch order may differ), hence the small tolerance
            assert jct >= alone[n] * (1 - 2.5e-2), (r.policy, n, jct, alone[n])
    seq = res["sequential"]
    assert seq.finish["job0"] == pytest.approx(alone["job0"])  # first job alone from t = 0
    assert res["static"].makespan >= max(arrival.values())
    assert min(res["static"].finish.values()) >= max(arrival.values())
    assert res["online"].chunks >= 2 and res["sequential"].chunks == 4


@pytest.mark.parametrize("pp, rel", [(1, 1e-12), (4, 1e-2)])
def test_one_job_sequential_equals_online_and_static(pp, rel):
    job = small_jobs(pp)[0]
    arrival = {job.name: 2.0}
    cost = SimCost(mixed_penalty=1.2)
    seq = sequential([job], arrival, CFG[pp], cost)
    on = shared([job], arrival, CFG[pp], cost)
    st = shared([job], arrival, CFG[pp], cost, static=True)
    assert seq.finish[job.name] == pytest.approx(on.finish[job.name], rel=rel)
    assert on.finish == st.finish and on.busy_s == pytest.approx(seq.busy_s, rel=1e-9)
    assert seq.jct[job.name] == pytest.approx(alone_times([job], CFG[pp], cost)[job.name])


def test_separate_runs_pay_their_setup_each_with_the_gpu_idle():
    jobs = small_jobs(1)[:2]
    cost = SimCost()
    alone = alone_times(jobs, CFG[1], cost)
    both_now = {"job0": 0.0, "job1": 0.0}
    seq, sep = sequential(jobs, both_now, CFG[1], cost), sequential(jobs, both_now, CFG[1], cost, setup_s=5.0)
    assert sep.finish["job0"] == pytest.approx(5.0 + alone["job0"])
    # queued behind the first run's setup
    assert sep.finish["job1"] == pytest.approx(seq.finish["job1"] + 10.0)
    assert sep.busy_s == pytest.approx(seq.busy_s)  # setup adds no compute
    late = {"job0": 0.0, "job1": alone["job0"] + 100.0}  # arrives to an idle machine: pays only its own
    assert sequential(jobs, late, CFG[1], cost, setup_s=5.0).jct["job1"] == pytest.approx(5.0 + alone["job1"])


def test_online_joins_at_chunk_boundary_not_before():
    jobs = small_jobs(1)[:2]
    cost = SimCost()
    starts = []
    arrival = {"job0": 0.0, "job1": 1e-6}  # arrives while job0's first chunk runs
    shared(jobs, arrival, CFG[1], cost,
           on_chunk=lambda t, p, tl: starts.append((t, {e.job for m in p.microbatches for e in m.entries})))
    assert starts[0] == (0.0, {"job0"}) and "job1" in starts[1][1] and starts[1][0] > 0


def test_trace_specs_are_what_policies_get(tmp_path):
    t = Trace((TraceJob("x", 0.0, 4, 2, profile="short", seed=1),
               TraceJob("y", 1.0, 2, 3, r=64, profile="long")))
    specs = trace_specs(t)
    assert [len(s.global_batches) for s in specs] == [2, 3] and specs[1].rank == 64
    assert all(s.truncate for s in specs)


def test_srpt_jct_by_hand_and_never_above_fifo():
    from lorafusion.scheduler.replay import srpt_jct

    # a long job is pre-empted by a short arrival and resumes after it
    assert srpt_jct({"long": 10.0, "short": 2.0}, {"long": 0.0, "short": 3.0}) == {"short": 2.0, "long": 12.0}
    # idle gap before a later arrival; equal remaining work: the earlier arrival first
    assert srpt_jct({"a": 1.0, "b": 1.0, "c": 1.0},
                    {"a": 0.0, "b": 5.0, "c": 5.0}) == {"a": 1.0, "b": 1.0, "c": 2.0}
    rng = __import__("random").Random(4)
    for _ in range(50):
        n = rng.randint(1, 8)
        service = {f"j{i}": rng.uniform(0.1, 5) for i in range(n)}
        arrival = {f"j{i}": rng.uniform(0, 10) for i in range(n)}
        srpt = srpt_jct(service, arrival)
        t, fifo = 0.0, {}
        for j in sorted(arrival, key=arrival.get):
            t = max(t, arrival[j]) + service[j]
            fifo[j] = t - arrival[j]
        assert all(srpt[j] >= service[j] - 1e-9 for j in service)
        assert sum(srpt.values()) <= sum(fifo.values()) + 1e-9
        # the same makespan (work conserving)
        assert abs(max(arrival[j] + srpt[j] for j in service) - t) < 1e-9

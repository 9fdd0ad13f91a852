#!/usr/bin/env python3
"""Replay an arrival trace for real: one serving ``lorafusion train`` run per policy, jobs submitted at their
arrival times, job completion times measured (the real counterpart of ``scripts/bench_online.py``).

For each ``--policies`` entry (``scheduler.policy``: fifo = one job at a time in arrival order inside one
serving run; shortest_first; together) the driver

1. writes every trace job as a job YAML (a ``profile`` dataset becomes a prompt/response JSONL whose samples
   have the trace's token lengths under the byte tokenizer; a ``path`` dataset is used as it is),
2. starts ``lorafusion train RUN.yaml --serve`` (``--launcher`` prefixes it, e.g. ``torchrun ...``) with the
   jobs arriving at time 0 in the config and ``RUN.yaml``'s model, parallelism, scheduler and kernels,
3. takes t = 0 when the run writes its first ``status.json`` (the model is built: a serving base pays its
   setup once, before jobs come; ``setup_s`` records it, and ``mean_jct_with_setup_bound_s`` = mean JCT +
   setup is the most the mean could be had the run started only at the first arrival), submits each later
   job at ``arrival_s × --time-scale`` (as ``lorafusion submit`` does, validated up front),
4. polls ``status.json`` and records when each job is ``done`` (handed over: checkpointed, its adapter
   written); once all are, stops the run with SIGTERM (it checkpoints and exits) and reads
   ``metrics.jsonl`` for the tokens.

JCT = done − arrival. ``separate`` is today's practice taken literally: each job its own ``lorafusion train``
run (no serving base), started in arrival order once it has arrived and the previous run has exited, so each
job also pays its run's setup (imports, model build, first-step compilation); t = 0 is the first job's arrival
and its done time is when its run exits (adapter exported); ``setup_s`` records each run's start → first
``status.json``. The JSON holds, per policy, each job's arrival, finish and JCT, mean / p90 JCT, the
makespan, tokens/s, and the speedups of each policy's mean and p90 JCT over ``fifo``'s (and ``separate``'s);
with ``--simulate``
also the simulator's prediction for the same trace and policies (``lorafusion.scheduler.replay`` with the cost
model of ``scripts/bench_online.py``'s PP=1 fit), side by side.

    python scripts/replay_online.py --config configs/llama3.1-8b-4adapters.yaml \\
        --trace docs/results/online-trace-gpu.yaml --out docs/results/online-jct-gpu.json \\
        --policies fifo,shortest_first,together scheduler.token_capacity=16384
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _bench import command  # noqa: E402
from _bench import commit as bench_commit  # noqa: E402

from lorafusion.scheduler.trace import Trace, TraceJob, dataset_lengths, load_trace  # noqa: E402

LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz      "))


def job_yaml(trace: Trace, tj: TraceJob, work: Path, max_len: int) -> Path:
    """A job YAML for trace job ``tj`` (its data written next to it), all-linear LoRA with alpha = 2r."""
    if tj.profile is not None:
        data = work / "data" / f"{tj.name}.jsonl"
        if not data.is_file():
            data.parent.mkdir(parents=True, exist_ok=True)
            rng = np.random.default_rng(tj.seed if tj.seed is not None else 0)
            rows = []
            for n in dataset_lengths(tj, trace.base_dir, tj.max_steps * tj.global_batch_size,
                                     trace.seed or 0):
                n = max(2, min(int(n), max_len)) - 2  # bos + eos are added by the byte tokenizer
                text = "".join(rng.choice(LETTERS, n))
                rows.append(json.dumps({"prompt": text[: n // 3], "response": text[n // 3:]}))
            data.write_text("\n".join(rows) + "\n")
        dataset = {"path": str(data), "format": "prompt_response", "max_seq_len": max_len, "truncate": True}
    else:
        p = Path(tj.path)
        dataset = {"path": str(p if p.is_absolute() else (trace.base_dir / p).resolve()),
                   "format": "prompt_response", "max_seq_len": max_len, "truncate": True}
    doc = {"name": tj.name, "dataset": dataset,
           "lora": {"r": tj.r, "lora_alpha": 2 * tj.r, "target_modules": "all-linear"},
           "global_batch_size": tj.global_batch_size, "max_steps": tj.max_steps, "priority": tj.priority}
    path = work / "jobs" / f"{tj.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def read_config(path: str) -> dict:
    """The run YAML as a dict, its model and tokenizer paths made absolute (the copy lives elsewhere)."""
    base = yaml.safe_load(Path(path).read_text())
    for section in ("model", "tokenizer"):
        sec = base.get(section) or {}
        if sec.get("path") and not Path(sec["path"]).is_absolute():
            sec["path"] = str((Path(path).parent / sec["path"]).resolve())
    return base


def scheduler_int(base: dict, overrides: list[str], key: str, default: int) -> int:
    """``scheduler.KEY`` of the run as launched: the last ``scheduler.KEY=`` override, else the YAML's, else
    ``default`` (also for "auto")."""
    value = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith(f"scheduler.{key}=")), None)
    value = value or (base.get("scheduler") or {}).get(key, default)
    return int(value) if str(value).isdigit() else default


def _env() -> dict:
    """The environment of a ``lorafusion train`` the driver starts: this checkout first on the path."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _job_yamls(trace: Trace, base: dict, overrides: list[str], work: Path) -> dict[str, Path]:
    """Every trace job's YAML (and data), its samples cut to the run's token capacity."""
    max_len = scheduler_int(base, overrides, "token_capacity", 4096)
    return {tj.name: job_yaml(trace, tj, work, max_len) for tj in trace.jobs}


def _train_cmd(args, run_yaml: Path, overrides: list[str]) -> list[str]:
    return [*shlex.split(args.launcher), "train", str(run_yaml), *overrides] if args.launcher else \
        [sys.executable, "-m", "lorafusion.cli", "train", str(run_yaml), *overrides]


def _run_yaml(base: dict, jobs: list[str], out: Path, path: Path, **extra) -> Path:
    run = dict(base, jobs=jobs, output_dir=str(out), **extra)
    run["logging"] = dict(base.get("logging") or {}, progress=False, tensorboard=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(run, sort_keys=False))
    return path


def _summary(policy: str, cmd: list[str], arrival: dict, finish: dict, tokens: int, exit_code,
             **extra) -> dict:
    jct = {n: finish[n] - arrival[n] for n in finish}
    j = np.array(list(jct.values()))
    makespan = max(finish.values())
    return {"policy": policy, "command": shlex.join(cmd), "arrival_s": _r(arrival), "finish_s": _r(finish),
            "jct_s": _r(jct), "mean_jct_s": float(j.mean()), "p90_jct_s": float(np.percentile(j, 90)),
            "makespan_s": makespan, "tokens": tokens, "tokens_per_s": tokens / makespan,
            "exit_code": exit_code, **extra}


def _tokens(out: Path) -> int:
    return sum(json.loads(x)["tokens"] for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip())


def run_separate(trace: Trace, args, overrides: list[str], work: Path) -> dict:
    """Today's practice: each job alone in its own ``lorafusion train`` run, in arrival order (a FIFO queue of
    runs on the machine), each paying its own setup. JCT = its run's exit − its arrival."""
    base = read_config(args.config)  # (one job a run: the config's scheduler.policy makes no difference)
    yamls = _job_yamls(trace, base, overrides, work)
    order = sorted(trace.jobs, key=lambda t: t.arrival_s)
    first = order[0].arrival_s
    env = _env()
    t0 = time.monotonic()
    deadline = t0 + args.timeout
    arrival, finish, setup, tokens, cmds = {}, {}, {}, 0, []
    for tj in order:
        arrival[tj.name] = (tj.arrival_s - first) * args.time_scale
        while time.monotonic() - t0 < arrival[tj.name]:
            time.sleep(max(0.0, min(args.poll_s, arrival[tj.name] - (time.monotonic() - t0))))
        out = work / "separate" / tj.name
        cmd = _train_cmd(args,
                         _run_yaml(base, [str(yamls[tj.name])], out, work / "separate" / f"{tj.name}.yaml"),
                         overrides)
        cmds.append(cmd)
        start = time.monotonic()
        with (work / "separate" / f"{tj.name}.log").open("w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            while proc.poll() is None:
                if tj.name not in setup and (out / "status.json").is_file():
                    setup[tj.name] = time.monotonic() - start
                if time.monotonic() > deadline:
                    proc.kill()
                    raise TimeoutError(f"separate: job {tj.name} unfinished after --timeout")
                time.sleep(args.poll_s)
        if proc.returncode != 0:
            raise RuntimeError(f"separate: the run of job {tj.name} exited {proc.returncode}; see "
                               f"{work / 'separate' / (tj.name + '.log')}")
        finish[tj.name] = time.monotonic() - t0
        tokens += _tokens(out)
    return _summary("separate", cmds[0], arrival, finish, tokens, 0, setup_s=_r(setup),
                    mean_setup_s=float(np.mean(list(setup.values()))) if setup else None)


def run_policy(policy: str, trace: Trace, args, overrides: list[str], work: Path) -> dict:
    from lorafusion.config.load import load_job_config
    from lorafusion.rundir.requests import write_request

    if policy == "separate":
        return run_separate(trace, args, overrides, work)
    base = read_config(args.config)
    yamls = _job_yamls(trace, base, overrides, work)
    first = min(tj.arrival_s for tj in trace.jobs)
    at_start = [tj.name for tj in trace.jobs if tj.arrival_s == first]
    later = sorted((tj for tj in trace.jobs if tj.arrival_s > first), key=lambda t: t.arrival_s)
    submissions = {tj.name: load_job_config(yamls[tj.name], [], check_files=True) for tj in later}
    out = work / policy / "run"
    base["scheduler"] = dict(base.get("scheduler") or {}, policy=policy)
    run_yaml = _run_yaml(base, [str(yamls[n]) for n in at_start], out, work / policy / "run.yaml", serve=True,
                         serve_idle_minutes=args.idle_minutes)
    cmd = _train_cmd(args, run_yaml, overrides)
    log = (work / policy / "train.log").open("w")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
    status = out / "status.json"
    deadline = time.monotonic() + args.timeout
    try:
        while not status.is_file():
            if proc.poll() is not None:
                raise RuntimeError(f"{policy}: the run ended before it started (exit {proc.returncode}); "
                                   f"see {work / policy / 'train.log'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{policy}: the run did not start within --timeout")
            time.sleep(0.05)
        t0 = time.monotonic()
        arrival = {n: 0.0 for n in at_start}
        finish: dict[str, float] = {}
        pending = list(later)
        while len(finish) < len(trace.jobs):
            now = time.monotonic() - t0
            while pending and (pending[0].arrival_s - first) * args.time_scale <= now:
                tj = pending.pop(0)
                arrival[tj.name] = time.monotonic() - t0
                job = submissions[tj.name]
                write_request(out, "submit", {"name": job.name, "job": job.model_dump(mode="json")})
            try:
                jobs = json.loads(status.read_text())["jobs"]
            except (json.JSONDecodeError, KeyError, OSError):
                jobs = {}
            for name, row in jobs.items():
                if row.get("state") == "done" and name not in finish:
                    finish[name] = time.monotonic() - t0
                elif row.get("state") in ("diverged", "cancelled", "stopped"):
                    raise RuntimeError(f"{policy}: job {name} ended {row['state']}; see {work / policy}")
            if proc.poll() is not None:
                raise RuntimeError(f"{policy}: the run exited ({proc.returncode}) with jobs unfinished: "
                                   f"{sorted(set(arrival) - set(finish))}; see {work / policy / 'train.log'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{policy}: jobs unfinished after --timeout: "
                                   f"{sorted(set(yamls) - set(finish))}")
            time.sleep(args.poll_s)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
    res = _summary(policy, cmd, arrival, finish, _tokens(out), proc.returncode, setup_s=round(t0 - start, 3))
    # had the serving run been started at the first arrival, every job would finish at most its setup later
    res["mean_jct_with_setup_bound_s"] = res["mean_jct_s"] + res["setup_s"]
    return res


def _r(d: dict) -> dict:
    return {k: round(v, 3) for k, v in d.items()}


def simulate(trace: Trace, policies: list[str], time_scale: float, base: dict, overrides: list[str]) -> dict:
    """The simulator's JCTs for the same trace (PP=1 cost fit of bench_online.py) under the same policies."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from dataclasses import replace

    import bench_online

    from lorafusion.scheduler.replay import run_policies
    from lorafusion.scheduler.trace import trace_specs

    bench_online.measured_from_files()
    costs, _ = bench_online.fit_costs()
    cfg = replace(bench_online.SETTINGS["pp1"],
                  token_capacity=scheduler_int(base, overrides, "token_capacity", 4096),
                  lookahead_batches=scheduler_int(base, overrides, "lookahead_batches", 2))
    scaled = trace.scaled(time_scale)
    res = run_policies(trace_specs(scaled), {j.name: j.arrival_s for j in scaled.jobs}, cfg, costs["pp1"])
    return {p: res[f"online_{p}"].summary() for p in policies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True,
                    help="run YAML: model, parallelism, scheduler, kernels (jobs ignored)")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--policies", default="fifo,shortest_first,together",
                    help="any of separate (one run per job), fifo, shortest_first, together")
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--work", default=None, help="working directory (default: next to --out, *.work)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="arrival times are multiplied by this")
    ap.add_argument("--launcher", default="", help="command before 'train', e.g. 'torchrun --standalone "
                                                   "--nproc_per_node 2 -m lorafusion.cli'")
    ap.add_argument("--poll-s", type=float, default=0.1)
    ap.add_argument("--idle-minutes", type=float, default=30.0)
    ap.add_argument("--timeout", type=float, default=3600.0, help="per policy, seconds")
    ap.add_argument("--warmup", action="store_true",
                    help="first run every trace job for one step together (discarded): compiles and caches "
                         "land there, not in the first policy's JCTs")
    ap.add_argument("--simulate", action="store_true", help="add the simulator's prediction (PP=1 fit)")
    ap.add_argument("--device", default="", help="recorded in the JSON (e.g. '1x NVIDIA H200')")
    ap.add_argument("--commit", default=os.environ.get("BENCH_COMMIT", ""))
    ap.add_argument("overrides", nargs="*", help="key=value overrides for the run (after the options)")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    known = ("separate", "fifo", "shortest_first", "together")
    if not policies or set(policies) - set(known):
        raise SystemExit(f"--policies: expected a comma-separated list of {', '.join(known)}; got "
                         f"{args.policies!r}")
    trace = load_trace(args.trace)
    out = Path(args.out)
    work = Path(args.work) if args.work else out.with_suffix(".work")
    if work.exists() and any(work.iterdir()):
        raise SystemExit(f"{work}: exists and is not empty; choose another --work (nothing is overwritten)")
    work.mkdir(parents=True, exist_ok=True)
    if args.warmup:
        from dataclasses import replace as _replace

        once = Trace(tuple(_replace(j, arrival_s=0.0, max_steps=1) for j in trace.jobs),
                     trace.source, trace.seed)
        warm = run_policy("together", once, args, list(args.overrides), work / "warmup")
        print(f"warm-up (discarded): {warm['makespan_s']:.1f}s", flush=True)
    commit = args.commit or bench_commit()
    results: dict = {}
    doc = {"date": time.strftime("%Y-%m-%d"), "what": "real runs: one serving lorafusion train per policy, "
           "jobs submitted at their arrival times; JCT = done (status.json: adapter written) - arrival, "
           "setup not counted (mean_jct_with_setup_bound_s adds it); 'separate': "
           "one lorafusion train per job in arrival order, JCT = its run's exit - arrival, its setup counted",
           "device": args.device, "commit": commit,
           "command": command(),
           "trace": {"path": args.trace, "time_scale": args.time_scale,
                     "jobs": [j.to_dict() for j in trace.jobs]},
           "policies": results}
    if args.simulate:  # (the simulator has no setup cost: no "separate")
        doc["simulated"] = simulate(trace, [p for p in policies if p != "separate"], args.time_scale,
                                    read_config(args.config), list(args.overrides))
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in policies:  # the JSON is rewritten after each policy: a cut-off replay keeps what it measured
        results[p] = run_policy(p, trace, args, list(args.overrides), work)
        r = results[p]
        print(f"{p}: mean JCT {r['mean_jct_s']:.2f}s p90 {r['p90_jct_s']:.2f}s makespan "
              f"{r['makespan_s']:.2f}s {r['tokens_per_s']:,.0f} tokens/s", flush=True)
        for name in ("fifo", "separate"):
            ref = results.get(name)
            for r in results.values():
                if ref is not None:
                    r[f"mean_jct_speedup_vs_{name}"] = ref["mean_jct_s"] / r["mean_jct_s"]
                    r[f"p90_jct_speedup_vs_{name}"] = ref["p90_jct_s"] / r["p90_jct_s"]
                    if name == "separate" and "mean_jct_with_setup_bound_s" in r:
                        r["mean_jct_with_setup_bound_speedup_vs_separate"] = \
                            ref["mean_jct_s"] / r["mean_jct_with_setup_bound_s"]
        doc["complete"] = len(results) == len(policies)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(out)
    keys = ("mean_jct_s", "p90_jct_s", "makespan_s", "setup_s", "mean_setup_s", "mean_jct_speedup_vs_fifo",
            "mean_jct_speedup_vs_separate", "mean_jct_with_setup_bound_speedup_vs_separate")
    print(json.dumps({p: {k: r[k] for k in keys if k in r} for p, r in results.items()}))


if __name__ == "__main__":
    main()

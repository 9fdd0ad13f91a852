"""Tensor-parallel collectives overlapped with compute (``parallelism.tp_overlap``) against the same run
without, alternated chunk by chunk inside ONE training run (same model, data stream and process; no rebuild):

    torchrun --nproc_per_node 2 scripts/bench_tp_overlap.py --config configs/llama3.1-8b-4adapters.yaml \
        --nano 2,4 --timed 6 --json out/tp-overlap-2xh100.json parallelism.tp=2 \
        parallelism.sequence_parallel=true scheduler.token_capacity=4096 scheduler.lookahead_batches=2

The model is built with ``tp_overlap: on`` and a callback sets, before each planned chunk, how many
nano-batches its TP linears use (``model.config.tp_overlap``: 0 = Megatron's collectives in line, as with
``tp_overlap: off``; the layers read it at every forward). This writes the model's config after it was
built, which the runtime never does: it is the measurement's switch, nothing more. Chunks: one warm-up chunk
per mode (untimed), then ``--timed`` rounds, each running every mode once (the order reversed every other
round, so a drift over the run does not favour one mode), then with ``--profile`` one profiled chunk per
mode (untimed): torch.profiler's CUDA kernels split into NCCL collectives and compute, and how much of the
collectives' time ran while a compute kernel ran (hidden) on each rank.

Tokens/s per mode = real tokens of its timed chunks / their wall time (each chunk synchronised at both
ends). Rank 0 writes ``--json``: tokens_per_s per mode, speedup of each overlap mode over off, chunk times,
the profile, device, commit, command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import DIST, RANK, WORLD, ROOT, ensure_data, gather  # noqa: E402

COMM = ("AllGather", "ReduceScatter", "AllReduce", "SendRecv", "Broadcast")


def comm_kind(name: str) -> str | None:
    """The collective a CUDA kernel runs (NCCL's kernel names), or None for a compute kernel."""
    if "nccl" not in name.lower():
        return None
    return next((k for k in COMM if k.lower() in name.lower()), "other")


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap_summary(kernels: list[tuple[str, float, float]]) -> dict:
    """From one device's kernels ``(name, start_us, end_us)``: the collectives' time (union of their
    intervals, per kind and together), the compute time (union of the other kernels) and the part of the
    collectives' time during which some compute kernel ran (hidden)."""
    comm = [(s, e) for n, s, e in kernels if comm_kind(n)]
    comp = _union([(s, e) for n, s, e in kernels if not comm_kind(n)])
    comm_u = _union(comm)
    hidden, j = 0.0, 0
    for s, e in comm_u:  # both lists sorted and disjoint: one sweep
        while j < len(comp) and comp[j][1] <= s:
            j += 1
        k = j
        while k < len(comp) and comp[k][0] < e:
            hidden += min(e, comp[k][1]) - max(s, comp[k][0])
            k += 1
    total = sum(e - s for s, e in comm_u)
    kinds = {}
    for kind in sorted({comm_kind(n) for n, _, _ in kernels} - {None}):
        kinds[kind] = sum(e - s for s, e in _union([(s, e) for n, s, e in kernels if comm_kind(n) == kind]))
    window = (max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)) if kernels else 0.0
    return {"window_ms": window / 1e3, "compute_ms": sum(e - s for s, e in comp) / 1e3,
            "collective_ms": total / 1e3, "collective_ms_by_kind": {k: v / 1e3 for k, v in kinds.items()},
            "hidden_ms": hidden / 1e3, "hidden_frac": hidden / total if total else None}


class Alternate:
    """A trainer callback: sets each chunk's mode (nano-batches, 0 = off) from ``schedule``, times the chunk
    (synchronised at both ends) and counts its real tokens; profiles the chunks listed in ``profiled``."""

    def __init__(self, schedule: list[tuple[str, int, str]]):
        self.schedule, self.i, self.rows, self.profiles = schedule, 0, [], {}
        self._t0 = self._prof = None

    def chunk_start(self, trainer, chunk):
        label, nano, kind = self.schedule[min(self.i, len(self.schedule) - 1)]
        trainer.model.config.tp_overlap = nano  # the measurement's switch (module docstring)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if kind == "profile" and torch.cuda.is_available():
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CUDA])  # kernels only: a chunk has ~1e5
            self._prof.__enter__()
        self._t0 = time.perf_counter()

    def chunk_ran(self, trainer, chunk, result):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - self._t0
        label, nano, kind = self.schedule[min(self.i, len(self.schedule) - 1)]
        tokens = sum(mb.num_tokens for mb in chunk.plan.microbatches)
        self.rows.append({"chunk": self.i, "mode": label, "nano": nano, "kind": kind, "s": dt,
                          "tokens": tokens})
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            try:  # the timed chunks are the result: a profile that cannot be read says why, nothing more
                kern = [(e.name, e.time_range.start, e.time_range.end) for e in self._prof.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0]
                self.profiles[label] = overlap_summary(kern)
            except Exception as e:  # noqa: BLE001
                self.profiles[label] = {"error": repr(e)[:300]}
            self._prof = None
        if RANK == 0:
            print(f"bench: chunk {self.i} {label} ({kind}) {tokens} tokens in {dt:.2f} s", file=sys.stderr,
                  flush=True)
        self.i += 1


def schedule(nanos: list[int], timed: int, profile: bool) -> list[tuple[str, int, str]]:
    """(mode label, nano-batches, warmup | timed | profile) per chunk, in run order."""
    modes = [("off", 0)] + [(f"on{n}", n) for n in nanos]
    out = [(m, n, "warmup") for m, n in modes]
    for r in range(timed):
        out += [(m, n, "timed") for m, n in (modes if r % 2 == 0 else modes[::-1])]
    if profile:
        out += [(m, n, "profile") for m, n in modes]
    return out


def main() -> None:
    from lorafusion.core.procenv import set_process_env
    from lorafusion.runtime.signals import install_stack_dump

    set_process_env()  # the allocator and OpenMP settings `lorafusion train` runs with
    install_stack_dump()  # kill -USR2: every thread's stack (scripts/device/watch.sh)
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/llama3.1-8b-4adapters.yaml")
    ap.add_argument("--nano", default="2", help="comma-separated nano-batch counts to compare with off")
    ap.add_argument("--timed", type=int, default=6, help="timed chunks per mode")
    ap.add_argument("--profile", action="store_true", help="one profiled chunk per mode at the end")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--out", default="/tmp/bench_tp_overlap")
    ap.add_argument("--json", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    nanos = [int(x) for x in args.nano.split(",") if x]
    plan = schedule(nanos, args.timed, args.profile)
    if "data/bench" in Path(args.config).read_text():
        if RANK == 0:
            ensure_data(args.rows)
        names = ("short", "medium", "long", "mixed")
        while not all((ROOT / "data/bench" / f"{n}.jsonl").is_file() for n in names):
            time.sleep(1)
        time.sleep(2)  # (rank 0 writes them one after the other)
    rows, profiles, cfg = run(args, nanos, plan)
    per_rank = gather(profiles)
    if RANK == 0:
        write(args, rows, per_rank, cfg)
    from lorafusion.dist import destroy_distributed

    destroy_distributed()


def run(args, nanos: list[int], plan: list) -> tuple[list, dict, object]:
    from lorafusion.config import load_run_config
    from lorafusion.runtime.trainer import Trainer

    base = load_run_config(args.config, list(args.overrides))
    look = base.scheduler.lookahead_batches
    steps = look * len(plan)  # every job runs every chunk: one chunk = lookahead global batches per job
    extra = [f"output_dir={args.out}", "logging.progress=false", "logging.tensorboard=false",
             "parallelism.tp_overlap=on", f"parallelism.tp_overlap_chunks={max(nanos)}"]
    extra += [f"jobs.{i}.max_steps={steps}" for i in range(len(base.jobs))]
    extra += [f"jobs.{i}.optimizer.warmup_steps={min(j.optimizer.warmup_steps, steps)}"
              for i, j in enumerate(base.jobs)]
    composed = {o.partition("=")[0].strip(): o for o in list(args.overrides) + extra}
    cfg = load_run_config(args.config, list(composed.values()))
    alt = Alternate(plan)
    trainer = Trainer(cfg, callbacks=[alt])
    summary = trainer.run()
    if summary.get("status") == "stopped":
        raise SystemExit(f"the run was stopped after {len(alt.rows)} chunk(s)")
    return alt.rows, alt.profiles, cfg


def write(args, rows: list, per_rank: list, cfg) -> None:
    modes: dict[str, dict] = {}
    for r in rows:
        if r["kind"] == "timed":
            m = modes.setdefault(r["mode"], {"tokens": 0, "s": 0.0, "chunks": 0, "chunk_s": []})
            m["tokens"] += r["tokens"]
            m["s"] += r["s"]
            m["chunks"] += 1
            m["chunk_s"].append(round(r["s"], 3))
    for m in modes.values():
        m["tokens_per_s"] = m["tokens"] / m["s"] if m["s"] else None
    off = modes.get("off", {}).get("tokens_per_s")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rec = {"tokens_per_s": {k: v["tokens_per_s"] for k, v in modes.items()},
           "speedup_vs_off": {k: v["tokens_per_s"] / off for k, v in modes.items() if k != "off" and off},
           "modes": modes, "profile_per_rank": per_rank, "chunks": rows,
           "device": f"{WORLD}x {device}" if DIST else device,
           "commit": os.environ.get("BENCH_COMMIT"), "command": os.environ.get("BENCH_COMMAND")
           or " ".join([f"torchrun --nproc_per_node {WORLD}" if DIST else "python", *sys.argv]),
           "config": args.config, "overrides": list(args.overrides),
           "parallelism": {"tp": cfg.parallelism.tp, "pp": cfg.parallelism.pp,
                           "sequence_parallel": cfg.parallelism.sequence_parallel},
           "token_capacity": cfg.scheduler.token_capacity,
           "lookahead_batches": cfg.scheduler.lookahead_batches}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rec, indent=2, default=str) + "\n")
    for k, v in modes.items():
        x = rec["speedup_vs_off"].get(k)
        print(f"{k:>6}: {v['tokens_per_s'] or 0:>10,.0f} tokens/s over {v['chunks']} chunks {v['chunk_s']}"
              + ("" if x is None else f"  x{x:.3f}"))
    for rank, prof in enumerate(per_rank):
        for k, p in prof.items():
            if "error" in p:
                print(f"rank {rank} {k:>6}: profile not read: {p['error']}")
                continue
            hid = None if p["hidden_frac"] is None else round(p["hidden_frac"], 3)
            print(f"rank {rank} {k:>6}: collectives {p['collective_ms']:.0f} ms "
                  f"{p['collective_ms_by_kind']}, hidden {hid}, compute {p['compute_ms']:.0f} ms of "
                  f"{p['window_ms']:.0f} ms")
    print(json.dumps({k: rec[k] for k in ("tokens_per_s", "speedup_vs_off", "device", "commit")}))


if __name__ == "__main__":
    main()

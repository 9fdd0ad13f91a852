"""FP8 base quality on the quickstart, the way the field checks a precision change: the same config trained
with a bf16 and an FP8 base (``model.dtype=bfloat16``, ``model.base_precision`` bf16 / fp8) over several
seeds, then greedy answers to the held-out prompts. FP8 passes when each job's final loss lies inside bf16's
own seed-to-seed spread (min..max of its final losses over the seeds, widened by ``--slack``; below it counts
as inside) and no seed's held-out score is more than one answer below bf16's; the loss curves of every run are
overlaid in one PNG.

    python scripts/fp8_quickstart.py run --seeds 1234 1 2 --work /tmp/qs    # trains and answers, all at once
    python scripts/fp8_quickstart.py report --work /tmp/qs --json qs.json --png qs.png

``run`` starts every training at once (``--parallel N``: at most N; on a GPU they share it), each through the
CLI (``python -m lorafusion.cli train`` then ``generate``), and logs under WORK/logs. ``report`` reads each
run's ``metrics.jsonl``, ``summary.json`` and held-out answers; its JSON holds the curves, the spreads (also
of the mean loss of the last 10 steps) and the verdict.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _bench import command, commit  # noqa: E402

PRECISIONS = ("bf16", "fp8")
CONFIG = ROOT / "configs" / "quickstart.yaml"
HELDOUT = ROOT / "configs" / "quickstart" / "heldout.jsonl"


def run_dir(work: Path, precision: str, seed: int) -> Path:
    return work / f"{precision}-{seed}"


def _one(work: Path, precision: str, seed: int, extra: list[str]) -> list[list[str]]:
    out = run_dir(work, precision, seed)
    cli = [sys.executable, "-m", "lorafusion.cli"]
    return [cli + ["train", str(CONFIG), f"output_dir={out}", "model.dtype=bfloat16",
                   f"model.base_precision={precision}", f"seed={seed}", "logging.progress=false",
                   "logging.tensorboard=false", *extra],
            cli + ["generate", str(out), "--prompts", str(HELDOUT), "--out", str(out) + "-heldout.jsonl",
                   "--max-new-tokens", "12"]]


def run(args) -> int:
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "logs").mkdir(exist_ok=True)
    todo = [(p, s) for s in args.seeds for p in PRECISIONS]
    live: list[tuple[str, int, subprocess.Popen, list[list[str]], object]] = []
    what = {0: "train", 1: "generate"}
    failed, t0 = 0, time.monotonic()
    while todo or live:
        while todo and len(live) < args.parallel:
            p, s = todo.pop(0)
            steps = _one(args.work, p, s, args.overrides)
            log = open(args.work / "logs" / f"{p}-{s}.log", "w")
            proc = subprocess.Popen(steps[0], stdout=log, stderr=subprocess.STDOUT)
            live.append((p, s, proc, steps[1:], log))
        for item in list(live):
            p, s, proc, rest, log = item
            if proc.poll() is None:
                continue
            live.remove(item)
            print(f"{p} seed {s}: {what[1 - len(rest)]} rc={proc.returncode} at {time.monotonic() - t0:.0f}s",
                  flush=True)
            if proc.returncode == 0 and rest:
                proc = subprocess.Popen(rest[0], stdout=log, stderr=subprocess.STDOUT)
                live.append((p, s, proc, rest[1:], log))
            else:
                failed += proc.returncode != 0
                log.close()
        time.sleep(0.5)
    return 1 if failed else 0


def _curves(run: Path) -> dict[str, list[list[float]]]:
    out: dict[str, list[list[float]]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("job") and row.get("loss") is not None and row.get("step") is not None:
            out.setdefault(row["job"], []).append([row["step"], row["loss"]])
    return out


def _heldout(run: Path) -> dict[str, list[int]]:
    from lorafusion.inference.generate import expected_matches

    rows = [json.loads(x) for x in Path(str(run) + "-heldout.jsonl").read_text().splitlines() if x.strip()]
    return expected_matches(rows)


def verdict(runs: dict, seeds: list[int], slack: float) -> dict:
    """Each job's bf16 final losses over the seeds (min..max, widened by ``slack`` of that range), whether
    every FP8 final loss lies inside (and whether none lies above), and per seed and job the held-out answers
    of FP8 minus bf16's. FP8 passes when no final loss is above bf16's spread and no held-out score is more
    than one answer below bf16's."""
    jobs = sorted(runs[f"bf16-{seeds[0]}"]["final_loss"])
    spread, inside, not_above, answers = {}, {}, {}, {}
    for job in jobs:
        ref = [runs[f"bf16-{s}"]["final_loss"][job] for s in seeds]
        lo, hi = min(ref), max(ref)
        pad = slack * (hi - lo)
        fp8 = [runs[f"fp8-{s}"]["final_loss"][job] for s in seeds]
        last = {p: [statistics.fmean(y for _, y in runs[f"{p}-{s}"]["curves"][job][-10:]) for s in seeds]
                for p in PRECISIONS}
        spread[job] = {"bf16_min": lo, "bf16_max": hi, "bf16_mean": statistics.fmean(ref),
                       "fp8": fp8, "fp8_mean": statistics.fmean(fp8),
                       "mean_last10_bf16": last["bf16"], "mean_last10_fp8": last["fp8"],
                       "mean_last10_fp8_over_bf16": statistics.fmean(last["fp8"])
                       / statistics.fmean(last["bf16"])}
        inside[job] = all(lo - pad <= x <= hi + pad for x in fp8)
        not_above[job] = all(x <= hi + pad for x in fp8)
        answers[job] = [runs[f"fp8-{s}"]["heldout"][job][0] - runs[f"bf16-{s}"]["heldout"][job][0]
                        for s in seeds]
    ok = all(not_above.values()) and all(d >= -1 for v in answers.values() for d in v)
    return {"final_loss_spread": spread, "fp8_inside_bf16_spread": inside,
            "fp8_not_above_bf16_max": not_above, "heldout_fp8_minus_bf16": answers, "pass": ok,
            "pass_means": "every FP8 final loss at most bf16's largest over the seeds (below bf16's smallest "
                          "counts as inside), no seed's held-out score more than one answer below bf16's"}


def plot(runs: dict, seeds: list[int], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = sorted(runs[f"bf16-{seeds[0]}"]["curves"])
    fig, axes = plt.subplots(1, len(jobs), figsize=(5 * len(jobs), 3.6), squeeze=False)
    for ax, job in zip(axes[0], jobs, strict=True):
        for p, color in zip(PRECISIONS, ("tab:blue", "tab:orange"), strict=True):
            for i, s in enumerate(seeds):
                xy = runs[f"{p}-{s}"]["curves"][job]
                ax.plot([a for a, _ in xy], [b for _, b in xy], color=color, alpha=0.75, lw=1.2,
                        label=f"{p} base" if i == 0 else None)
        ax.set_title(job)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss (nats/token)")
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle(f"quickstart, bf16 vs FP8 frozen base, seeds {', '.join(map(str, seeds))}")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)


def report(args) -> int:
    runs = {}
    for s in args.seeds:
        for p in PRECISIONS:
            d = run_dir(args.work, p, s)
            summ = json.loads((d / "summary.json").read_text())
            runs[f"{p}-{s}"] = {"final_loss": {j: v["final_loss"] for j, v in summ["jobs"].items()},
                                "heldout": _heldout(d), "curves": _curves(d)}
    out = {"what": "configs/quickstart.yaml at model.dtype=bfloat16, bf16 vs FP8 frozen base, per seed",
           "seeds": args.seeds, "commit": commit(), "command": command(), "runs": runs,
           **verdict(runs, args.seeds, args.slack)}
    if args.png:
        plot(runs, args.seeds, args.png)
        out["png"] = str(args.png)
    text = json.dumps(out, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(json.dumps({k: out[k] for k in ("fp8_inside_bf16_spread", "fp8_not_above_bf16_max",
                                          "heldout_fp8_minus_bf16", "pass")}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    for name in ("run", "report"):
        p = sub.add_parser(name)
        p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
        p.add_argument("--work", type=Path, required=True)
    sub.choices["run"].add_argument("--parallel", type=int, default=6)
    sub.choices["run"].add_argument("overrides", nargs="*", help="KEY=VALUE overrides for every training")
    sub.choices["report"].add_argument("--json", type=Path)
    sub.choices["report"].add_argument("--png", type=Path)
    sub.choices["report"].add_argument("--slack", type=float, default=0.0,
                                       help="widen bf16's min..max by this share of its range")
    args = ap.parse_args(argv)
    return run(args) if args.what == "run" else report(args)


if __name__ == "__main__":
    raise SystemExit(main())

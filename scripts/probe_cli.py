"""Probe every ``lorafusion`` verb with bad input and faults, as a demanding user would (issue 29).

    python scripts/probe_cli.py [--work DIR] [--jobs 2] [--only SUBSTR] [--json OUT.json]

Trains one short run of the tiny quickstart model (CPU, ~20 s), then runs each case as its own
``python -m lorafusion.cli`` process (this checkout first on PYTHONPATH) and prints a table: case, rc, the first
line of its answer, verdict. Verdicts:

- ``ok``: as expected — a refusal is rc 2 and exactly one ``lorafusion VERB: error: ...`` line on stderr naming
  what the case names (``words``); an accepted case is rc 0 and its own check passes;
- ``SILENT``: a mistake accepted (rc 0), or a check found something wrong (a file replaced, a wrong result);
- ``TRACEBACK``: a Python traceback for a user's mistake; ``HANG``: past the case's time limit;
- ``MISLEADING``: refused, but the line does not name what it should, or several lines; ``CRASH``: another rc;
- ``REFUSED``: a valid request refused.

Cases run as root cannot probe unreadable files (root reads them): those are left out when ``os.geteuid() == 0``.
Exit status: 0 when every case is ``ok``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import probe_cases

ROOT = Path(__file__).resolve().parents[1]
CODE = Path(os.environ.get("PROBE_CODE", ROOT))  # the lorafusion tree probed (--code): this checkout by default


@dataclass
class Case:
    name: str
    argv: list[str]  # after "lorafusion"; "{W}" is the work directory, "{C}" the case's own directory
    expect: str = "err"  # "err" (one error line, rc 2), "ok" (rc 0) or "any" (either)
    words: tuple[str, ...] = ()  # what the error line must name (case-insensitive)
    setup: Callable[[Path, Path], None] | None = None  # (work dir, case dir)
    check: Callable[[Path, Path, subprocess.CompletedProcess], str | None] | None = None  # a silent wrong, or None
    timeout: float = 120.0


def run_cli(argv: list[str], cwd: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env, PYTHONPATH=f"{CODE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "lorafusion.cli", *argv], cwd=cwd, capture_output=True, text=True,
                          errors="replace", timeout=timeout, env=env)


def verdict(case: Case, res: subprocess.CompletedProcess | None, work: Path, cdir: Path) -> tuple[str, str]:
    """(verdict, first line of the answer)."""
    if res is None:
        return "HANG", f"(no answer in {case.timeout:.0f} s)"
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    first = next((ln for ln in err if ln.startswith("lorafusion ")), err[-1] if err else
                 (res.stdout.strip().splitlines() or [""])[0])
    if "Traceback (most recent call last)" in res.stderr:
        return "TRACEBACK", next((ln for ln in reversed(err) if ln.strip() and not ln.startswith(" ")), first)
    while len(err) > 1 and (err[0].startswith("usage: ") or err[0].startswith(" ")):  # argparse's usage: fine
        err.pop(0)
    if case.expect == "any" and res.returncode == 0:
        pass
    elif case.expect == "ok":
        if res.returncode != 0:
            return "REFUSED", first
    else:
        if res.returncode == 0:
            return "SILENT", first or "(rc 0)"
        if res.returncode != 2:
            return "CRASH", first
        verb = case.argv[0]
        errs = [ln for ln in err if ln.startswith(f"lorafusion {verb}: error: ")]
        if len(errs) != 1 or len(err) != 1:
            return "MISLEADING", f"({len(err)} stderr lines) {first}"
        if not all(w.lower() in errs[0].lower() for w in case.words):
            return "MISLEADING", first + f"   [expected to name: {', '.join(case.words)}]"
    if case.check is not None and (why := case.check(work, cdir, res)):
        return "SILENT", f"{why} | {first}"
    return "ok", first


def run_case(case: Case, work: Path) -> dict:
    cdir = work / "cases" / case.name
    cdir.mkdir(parents=True, exist_ok=True)
    argv = [a.replace("{W}", str(work)).replace("{C}", str(cdir)) for a in case.argv]
    t = time.perf_counter()
    try:
        if case.setup is not None:
            case.setup(work, cdir)
        res = run_cli(argv, cdir, case.timeout)
    except subprocess.TimeoutExpired:
        res = None
    v, first = verdict(Case(**{**case.__dict__, "argv": argv}), res, work, cdir)
    return {"case": case.name, "verb": case.argv[0], "rc": None if res is None else res.returncode, "verdict": v,
            "first_line": first, "seconds": round(time.perf_counter() - t, 1)}


def train_base(work: Path) -> None:
    """The shared finished run: work/run (3 jobs, 4 steps, checkpoints every 2 steps of successor)."""
    shutil.copytree(ROOT / "configs" / "quickstart", work / "qs" / "quickstart")
    shutil.copy(ROOT / "configs" / "quickstart.yaml", work / "qs" / "quickstart.yaml")
    res = run_cli(["train", str(work / "qs" / "quickstart.yaml"), *probe_cases.short(work / "run"),
                   "jobs.0.save_every=2"], work, 600)
    if res.returncode != 0:
        sys.exit(f"probe: the base run failed:\n{res.stderr[-3000:]}")


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", help="work directory (default: a new temporary one, removed unless --keep)")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once")
    ap.add_argument("--only", default="", help="only cases whose name contains this")
    ap.add_argument("--json", help="also write the rows as JSON here")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--code", help="probe the lorafusion tree here (e.g. a worktree of an older commit)")
    args = ap.parse_args()
    if args.code:  # (an environment variable: the case set-ups that import this module see it too)
        global CODE
        CODE = Path(args.code).resolve()
        os.environ["PROBE_CODE"] = str(CODE)
    work = Path(args.work or tempfile.mkdtemp(prefix="lf-probe-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not (work / "run" / "summary.json").is_file():
        train_base(work)
    probe_cases.prepare(work)
    before = tree(work / "run")
    cases = [c for c in probe_cases.all_cases(Case) if args.only in c.name]
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    serial = [c for c in cases if c.name.startswith("serial_")]  # cases that time other processes
    print(f"{'case':<44} {'rc':>4}  {'verdict':<10} first line", flush=True)

    def one(c: Case) -> dict:
        r = run_case(c, work)
        print(f"{r['case']:<44} {str(r['rc']):>4}  {r['verdict']:<10} {r['first_line'][:150]}", flush=True)
        return r
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(one, [c for c in cases if c not in serial]))
    rows += [one(c) for c in serial]
    if tree(work / "run") != before:  # every case that reads the shared run must leave it as it was
        rows.append({"case": "shared_run_untouched", "verb": "-", "rc": None, "verdict": "SILENT",
                     "first_line": "the shared run directory changed", "seconds": 0})
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    verbs = sorted({r["verb"] for r in rows})
    print(f"\n{len(rows)} cases over {len(verbs)} verbs ({', '.join(verbs)}) in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if args.json:
        Path(args.json).write_text(json.dumps({"counts": counts, "rows": rows}, indent=1) + "\n")
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if counts.get("ok", 0) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())

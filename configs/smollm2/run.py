"""The SmolLM2 example end to end: train the three adapters, then held-out accuracy of the base alone and of
each adapter, as a table and a JSON file.

    python configs/smollm2/run.py [--out DIR] [--result FILE] [key=value ...]        # or: make real-example

Needs the model directory first (``make real-model``, scripts/get_smollm2.py). Then:

1. ``lorafusion train configs/smollm2.yaml output_dir=DIR [key=value ...]`` (on a GPU with
   ``model.dtype=bfloat16`` unless an override sets the dtype);
2. ``lorafusion generate DIR`` on every prompt of configs/smollm2/heldout.jsonl twice, with its job's adapter
   and without a job (the base alone), all in one batch (greedy);
3. per job: the answers equal to ``expected`` before (base) and after (adapter) training, printed as a table
   and written with the times, the device, the commit and a few answers beside the expected ones (per job
   and side: the first ``--samples`` rows and the first misses) to ``DIR/result.json`` (and
   ``--result FILE``).

``--generate-only`` skips step 1 and answers with the adapters already in ``--out`` (e.g. again with another
``--decode``: generate's decode path, auto by default; ``dynamic`` never takes the CUDA graph).

Exits 1 when a job's adapter is not at least 30 points above the base.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONFIG = HERE.parent / "smollm2.yaml"
HELDOUT = HERE / "heldout.jsonl"
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
MIN_GAIN = 30.0  # points of held-out accuracy each adapter must gain over the base


def lorafusion(*args: str) -> float:
    """Run the CLI in a child process (this checkout first on the path); returns its wall time in seconds."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lorafusion.cli", *args], check=True, env=env, cwd=ROOT)
    return time.perf_counter() - t0


def device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA)"
    return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def compare_prompts(src: Path, dst: Path) -> None:
    """Each held-out row twice: with its job (the adapter) and without (the base; ``task`` keeps the job)."""
    rows = [json.loads(line) for line in src.read_text(encoding="utf-8").splitlines() if line.strip()]
    with open(dst, "w", encoding="utf-8") as f:
        for row in rows:
            base = {k: v for k, v in row.items() if k != "job"} | {"task": row["job"]}
            f.write(json.dumps(row) + "\n" + json.dumps(base) + "\n")


def accuracy(answers: Path) -> dict[str, dict]:
    """Per job: base and adapter [equal to expected, rows] and the accuracies in percent."""
    out: dict[str, dict] = {}
    for line in answers.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        job = row.get("job") or row["task"]
        side = "adapter" if row.get("job") else "base"
        hit = out.setdefault(job, {"base": [0, 0], "adapter": [0, 0]})[side]
        hit[0] += row["output"] == row["expected"]
        hit[1] += 1
    for res in out.values():
        for side in ("base", "adapter"):
            res[f"{side}_accuracy"] = round(100.0 * res[side][0] / res[side][1], 1)
        res["gain_points"] = round(res["adapter_accuracy"] - res["base_accuracy"], 1)
    return out


def samples(answers: Path, first: int) -> dict[str, dict]:
    """Per job and side (adapter, base): the first ``first`` rows and the first ``first`` misses, each as its
    user prompt, the expected answer and the actual output, so that a mismatch can be read in the result."""
    out: dict[str, dict] = {}
    for line in answers.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        job = row.get("job") or row["task"]
        side = out.setdefault(job, {}).setdefault("adapter" if row.get("job") else "base",
                                                  {"first": [], "misses": []})
        prompt = row["messages"][-1]["content"] if row.get("messages") else row.get("prompt")
        item = {"prompt": prompt, "expected": row["expected"], "output": row["output"],
                "output_tokens": len(row["output_ids"])}
        if len(side["first"]) < first:
            side["first"].append(item)
        if row["output"] != row["expected"] and len(side["misses"]) < first:
            side["misses"].append(item)
    return out


def table(acc: dict[str, dict]) -> str:
    lines = ["| job | base (before) | adapter (after) | gain |", "|---|---|---|---|"]
    for job, r in acc.items():
        lines.append(f"| {job} | {r['base'][0]}/{r['base'][1]} ({r['base_accuracy']:.0f}%) | "
                     f"{r['adapter'][0]}/{r['adapter'][1]} ({r['adapter_accuracy']:.0f}%) | "
                     f"{r['gain_points']:+.0f} points |")
    return "\n".join(lines)


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def special_token_errors() -> list[str]:
    """scripts/get_smollm2.py's check of the model directory's special tokens (an eos other than <|im_end|>
    ends every answer one token late: none equal to its expected text)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from get_smollm2 import special_token_errors as errors
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return errors(MODEL)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="the run directory (default: outputs/smollm2/<time>, linked "
                    "from outputs/smollm2/latest)")
    ap.add_argument("--result", type=Path, help="also write the result JSON here")
    ap.add_argument("--max-new-tokens", type=int, default=28)
    ap.add_argument("--decode", choices=["auto", "graph", "static", "dynamic"], default="auto",
                    help="lorafusion generate's decode path (auto: the CUDA graph on a GPU, dynamic on a "
                    "CPU)")
    ap.add_argument("--samples", type=int, default=3, help="answers per job and side written to the result "
                    "(the first ones and the first misses)")
    ap.add_argument("--generate-only", action="store_true", help="no training: answer with the adapters "
                    "already in --out (answers_<decode>.jsonl, result_<decode>.json)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of configs/smollm2.yaml")
    args = ap.parse_args(argv)
    if args.generate_only and (args.out is None or not (args.out / "adapters").is_dir()):
        ap.error("--generate-only: --out must name a trained run directory (with adapters/)")
    return args


def run_dir(args: argparse.Namespace) -> Path:
    out = (args.out or ROOT / "outputs" / "smollm2" / datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()
    if args.out is None:  # outputs/smollm2/latest -> this run, as make demo does for the quickstart
        latest = out.parent / "latest"
        out.parent.mkdir(parents=True, exist_ok=True)
        latest.unlink(missing_ok=True)
        latest.symlink_to(out.name)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    own_model = any(o.startswith("model.path=") for o in args.overrides)
    if not (MODEL / "model.safetensors").is_file() and not own_model:
        print(f"{MODEL}: no model; write it first with: make real-model", file=sys.stderr)
        return 2
    if not own_model and (bad := special_token_errors()):
        print(f"{MODEL}: not the GGUF's special tokens ({bad[0]}); fix it in place with: python "
              f"scripts/get_smollm2.py", file=sys.stderr)
        return 2
    out = run_dir(args)
    overrides = list(args.overrides)
    import torch

    if torch.cuda.is_available() and not any(o.startswith("model.dtype=") for o in overrides):
        overrides.append("model.dtype=bfloat16")
    t0 = time.perf_counter()
    train_s = 0.0 if args.generate_only else lorafusion("train", str(CONFIG), f"output_dir={out}", *overrides)
    tag = f"_{args.decode}" if args.generate_only else ""
    prompts, answers = out / "compare_prompts.jsonl", out / f"answers{tag}.jsonl"
    compare_prompts(HELDOUT, prompts)
    generate_s = lorafusion("generate", str(out), "--prompts", str(prompts), "--out", str(answers),
                            "--max-new-tokens", str(args.max_new_tokens), "--decode", args.decode, "--force")
    acc = accuracy(answers)
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    command = " ".join(["python", str(Path(sys.argv[0]).resolve().relative_to(ROOT)), *sys.argv[1:]])
    result = {"device": device(), "commit": commit(), "command": command, "overrides": overrides,
              "max_new_tokens": args.max_new_tokens, "decode": args.decode, "train_s": round(train_s, 1),
              "generate_s": round(generate_s, 1), "total_s": round(time.perf_counter() - t0, 1),
              "accuracy": acc, "answers": str(answers), "samples": samples(answers, args.samples),
              "summary": summary}
    text = json.dumps(result, indent=1, ensure_ascii=False) + "\n"
    (out / f"result{tag}.json").write_text(text, encoding="utf-8")
    if args.result:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(text, encoding="utf-8")
    report(result, acc, out / f"result{tag}.json")
    short = [job for job, r in acc.items() if r["gain_points"] < MIN_GAIN]
    if short:
        print(f"adapter less than {MIN_GAIN:.0f} points above the base: {', '.join(short)}", file=sys.stderr)
        return 1
    return 0


def report(result: dict, acc: dict[str, dict], path: Path) -> None:
    print(f"\nheld-out answers equal to 'expected' ({HELDOUT.relative_to(ROOT)}, greedy, decode "
          f"{result['decode']}), on {result['device']}:")
    print(table(acc))
    for job, sides in result["samples"].items():  # one miss per job and side, to read what came out
        for side, got in sides.items():
            for miss in got["misses"][:1]:
                print(f"  {job} {side}: expected {miss['expected']!r}, got {miss['output']!r}")
    print(f"train {result['train_s']:.0f} s, generate {result['generate_s']:.0f} s (both include start-up); "
          f"written to {path}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as e:  # the CLI has said why (one line for bad input)
        sys.exit(e.returncode)

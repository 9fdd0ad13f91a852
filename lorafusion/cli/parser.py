"""The ``lorafusion`` command line's arguments: one sub-parser per verb, each argument's help with its default,
each verb's help ending with an example."""

from __future__ import annotations

import argparse

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _int_list(text: str) -> list[int]:
    return [_positive_int(x) for x in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorafusion", description="Train many LoRA adapters of one base model at once.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the adapter jobs of a run YAML")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. scheduler.token_capacity=8192")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of each job")
    t.add_argument("--allow-different-result", action="store_true", help="with --resume: accept changed "
                   "scheduler settings (token_capacity, lookahead_batches, grouping, policy, solver), which pack the "
                   "data otherwise; the result then differs (slightly) from an uninterrupted run")
    t.add_argument("--serve", action="store_true", help="after the last job ends, keep waiting for "
                   "`lorafusion submit` (serve: true; ends after serve_idle_minutes without jobs)")
    pl = sub.add_parser("plan", help="schedule a run's data and draw the plan (no model)")
    pl.add_argument("config")
    pl.add_argument("overrides", nargs="*")
    pl.add_argument("--windows", dest="chunks", type=_positive_int, default=20,
                    help="how many windows (chunks of scheduler.lookahead_batches global batches per job) to plan")
    pl.add_argument("--out", help="directory for tables and charts (default OUTPUT_DIR/plan)")
    pl.add_argument("--gpu-memory", metavar="SIZE[,SIZE...]",
                    help="print the memory plan per pipeline stage for GPUs of this memory (e.g. 80GiB or "
                         "24,48,80,141): capacity and recompute for auto, what does not fit and what would")
    pl.add_argument("--virtual-sweep", type=_int_list, default=None, metavar="V,V,...",
                    help="also simulate these parallelism.virtual_stages with the even and the auto split")
    sb = sub.add_parser("submit", help="add a job to a running (or stopped, before --resume) run")
    sb.add_argument("run_dir", help="the run's output_dir")
    sb.add_argument("job", help="the job's YAML (paths in it are relative to it)")
    sb.add_argument("overrides", nargs="*", help="key=value overrides of the job's keys, e.g. optimizer.lr=1e-4")
    cn = sub.add_parser("cancel", help="end a job of a run at the next chunk boundary (checkpointed, exported)")
    cn.add_argument("run_dir", help="the run's output_dir")
    cn.add_argument("--job", required=True)
    st = sub.add_parser("status", help="where every job of a run stands (running or finished)")
    st.add_argument("run_dir", help="the run's output_dir")
    st.add_argument("--json", action="store_true", help="the status as JSON (as in RUN_DIR/status.json)")
    e = sub.add_parser("export", help="export one job's adapter (PEFT format) from a run or checkpoint, the "
                                      "run's base model (--base) or a job's merged model (--job J --merged)")
    e.add_argument("checkpoint", metavar="RUN_DIR", help="a run output_dir (or one checkpoints/<job>/step_N)")
    e.add_argument("--job", help="the job whose adapter to export")
    e.add_argument("--base", action="store_true", help="the base model in HF format (config.json, safetensors, "
                                                       "tokenizer); the adapters of a preset run point at RUN_DIR/base")
    e.add_argument("--merged", action="store_true", help="with --job: base + adapter merged, in HF format")
    e.add_argument("--best", action="store_true", help="with --job: the job's best-eval checkpoint (jobs with "
                   "eval_dataset/eval_split), not its final adapter")
    e.add_argument("--out", required=True, help="a new directory (an existing one is refused unless --force)")
    e.add_argument("--force", action="store_true", help="replace an earlier export at --out (nothing else), once complete")
    g = sub.add_parser("generate", help="decode prompts with a run's adapters (and base), batched together")
    g.add_argument("run_dir", help="the run's output_dir")
    g.add_argument("--prompts", required=True, help="JSONL: one {\"prompt\": ..., \"job\": NAME or null} per line; a chat "
                   "job's: {\"messages\": [{\"role\": \"user\", \"content\": ...}], \"job\": NAME}; rows with \"expected\" are scored")
    g.add_argument("--out", required=True, help="JSONL written atomically: the input rows plus prompt_ids, "
                   "output_ids and output (an existing file is refused unless --force)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0, help="sampling seed (each row: its own generator)")
    g.add_argument("--batch-size", type=_positive_int, default=64, help="prompts decoded together")
    g.add_argument("--force", action="store_true", help="replace an earlier generate output at --out (nothing else)")
    g.add_argument("--decode", choices=["auto", "graph", "static", "dynamic"], default="auto",
                   help="graph: CUDA graph per token (auto on GPU); static: eagerly; dynamic: live rows (CPU)")
    p.subcommands = sub.choices  # name -> its parser (main's flags_last reads their options)
    return p


def flags_last(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """A flag between key=value overrides would end them (argparse: "unrecognized arguments"): flags, with their
    values, go last, so overrides and flags may come in any order."""
    takes = {o for a in parser.subcommands[argv[0]]._actions if a.nargs != 0 for o in a.option_strings}
    rest, flags, it = [], [], iter(argv)
    for a in it:
        (flags if a.startswith("-") else rest).append(a)
        if a in takes and (value := next(it, None)) is not None:
            flags.append(value)
    return rest + flags

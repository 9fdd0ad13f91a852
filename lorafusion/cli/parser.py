"""The ``lorafusion`` command line's arguments: one sub-parser per verb, every argument with help text and its
default, every verb's help ending with an example. Output of every verb: lines for people on stderr;
``--json`` prints one JSON document for programs on stdout."""

from __future__ import annotations

import argparse


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each argument's help; the epilog's examples as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.required or action.default is argparse.SUPPRESS or "default" in text
                or not action.option_strings and action.nargs is None):
            return text  # required: no default; or the text says it
        if action.default is False:
            return text + " (default: off)"
        if action.default in (None, []):
            return text + " (default: none)"
        return super()._get_help_string(action)


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


def _verb(sub, name: str, summary: str, examples: str):
    return sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".",
                          epilog="example:\n" + examples, formatter_class=_Formatter)


def _json(p) -> None:
    p.add_argument("--json", action="store_true", help="print the result as one JSON document on stdout (the "
                   "lines for people stay on stderr)")


def _train(sub) -> None:
    t = _verb(sub, "train", "train the adapter jobs of a run YAML",
              "  lorafusion train configs/quickstart.yaml output_dir=outputs/run "
              "jobs.countdown.max_steps=60\n  lorafusion train configs/quickstart.yaml "
              "output_dir=outputs/run --resume   # after a stop")
    t.add_argument("config", help="the run YAML (model, parallelism, scheduler, jobs, output_dir)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. scheduler.token_capacity=8192 or "
                   "jobs.countdown.max_steps=60 (with --resume: only what changes)")
    t.add_argument("--resume", action="store_true", help="continue the run in output_dir as it was started "
                   "(the config it recorded, overrides included) from each job's latest checkpoint; pass "
                   "only what you change (each change is named on stderr)")
    t.add_argument("--allow-different-result", action="store_true", help="with --resume: accept changed "
                   "scheduler settings (token_capacity, lookahead_batches, grouping, policy, solver), which "
                   "pack the data otherwise; the result then differs (slightly) from an uninterrupted run")
    t.add_argument("--serve", action="store_true", help="after the last job ends, keep waiting for "
                   "`lorafusion submit` (serve: true; ends after serve_idle_minutes without jobs)")
    _json(t)


def _plan(sub) -> None:
    pl = _verb(sub, "plan",
               "schedule a run's data and draw the plan, or print its memory plan (no model, no GPU)",
               "  lorafusion plan configs/quickstart.yaml --out outputs/plan\n"
               "  lorafusion plan configs/llama3.1-70b-4adapters.yaml --gpus 16 --virtual-sweep 1,2,4\n"
               "  lorafusion plan configs/llama3.1-8b-4adapters.yaml --gpu-memory 24,48,80,141")
    pl.add_argument("config", help="the run YAML to plan")
    pl.add_argument("overrides", nargs="*", help="key=value overrides, e.g. scheduler.token_capacity=8192")
    pl.add_argument("--windows", dest="chunks", type=_positive_int, default=20,
                    help="how many windows (chunks of scheduler.lookahead_batches global batches per job) to "
                         "plan")
    pl.add_argument("--out", help="directory for tables and charts (default: OUTPUT_DIR/plan)")
    pl.add_argument("--gpu-memory", metavar="SIZE[,SIZE...]",
                    help="print the memory plan per pipeline stage for GPUs of this memory (e.g. 80GiB or "
                         "24,48,80,141): capacity and recompute for auto, why, what does not fit and what "
                         "would")
    pl.add_argument("--gpus", type=_positive_int, default=None, metavar="N",
                    help="plan for a launch of N processes (parallelism.dp: auto becomes N / (tp*pp)) "
                         "(default: the config's tp*pp*dp, with dp: auto = 1)")
    pl.add_argument("--virtual-sweep", type=_int_list, default=None, metavar="V,V,...",
                    help="also simulate these parallelism.virtual_stages with the even and the auto split")
    _json(pl)


def _jobs_verbs(sub) -> None:
    sb = _verb(sub, "submit", "add a job to a running (or stopped, before --resume) run",
               "  lorafusion submit outputs/run configs/quickstart/countdown.yaml name=countdown-2 "
               "optimizer.lr=5e-3")
    sb.add_argument("run_dir", help="the run's output_dir")
    sb.add_argument("job", help="the job's YAML (paths in it are relative to it)")
    sb.add_argument("overrides", nargs="*", help="key=value overrides of the job's keys, e.g. "
                                                 "optimizer.lr=1e-4")
    _json(sb)
    cn = _verb(sub, "cancel", "end a job of a run at the next chunk boundary (checkpointed, exported)",
               "  lorafusion cancel outputs/run --job countdown")
    cn.add_argument("run_dir", help="the run's output_dir")
    cn.add_argument("--job", required=True,
                    help="the name of the job to end (as `lorafusion status` lists it)")
    _json(cn)
    st = _verb(sub, "status", "where every job of a run stands (submitted, running or finished)",
               "  lorafusion status outputs/quickstart/latest\n  lorafusion status outputs/quickstart/latest "
               "--json")
    st.add_argument("run_dir", help="the run's output_dir")
    st.add_argument("--json", action="store_true", help="the status as JSON on stdout (as in "
                    "RUN_DIR/status.json, with the submitted jobs not yet started)")


def _export(sub) -> None:
    e = _verb(sub, "export", "export one job's adapter (PEFT format) from a run or checkpoint, the run's "
              "base model (--base) or a job's merged model (--job J --merged)",
              "  lorafusion export outputs/quickstart/latest --job countdown --out "
              "outputs/countdown-adapter\n  lorafusion export outputs/quickstart/latest --base --out "
              "outputs/quickstart/latest/base")
    e.add_argument("checkpoint", metavar="RUN_DIR", help="a run output_dir (or one "
                                                         "checkpoints/<job>/step_NNNNNN)")
    e.add_argument("--job", help="the job whose adapter to export")
    e.add_argument("--base", action="store_true", help="the base model in HF format (config.json, "
                                                       "safetensors, tokenizer); the adapters of a preset "
                                                       "run point at RUN_DIR/base")
    e.add_argument("--merged", action="store_true", help="with --job: base + adapter merged, in HF format")
    e.add_argument("--best", action="store_true", help="with --job: the job's best-eval checkpoint (jobs "
                   "with eval_dataset/eval_split), not its final adapter")
    e.add_argument("--out", required=True, help="a new directory (an existing one is refused unless --force)")
    e.add_argument("--force", action="store_true", help="replace an earlier export at --out (nothing else), "
                   "once complete")
    _json(e)


def _generate(sub) -> None:
    g = _verb(sub, "generate", "decode prompts with a run's adapters (and base), batched together",
              "  lorafusion generate outputs/quickstart/latest --prompts configs/quickstart/heldout.jsonl "
              "--out outputs/answers.jsonl")
    g.add_argument("run_dir", help="the run's output_dir")
    g.add_argument("--prompts", required=True, help="JSONL: one {\"prompt\": ..., \"job\": NAME or null} per "
                   "line; a chat job's: {\"messages\": [{\"role\": \"user\", \"content\": ...}], \"job\": "
                   "NAME}; rows with \"expected\" are scored")
    g.add_argument("--out", required=True, help="JSONL written atomically: the input rows plus prompt_ids, "
                   "output_ids and output (an existing file is refused unless --force)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=128,
                   help="tokens decoded per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens of "
                   "this probability (1: all)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (each row: its own generator)")
    g.add_argument("--batch-size", type=_positive_int, default=64, help="prompts decoded together")
    g.add_argument("--force", action="store_true", help="replace an earlier generate output at --out "
                                                        "(nothing else)")
    g.add_argument("--decode", choices=["auto", "graph", "static", "dynamic"], default="auto",
                   help="graph: a CUDA graph per token (GPU only; auto takes it on a GPU); static: the "
                        "graph's step run eagerly; dynamic: only the unfinished rows each step (auto takes "
                        "it on a CPU)")
    _json(g)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorafusion",
                                description="Train many LoRA adapters of one base model at once.",
                                epilog="example:\n  lorafusion train configs/quickstart.yaml   # then: "
                                       "lorafusion <verb> -h", formatter_class=_Formatter)
    sub = p.add_subparsers(dest="cmd", required=True,
                           metavar="{train,plan,submit,cancel,status,export,generate}")
    for add in (_train, _plan, _jobs_verbs, _export, _generate):
        add(sub)
    p.subcommands = sub.choices  # name -> its parser (main's flags_last reads their options)
    return p


def flags_last(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """A flag between key=value overrides would end them (argparse: "unrecognized arguments"): flags, with
    their values, go last, so overrides and flags may come in any order."""
    takes = {o for a in parser.subcommands[argv[0]]._actions if a.nargs != 0 for o in a.option_strings}
    rest, flags, it = [], [], iter(argv)
    for a in it:
        (flags if a.startswith("-") else rest).append(a)
        if a in takes and (value := next(it, None)) is not None:
            flags.append(value)
    return rest + flags

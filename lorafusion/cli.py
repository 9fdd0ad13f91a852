"""``lorafusion`` command line: train | plan | export.

A :class:`lorafusion.core.errors.UserError` (bad config, data, files or launch) prints one line and exits 2;
any other exception is a bug and shows its traceback."""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

# megatron-core warns at import that Apex / Transformer Engine are absent; the local paths are intended.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")



_ENVIRONMENT_ERRNOS = {errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM,
                       errno.ENOTDIR, errno.EISDIR, errno.EEXIST}


def _load(args):
    from lorafusion.config import load_run_config

    return load_run_config(args.config, args.overrides)


def cmd_train(args) -> int:
    from lorafusion.runtime.trainer import Trainer, remove_partial_outputs

    cfg = _load(args)
    out = Path(cfg.output_dir)
    created = not out.exists()
    trainer = Trainer(cfg, resume=args.resume)
    try:
        summary = trainer.run()
    except BaseException:
        if trainer.owns_output_dir:  # never touch the files of another run that holds the directory
            remove_partial_outputs(out)
            if created and _holds_only_our_lock(out):  # failed before writing anything: leave no trace
                shutil.rmtree(out, ignore_errors=True)
        raise
    if trainer.is_logger:
        if summary["status"] == "stopped":
            print(f"stopped by {summary['stopped_by']}: every job checkpointed in "
                  f"{Path(cfg.output_dir) / 'checkpoints'}; continue with: lorafusion train {args.config} "
                  f"{' '.join(args.overrides)} --resume".replace("  ", " "))
        else:
            print(f"done: {summary['session_tokens']:,} tokens in {summary['elapsed_s']:.1f}s "
                  f"({summary['tokens_per_s']:,.0f} tokens/s), kernels={summary['kernels']}")
        fmt = lambda x: "-" if x is None or x != x else f"{x:.4f}"  # noqa: E731
        for name, j in summary["jobs"].items():
            where = (f"adapter: {Path(cfg.output_dir) / 'adapters' / name}" if j["status"] == "done"
                     else f"{j['status']} at step {j['steps']}/{j['total_steps']}")
            print(f"  {name:<16} steps {j['steps']:>5}  loss {fmt(j['first_loss'])} -> {fmt(j['final_loss'])}  "
                  f"{where}")
    from lorafusion.runtime.dist import destroy_distributed

    destroy_distributed()
    return 0


def _holds_only_our_lock(out: Path) -> bool:
    try:
        return {p.name for p in out.iterdir()} <= {".lock"} and \
            (out / ".lock").read_text().strip() in ("", str(os.getpid()))
    except OSError:
        return False


def cmd_plan(args) -> int:
    from lorafusion.runtime.feed import Feed, load_jobs, scheduler_config
    from lorafusion.runtime.report import write_plan_report

    cfg = _load(args)
    _, jobs = load_jobs(cfg)
    out = Path(args.out) if args.out else Path(cfg.output_dir) / "plan"
    res = write_plan_report(Feed(jobs, scheduler_config(cfg), dp_rank=None), out, max_chunks=args.windows)
    print(f"{'window':>6} {'jobs':>4} {'mbs':>5} {'noops':>5} {'fill':>6} {'imbal':>6} {'bubble':>7} {'plan_s':>7}")
    for w in res["windows"]:
        print(f"{w['window']:>6} {len(w['jobs']):>4} {w['microbatches']:>5} {w['noops']:>5} {w['fill']:>6.3f} "
              f"{w['imbalance'] or 0:>6.3f} {w['simulated_bubble']:>7.3f} {w['plan_s']:>7.3f}")
    charts = "" if any(f.endswith(".png") for f in res["files"]) else " (no chunk planned: no charts)"
    print(f"written to {res['dir']}: {', '.join(res['files'])}{charts}")
    return 0


def cmd_export(args) -> int:
    """Copy a job's PEFT adapter out of a run directory or one checkpoint, atomically."""
    from lorafusion.core.errors import MissingFileError
    from lorafusion.core.errors import ConfigError
    from lorafusion.runtime.checkpoint import latest_checkpoint, read_state
    from lorafusion.runtime.export import write_dir_atomically

    src = Path(args.checkpoint)
    out = Path(args.out)
    if (out.exists() or out.is_symlink()) and not args.force:
        raise ConfigError(f"{out}: --out already exists; choose another path or pass --force to replace it "
                          f"(atomically, once the new export is complete)")
    final = src / "adapters" / args.job
    status = None
    if (src / "summary.json").is_file():
        try:
            status = json.loads((src / "summary.json").read_text()).get("jobs", {}).get(args.job, {}).get("status")
        except (json.JSONDecodeError, AttributeError):
            status = None
    if (src / "adapter" / "adapter_config.json").is_file():  # one checkpoint step directory
        state = read_state(src) if (src / "state.json").is_file() else {}
        if state.get("job", args.job) != args.job:
            raise ConfigError(f"{src}: is a checkpoint of job {state['job']!r}, not of --job {args.job!r}")
        adapter, what = src / "adapter", f"checkpoint at step {state.get('step', '?')}"
    elif (final / "adapter_config.json").is_file() and status in (None, "done", "diverged"):
        adapter = final
        what = "final adapter" if status != "diverged" else "last finite state (the job diverged)"
    elif (src / "checkpoints" / args.job).is_dir():
        ckpt = latest_checkpoint(src / "checkpoints" / args.job)
        if ckpt is None:
            raise MissingFileError(f"{src / 'checkpoints' / args.job}: no complete checkpoint")
        adapter, what = ckpt / "adapter", f"latest checkpoint, step {int(ckpt.name.split('_')[-1])} (the job has " \
                                          f"not finished)"
    else:
        raise MissingFileError(f"{src}: no checkpoint or adapter of job {args.job!r} (expected a run output_dir "
                                f"or a checkpoints/<job>/step_N directory)")
    files = {p.name: (lambda dst, p=p: shutil.copyfile(p, dst)) for p in adapter.iterdir() if p.is_file()}
    if out.is_file() or out.is_symlink():  # --force over a file: the complete new directory, then the swap
        new = write_dir_atomically(out.parent / f".{out.name}.new", files)
        out.unlink()
        os.replace(new, out)
    else:
        out = write_dir_atomically(out, files)
    print(f"exported {what} of job {args.job!r} to {out}", file=sys.stderr)
    print(json.dumps({"job": args.job, "exported": what, "from": str(adapter), "to": str(out)}))
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorafusion", description="Train many LoRA adapters of one base model at once.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the adapter jobs of a run YAML")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. scheduler.token_capacity=8192")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of each job")
    pl = sub.add_parser("plan", help="schedule a run's data and draw the plan (no model)")
    pl.add_argument("config")
    pl.add_argument("overrides", nargs="*")
    pl.add_argument("--windows", type=_positive_int, default=20,
                    help="how many windows (chunks of scheduler.lookahead_batches global batches per job) to plan")
    pl.add_argument("--out", help="directory for tables and charts (default OUTPUT_DIR/plan)")
    e = sub.add_parser("export", help="export one job's adapter (PEFT format) from a run or checkpoint")
    e.add_argument("checkpoint")
    e.add_argument("--job", required=True)
    e.add_argument("--out", required=True, help="a new directory (an existing one is refused unless --force)")
    e.add_argument("--force", action="store_true", help="replace an existing --out once the export is complete")
    return p


# Packed microbatches change size every step: expandable segments keep the CUDA caching allocator from
# fragmenting (8B, 16k-token microbatches on one H200: 97.9 instead of 101.6 GiB reserved at the same
# 92.5 GiB allocated; docs/BENCHMARKS.md). Set before CUDA starts; a user's own setting wins.
ALLOC_CONF = "expandable_segments:True"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"] and "--resume" in argv:
        # a flag between the overrides would end them (argparse: "unrecognized arguments"); it may go anywhere
        argv = [a for a in argv if a != "--resume"] + ["--resume"]
    args = build_parser().parse_args(argv)
    from lorafusion.runtime.control import install_stack_dump

    install_stack_dump()  # kill -USR2 <pid>: every thread's stack on stderr (a hung multi-GPU run)
    handler = {"train": cmd_train, "plan": cmd_plan, "export": cmd_export}[args.cmd]
    from lorafusion.core.errors import UserError

    try:
        return handler(args)
    except UserError as e:  # the user's input (config, data, files, launch): one line; bugs keep their traceback
        print(f"lorafusion {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in _ENVIRONMENT_ERRNOS:
            raise
        # the machine, not the program: a read-only or full disk, a file size limit, a file where a directory
        # should be. Checkpoints and exports are written whole or not at all, so nothing complete is lost.
        where = f" {e.filename}" if e.filename else ""
        code = errno.errorcode.get(e.errno, e.errno)
        print(f"lorafusion {args.cmd}: error: cannot write{where}: {e.strerror or e} ({code}); "
              f"complete checkpoints and exports are intact — fix it and run again (train: --resume continues)",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C (the first one checkpoints and stops cleanly)
        print(f"lorafusion {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""``lorafusion`` command line: train | plan | export | status | generate.

A :class:`lorafusion.core.errors.UserError` (bad config, data, files or launch) prints one line and exits 2;
any other exception is a bug and shows its traceback."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from pathlib import Path

from lorafusion.core.procenv import set_process_env


_ENVIRONMENT_ERRNOS = {errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM,
                       errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG,
                       errno.ELOOP, errno.EBUSY}


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _say(*lines) -> None:
    """Lines for people: stderr (stdout is for --json)."""
    print(*lines, sep="\n", file=sys.stderr, flush=True)


def _result(args, obj) -> None:
    """With --json: the verb's result as one JSON document on stdout."""
    if getattr(args, "json", False):
        print(json.dumps(obj, indent=2, default=str), flush=True)


def _load(args):
    """The run config: the YAML with the overrides, or with --resume the config the run recorded at its start
    with only the changes given now (each one named on stderr); its record for the run directory."""
    from lorafusion.config import load_run_config
    from lorafusion.config.resume import config_record, read_record, resume_config

    cfg = load_run_config(args.config, args.overrides)
    if args.resume and (record := read_record(cfg.output_dir)) is not None:
        cfg, changes = resume_config(args.config, args.overrides, record)
        print(f"lorafusion train: resuming {cfg.output_dir} with the config it recorded at its start"
              + (", changed:" if changes else " (nothing changed)"), file=sys.stderr)
        for line in changes:
            print(f"  {line}", file=sys.stderr)
    args.config_record = config_record(args.config, args.overrides, cfg)  # before any auto is resolved
    cfg.check_world_size()  # the layout against WORLD_SIZE before torch too
    return cfg


def cmd_train(args) -> int:
    from lorafusion.runtime.signals import exit_on_stop_outside_run, stops_held

    exit_on_stop_outside_run()  # a stop while starting or after the end: exit 0, nothing to checkpoint
    cfg = _load(args)  # before torch and Megatron are imported: a config error in well under a second
    if args.serve:  # (a copy with the flag: the loaded config is never written)
        cfg = cfg.model_copy(update={"serve": True})
    from lorafusion.resolve import check_run_on_host
    from lorafusion.scheduler.host import gpu_device_seen

    if not (gpu := gpu_device_seen()):  # the CPU trains it: refused now if the host's memory cannot hold it
        check_run_on_host(cfg)
    with stops_held():  # a stop during torch's import is taken once it is imported
        import torch
    if gpu and not torch.cuda.is_available():  # a GPU this torch cannot use: the CPU trains it after all
        check_run_on_host(cfg)
    with stops_held():
        from lorafusion.rundir.atomic import remove_partial_outputs
        from lorafusion.runtime.trainer import Trainer
    out = Path(cfg.output_dir)
    created = not out.exists()
    if args.allow_different_result and not args.resume:
        from lorafusion.core.errors import ConfigError

        raise ConfigError("--allow-different-result goes with --resume")
    trainer = Trainer(cfg, resume=args.resume, allow_different_result=args.allow_different_result,
                      config_record=args.config_record)
    try:
        summary = trainer.run()
    except BaseException:
        if trainer.owns_output_dir:  # never touch the files of another run that holds the directory
            remove_partial_outputs(out)
            if created and _holds_only_our_lock(out):  # failed before writing anything: leave no trace
                shutil.rmtree(out, ignore_errors=True)
        raise
    if trainer.is_logger:
        _say_summary(args, cfg, summary)
        _result(args, summary)
    from lorafusion.dist import destroy_distributed

    destroy_distributed()
    return 0


def _say_summary(args, cfg, summary: dict) -> None:
    """The end of a training session, for people: how it ended, each job, the next commands."""
    if summary["status"] == "stopped":
        where = " ".join(o for o in args.overrides if o.split("=", 1)[0].strip() == "output_dir")
        _say(f"stopped by {summary['stopped_by']}: every job checkpointed in "
             f"{Path(cfg.output_dir) / 'checkpoints'}; continue with: lorafusion train {args.config} "
             f"{where} --resume (the run recorded its config: pass only what you change)".replace("  ", " "))
    else:
        _say(f"done: {summary['session_tokens']:,} tokens in {summary['elapsed_s']:.1f}s "
             f"({summary['tokens_per_s']:,.0f} tokens/s), kernels={summary['kernels']}")
    fmt = lambda x: "-" if x is None or x != x else f"{x:.4f}"  # noqa: E731
    for name, j in summary["jobs"].items():
        where = (f"adapter: {Path(cfg.output_dir) / 'adapters' / name}" if j["status"] == "done"
                 else f"{j['status']} at step {j['steps']}/{j['total_steps']}")
        _say(f"  {name:<16} steps {j['steps']:>5}  loss {fmt(j['first_loss'])} -> {fmt(j['final_loss'])}  "
             f"{where}")
    if cfg.model.preset:  # the adapters name RUN_DIR/base as their base model
        out = Path(cfg.output_dir)
        _say(f"  base model (HF format, for peft/transformers): lorafusion export {out} --base --out "
             f"{out / 'base'}")
    _say(f"try them: lorafusion generate {cfg.output_dir} --prompts FILE.jsonl --out OUT.jsonl  "
         f"(one {{\"prompt\": ..., \"job\": NAME}} per line; a chat job: {{\"messages\": [{{\"role\": "
         f"\"user\", \"content\": ...}}], \"job\": NAME}}; lorafusion generate -h)")


def _holds_only_our_lock(out: Path) -> bool:
    try:
        return {p.name for p in out.iterdir()} <= {".lock"} and \
            (out / ".lock").read_text().strip() in ("", str(os.getpid()))
    except OSError:
        return False


def _plan_memory(args) -> int:
    """``lorafusion plan RUN.yaml --gpu-memory SIZES``: the run's plan (memory per stage) for each GPU size,
    as ``train`` prints it on such a GPU (torch-free: no data, no model)."""
    from lorafusion.config import load_run_config
    from lorafusion.core.errors import ConfigError
    from lorafusion.resolve import GpuMemory, World, resolve
    from lorafusion.scheduler.sizing import parse_bytes

    try:
        sizes = [parse_bytes(x) for x in args.gpu_memory.split(",")]
    except ValueError as e:
        raise ConfigError(f"--gpu-memory: {e}") from None
    cfg = load_run_config(args.config, args.overrides, check_files=False)
    world = World.for_plan(cfg, args.gpus)
    plans = [resolve(cfg, world, GpuMemory(size, size)) for size in sizes]
    _say("\n\n".join("\n".join(plan.lines()) for plan in plans))
    _result(args,
            {"gpu_memory_gib": [round(x / (1 << 30), 2) for x in sizes], "fits": all(p.fits for p in plans),
             "plans": [p.to_dict() for p in plans]})
    return 0


def cmd_plan(args) -> int:
    if args.gpu_memory:  # the memory plan per stage for these GPU sizes: no data, no model, no GPU
        return _plan_memory(args)
    from lorafusion.config import load_run_config
    from lorafusion.resolve import World, resolve

    cfg = load_run_config(args.config, args.overrides)  # before torch is imported
    # no processes are launched: the config's own layout (dp: auto = 1 replica) or --gpus N processes
    run_plan = resolve(cfg, world := World.for_plan(cfg, args.gpus), None)  # as `train` without a GPU
    from lorafusion.rundir.atomic import check_writable_dir
    from lorafusion.runtime.feed import Feed
    from lorafusion.runtime.jobs import load_jobs
    from lorafusion.runtime.telemetry.report import Progress, stage_model, write_plan_report

    out = Path(args.out) if args.out else Path(cfg.output_dir) / "plan"
    check_writable_dir(out, f"{out}: --out")  # before the work
    stage = stage_model(cfg, run_plan)
    jobs = load_jobs(cfg)[1]  # (a data error: its one line, nothing before it)
    _say("\n".join(run_plan.lines()))
    args.progress = Progress()
    res = write_plan_report(Feed(jobs, run_plan.scheduler, dp_rank=None), out,
                            max_chunks=args.chunks, stage=stage, progress=args.progress)
    _say(f"{'window':>6} {'jobs':>4} {'mbs':>5} {'noops':>5} {'fill':>6} {'imbal':>6} {'bubble':>7} "
         f"{'plan_s':>7}")
    for c in res["chunks"]:
        _say(f"{c['window']:>6} {len(c['jobs']):>4} {c['microbatches']:>5} {c['noops']:>5} {c['fill']:>6.3f} "
             f"{c['imbalance'] or 0:>6.3f} {c['simulated_bubble']:>7.3f} {c['plan_s']:>7.3f}")
    charts = "" if any(f.endswith(".png") for f in res["files"]) else " (no chunk planned: no charts)"
    _say("  (window: a chunk; noops: empty slots keeping a job's next batch behind its optimizer step; fill: "
         "mean share of the token capacity used;\n   imbal: largest microbatch / mean; bubble: simulated "
         "idle share of pipeline time)")
    _say(f"written to {res['dir']}: {', '.join(res['files'])}{charts}")
    pipeline = _print_pipeline(cfg, world, stage, res, args, out)
    _result(args,
            {"run_plan": run_plan.to_dict(), "dir": res["dir"], "files": res["files"],
             "windows": res["chunks"], **pipeline})
    return 0


def _print_pipeline(cfg, world, stage, res, args, out: Path) -> dict:
    """The simulated steady bubble per stage of the run's pipeline, and with --virtual-sweep the best V/split;
    returned for --json."""
    from lorafusion.runtime.telemetry.report import steady_bubble, sweep_virtual
    from lorafusion.scheduler.stages import CALIBRATION

    if cfg.parallelism.pp == 1 or (b := steady_bubble(res["chunks"])) is None:
        return {}
    found = {
        "pipeline": {"pp": cfg.parallelism.pp, "virtual_stages": stage.virtual_stages,
                     "stage_layers": stage.split, "steady_bubble": b[0], "steady_bubble_per_stage": b[1]}}
    _say(f"pipeline: pp={cfg.parallelism.pp} virtual_stages={stage.virtual_stages} "
         f"stage_layers={stage.split} (output layer + loss = {stage.loss_layers:.2f} layers of work on the "
         "last)")
    _say(f"simulated steady bubble {b[0]:.3f}, per stage {' '.join(f'{x:.3f}' for x in b[1])}  "
         f"[{CALIBRATION}]")
    if args.virtual_sweep:
        rows = sweep_virtual(cfg, world, args.virtual_sweep, args.chunks, out / "sweep",
                             progress=args.progress,
                             planned={stage.virtual_stages: res["planned"]})  # the run's V: planned above
        _say(f"{'V':>3} {'split':>5} {'bubble':>7}  per stage / stage_layers")
        for r in rows:
            _say(f"{r['virtual_stages']:>3} {r['split']:>5} {r['bubble']:>7.3f}  "
                 f"{' '.join(f'{x:.3f}' for x in r['bubble_per_stage'])}  {r['stage_layers']}")
        if rows:
            best = min(rows, key=lambda r: r["bubble"])
            _say(f"best: parallelism.virtual_stages={best['virtual_stages']} parallelism.stage_layers="
                 f"{best['split'] if best['split'] == 'auto' else 'null'} (simulated {best['bubble']:.3f})")
        found["virtual_sweep"] = rows
    return found


def cmd_submit(args) -> int:
    """Validate the job now (one clear error, the run untouched), then queue it for the run."""
    from lorafusion.config.load import load_job_config
    from lorafusion.rundir.requests import check_against_run, check_submission, require_run_dir, write_request

    job = load_job_config(args.job, args.overrides, check_files=True)
    run = Path(args.run_dir)
    require_run_dir(run)
    check_submission(run, job.name)
    check_against_run(run, job)  # capacity, memory, data: what the run would refuse is refused now
    path = write_request(run, "submit", {"name": job.name, "job": job.model_dump(mode="json")})
    _say(f"submitted job {job.name!r} to {run}: it joins at the next chunk boundary "
         f"(a stopped run takes it when resumed); watch it with: lorafusion status {run}")
    _result(args, {"submitted": job.name, "run": str(run), "request": str(path)})
    return 0


def cmd_cancel(args) -> int:
    from lorafusion.rundir.requests import check_cancel, require_run_dir, write_request

    run = Path(args.run_dir)
    require_run_dir(run)
    check_cancel(run, args.job)
    path = write_request(run, "cancel", {"job": args.job})
    _say(
        f"cancel of job {args.job!r} queued: it leaves {run} at the next chunk boundary, checkpointed and "
        "exported")
    _result(args, {"cancel": args.job, "run": str(run), "request": str(path)})
    return 0


def cmd_status(args) -> int:
    from lorafusion.rundir.status import format_status, read_status

    status = read_status(Path(args.run_dir))
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        _say(format_status(status, Path(args.run_dir)))
    return 0


def _run_dir_of(src: Path) -> Path:
    """The run directory of ``src``: itself, or the run a checkpoints/<job>/step_N directory belongs to."""
    from lorafusion.export.hf import RECORD

    if (not (src / RECORD).is_file() and (src / "state.json").is_file()
            and (src.parents[2] / RECORD).is_file()):
        return src.parents[2]
    return src


def cmd_export(args) -> int:
    """Copy a job's PEFT adapter out of a run directory or one checkpoint, or write the run's base model or
    a job's adapter merged into it (HF format); atomically, never over an existing --out without --force."""
    from lorafusion.core.errors import ConfigError
    from lorafusion.core.lora import check_adapter_name
    from lorafusion.rundir.adapters import check_export_out, check_replace_out, find_adapter, marked
    from lorafusion.rundir.atomic import copier, fill_dir_atomically

    src = Path(args.checkpoint)
    out = Path(args.out)
    if args.base and (args.job or args.merged or args.best):
        raise ConfigError("--base exports the base model alone; it takes no --job, --merged or --best")
    if args.merged and not args.job:
        raise ConfigError("--merged needs --job J (the adapter to merge into the base)")
    if not args.base and not args.job:
        raise ConfigError("expected --job J (its adapter; with --merged, merged into the base) or --base")
    if args.job is not None:
        try:
            check_adapter_name(args.job, "--job")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    check_export_out(src, out, base=args.base)
    # --force: an earlier export only, never a user's own file or directory
    check_replace_out(out, args.force)
    note = ""
    if args.base:
        from lorafusion.export.hf import write_base

        fill, what = write_base(src, out)
        adapter, kind = None, "base"
    else:
        adapter, what = find_adapter(src, args.job, best=args.best)
        if args.merged:
            from lorafusion.export.hf import fp8_note, read_record, write_merged

            fill, _ = write_merged(_run_dir_of(src), adapter)
            # an FP8-trained base: merged into the original weights
            note = fp8_note(read_record(_run_dir_of(src)))
            kind = "merged"
        else:
            fill = copier(adapter)
            kind = "adapter"
    out = fill_dir_atomically(out, marked(fill, {"kind": kind, "job": args.job, "from": str(adapter or src)}),
                              replace=args.force)
    job = f" of job {args.job!r}" if args.job else ""
    what = f"{what}{job}{' merged into the base' + note if kind == 'merged' else ''}"
    _say(f"exported {what} to {out}")
    _result(args,
            {"job": args.job, "kind": kind, "exported": what, "from": str(adapter) if adapter else str(src),
             "to": str(out)})
    return 0


def cmd_generate(args) -> int:
    from lorafusion.inference.generate import generate_file

    kw = {k: getattr(args, k)
          for k in ("max_new_tokens", "temperature", "top_p", "seed", "batch_size", "force", "decode")}
    res = generate_file(args.run_dir, args.prompts, args.out, **kw)
    print(f"generated {res['new_tokens']:,} tokens for {res['rows']} prompts "
          f"({', '.join(res['jobs']) or 'base only'}) in {res['generate_s']:.1f}s "
          f"({res['tokens_per_s']:,.0f} tokens/s); written to {res['out']}", file=sys.stderr)
    # rows with "expected"
    if hits := ", ".join(f"{job} {hit}/{n}" for job, (hit, n) in res["expected"].items()):
        print(f"outputs equal to 'expected': {hits}", file=sys.stderr)
    _result(args, res)
    return 0


def main(argv: list[str] | None = None) -> int:
    set_process_env()  # the allocator and OpenMP settings every training process runs with (core/procenv.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    from lorafusion.cli.parser import build_parser, flags_last

    parser = build_parser()
    if argv[:1] in (["train"], ["plan"], ["submit"]):
        argv = flags_last(parser, argv)
    args = parser.parse_args(argv)
    from lorafusion.runtime.signals import install_stack_dump

    install_stack_dump()  # kill -USR2 <pid>: every thread's stack on stderr (a hung multi-GPU run)
    handler = {"train": cmd_train, "plan": cmd_plan, "export": cmd_export, "status": cmd_status,
               "submit": cmd_submit, "cancel": cmd_cancel, "generate": cmd_generate}[args.cmd]
    from lorafusion.core.errors import UserError

    try:
        return handler(args)
    except UserError as e:
        # the user's input (config, data, files, launch): one line; bugs keep their traceback
        print(f"lorafusion {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in _ENVIRONMENT_ERRNOS:
            raise
        # the machine, not the program: a read-only or full disk, a file size limit, a file where a directory
        # should be. Checkpoints and exports are written whole or not at all, so nothing complete is lost.
        # a copy's error names the source first (shutil): the destination is what a full disk refuses
        name = e.filename2 if e.filename2 and e.errno in _FULL else e.filename
        where = f" {name}" if name else ""
        code = errno.errorcode.get(e.errno, e.errno)
        verb = "cannot write" if e.errno in _FULL + (errno.EROFS,) else "cannot access"
        print(f"lorafusion {args.cmd}: error: {verb}{where}: {e.strerror or e} ({code}); "
              "complete checkpoints and exports are intact — fix it and run again (train: --resume "
              "continues)",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C (the first one checkpoints and stops cleanly)
        print(f"lorafusion {args.cmd}: interrupted", file=sys.stderr)
        return 130

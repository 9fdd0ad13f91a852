"""Which adapter of a run ``lorafusion export`` and ``generate`` take: a job's final adapter, its latest or
best checkpoint's, or one checkpoint directory's (torch-free: the lookup runs before anything is loaded)."""

from __future__ import annotations

import json
from pathlib import Path

from lorafusion.core.errors import ConfigError, MissingFileError
from lorafusion.rundir.atomic import check_writable_dir
from lorafusion.rundir.integrity import check_adapter
from lorafusion.rundir.layout import RunDir, best_checkpoint, latest_checkpoint, read_state
from lorafusion.rundir.states import ENDED, JobStatus


def run_jobs(src: Path) -> list[str]:
    """The jobs a run directory knows of (its adapters, checkpoints and summary)."""
    run = RunDir(src)
    names = {p.name for d in (run.adapters, run.checkpoints) if d.is_dir() for p in d.iterdir()
             if p.is_dir() and not p.name.startswith(".")}
    # (a live run's jobs are in its status before any file is written)
    for record in (run.summary, run.status):
        try:
            names |= {n for n in json.loads(record.read_text()).get("jobs", {}) if isinstance(n, str)}
        except (OSError, ValueError, AttributeError, TypeError):
            pass
    return sorted(names)


def _nothing_yet(src: Path, job: str) -> str | None:
    """Why a job that the run's status.json lists has nothing to export: it has no complete checkpoint yet."""
    try:
        row = json.loads(RunDir(src).status.read_text())["jobs"][job]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    where = (f"{row.get('state')} at step {row.get('step')}" if isinstance(row, dict)
             else "listed in status.json")
    return (f"{src}: job {job!r} has no checkpoint yet ({where}): nothing to export yet; it is checkpointed "
            "at its save_every, every checkpoint.every_minutes, when it ends or is cancelled, and when the "
            "run is stopped")


def check_safetensors(path: Path) -> None:
    """MissingFileError unless ``path`` is a whole safetensors file: its header parses and its length is the
    header's plus the tensors' (a truncated copy, a failed write; torch-free, reads the header only)."""
    import struct

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0] if size >= 8 else None
            if n is None or n > min(size - 8, 100 << 20):
                raise MissingFileError(
                    f"{path}: truncated or damaged: {size:,} bytes, too short for its header")
            header = json.loads(f.read(n))
        end = max([v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"], default=0)
    except MissingFileError:
        raise
    except OSError as e:
        raise MissingFileError(f"{path}: cannot read ({e.strerror or e})") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise MissingFileError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if size != 8 + n + end:
        raise MissingFileError(f"{path}: truncated or damaged: {size:,} bytes, its header describes "
                               f"{8 + n + end:,}")


def find_adapter(src: Path, job: str, best: bool = False) -> tuple[Path, str]:
    """(PEFT adapter directory, what it is) of ``job`` in a run directory or one checkpoint step directory;
    ``best``: its best-eval checkpoint's (a run directory only). The adapter's weights must be whole."""
    adapter, what = _find_adapter(src, job, best)
    check_adapter(adapter)  # (against the hashes the run recorded: a damaged or edited file is never used)
    if (weights := adapter / "adapter_model.safetensors").is_file():
        check_safetensors(weights)
    if (config := adapter / "adapter_config.json").is_file():  # (copied as is, it would load nowhere)
        try:
            if not isinstance(json.loads(config.read_text(encoding="utf-8")), dict):
                raise ValueError("expected a JSON object")
        except (OSError, ValueError) as e:
            raise MissingFileError(f"{config}: damaged: not a readable adapter config ({e})") from None
    return adapter, what


def _find_adapter(src: Path, job: str, best: bool) -> tuple[Path, str]:
    if not src.is_dir():
        raise MissingFileError(f"{src}: no checkpoint or adapter of job {job!r}: no such directory (expected "
                               f"a run output_dir or a checkpoints/<job>/step_N directory)")
    run = RunDir(src)
    if best:
        if (src / "state.json").is_file():
            raise ConfigError(f"{src}: --best takes a run output_dir, not one checkpoint directory")
        ckpt = best_checkpoint(run.job_checkpoints(job))
        if ckpt is None:
            known = run_jobs(src)
            raise MissingFileError(f"{src}: no best-eval checkpoint of job {job!r} " + (
                "(the job has no eval set — eval_dataset or eval_split — or was not evaluated yet)"
                if job in known else f"(unknown job; the run's jobs: {', '.join(known) or 'none'})"))
        state = json.loads((ckpt / "state.json").read_text())
        best = (state.get("eval") or {}).get("best")
        shown = f"{best:.4f}" if isinstance(best, float) else best  # as status and the eval lines show it
        return ckpt / "adapter", f"best-eval checkpoint, step {state.get('step')} (eval loss {shown})"
    final = run.adapter(job)
    status = None
    if run.summary.is_file():
        try:
            status = json.loads(run.summary.read_text()).get("jobs", {}).get(job, {}).get("status")
        except (json.JSONDecodeError, AttributeError):
            status = None
    if (src / "adapter" / "adapter_config.json").is_file():  # one checkpoint step directory
        state = read_state(src) if (src / "state.json").is_file() else {}
        if state.get("job", job) != job:
            raise ConfigError(f"{src}: is a checkpoint of job {state['job']!r}, not of --job {job!r}")
        return src / "adapter", f"checkpoint at step {state.get('step', '?')}"
    if (final / "adapter_config.json").is_file() and (status is None or status in ENDED):
        return final, {JobStatus.DIVERGED: "last finite state (the job diverged)",
                       JobStatus.CANCELLED: "adapter at its cancellation",
                       JobStatus.EARLY_STOPPED: "adapter at its early stop"}.get(status, "final adapter")
    if run.job_checkpoints(job).is_dir():
        ckpt = latest_checkpoint(run.job_checkpoints(job))
        if ckpt is None:
            raise MissingFileError(_nothing_yet(src, job)
                                   or f"{run.job_checkpoints(job)}: no complete checkpoint")
        return ckpt / "adapter", (f"latest checkpoint, step {int(ckpt.name.split('_')[-1])} (the job has not "
                                  f"finished)")
    if why := _nothing_yet(src, job):
        raise MissingFileError(why)
    known = run_jobs(src)
    if known:
        raise ConfigError(f"{src}: unknown job {job!r}; the run's jobs: {', '.join(known)}")
    raise MissingFileError(f"{src}: no checkpoint or adapter of job {job!r} (expected a run output_dir "
                           f"or a checkpoints/<job>/step_N directory)")


def check_export_out(src: Path, out: Path, base: bool) -> None:
    """``--out`` (replaced with --force) never holds nor lies inside the run it exports from — except RUN/base
    for --base, the base the adapters of a preset run name — and is never another run's directory."""
    try:
        o = out.resolve()
        step = src.resolve()  # a checkpoints/<job>/step_N directory: its run is protected too
        runs = {step} | ({step.parents[2]} if (src / "state.json").is_file()
                         and step.parents[1].name == "checkpoints"
                         else set())
    except (OSError, RuntimeError, IndexError) as e:
        raise ConfigError(f"{out}: cannot resolve --out or the directory {src} it exports from "
                          f"({e})") from None
    for run in runs:
        if o == run or o in run.parents:
            raise ConfigError(
                f"{out}: --out holds the directory {run} it exports from; choose a path outside it")
        if run in o.parents and not (base and o == run / "base"):
            raise ConfigError(
                f"{out}: --out is inside the directory {run} it exports from; choose a path outside it")
    if out.is_dir() and any((out / n).exists()
                            for n in ("status.json", "summary.json", "checkpoints", ".lock")):
        raise ConfigError(f"{out}: --out is a lorafusion run directory; export replaces only exports, choose "
                          f"another path")


# written into every export: `--force` replaces a directory holding it (an earlier export) and nothing else
EXPORT_MARKER = ".lorafusion-export.json"


def check_replace_out(out: Path, force: bool) -> None:
    """An existing ``--out`` is replaced only with ``force`` and only when it is an earlier
    ``lorafusion export`` (a directory holding :data:`EXPORT_MARKER`) or an empty directory: never a user's
    own file or directory."""
    if not (out.exists() or out.is_symlink()):
        return check_writable_dir(out.parent, f"{out}: --out")
    if not force:
        raise ConfigError(f"{out}: --out already exists; choose another path or pass --force to replace it "
                          f"(an earlier lorafusion export only; atomically, once the new export is complete)")
    if out.is_symlink() or not out.is_dir():
        kind = ("a symlink" if out.is_symlink() else "a file" if out.is_file()
                else "a special file (FIFO, device)")
        raise ConfigError(f"{out}: --out is {kind}, not an earlier lorafusion export; --force replaces only "
                          f"those: choose another path")
    try:
        empty = not any(out.iterdir())
    except OSError as e:
        raise ConfigError(f"{out}: cannot list --out ({e.strerror or e})") from None
    if not empty and not (out / EXPORT_MARKER).is_file():
        raise ConfigError(f"{out}: --out is not an earlier lorafusion export (no {EXPORT_MARKER}); --force "
                          f"replaces only those: choose another path")


def marked(fill, record: dict):
    """``fill`` (for :func:`lorafusion.rundir.atomic.fill_dir_atomically`) that also writes the export
    marker."""
    def fill_marked(tmp: Path) -> None:
        fill(tmp)
        (tmp / EXPORT_MARKER).write_text(
            json.dumps({"written_by": "lorafusion export", **record}, indent=2) + "\n")

    return fill_marked


def check_generate_out(out: Path, prompts: Path, force: bool) -> None:
    """``generate --out`` is new, or (with ``force``) an earlier ``generate`` output (rows with prompt_ids and
    output_ids) or an empty file — never the --prompts file, a user's own file, a directory or a symlink; and
    its directory can be written."""
    if not (out.exists() or out.is_symlink()):
        return check_writable_dir(out.parent, f"{out}: --out")
    if not force:
        raise ConfigError(f"{out}: --out already exists; choose another path or pass --force to replace it "
                          f"(an earlier generate output only)")
    if out.resolve() == prompts.resolve():
        raise ConfigError(f"{out}: --out is the --prompts file; choose another path")
    if out.is_symlink() or not out.is_file():
        kind = ("a symlink" if out.is_symlink() else "a directory" if out.is_dir()
                else "a special file (FIFO, device)")
        raise ConfigError(f"{out}: --out is {kind}, not an earlier generate output; --force replaces only "
                          f"those: choose another path")
    try:
        with open(out, "rb") as f:
            first = next((line for line in f if line.strip()), b"")
        row = json.loads(first) if first else {"prompt_ids": [], "output_ids": []}
    except (OSError, ValueError):
        row = None
    if not (isinstance(row, dict) and "prompt_ids" in row and "output_ids" in row):
        raise ConfigError(f"{out}: --out is not an earlier lorafusion generate output (rows with prompt_ids "
                          f"and output_ids); --force replaces only those: choose another path")

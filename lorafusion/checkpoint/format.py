"""Per-job checkpoints, complete or absent: written to a temporary directory, renamed when complete.

Layout: ``OUTPUT_DIR/checkpoints/<job>/step_<NNNNNN>/`` with
``adapter/`` (PEFT export of the adapter at that step), ``rank_tp<T>_pp<P>.pt`` (this model-parallel
rank's adapter tensors, optimizer and lr-scheduler state) and ``state.json`` (step, data position,
seed, parallel layout; ``together``: the steps of the jobs checkpointed at the same boundary, which a resume
checks agree, checkpoint/consistent.py), and ``manifest.json`` (the sha256 of every other file, written last:
a resume, export and generate check the files they read against it, so a damaged or edited one is never
believed; a checkpoint without one is not used). ``adapter/`` also holds ``.lorafusion-sha256.json`` (its
files' sha256: ``adapters/<job>/``, a copy, is checked against it; rundir/integrity.py).
``OUTPUT_DIR/checkpoints/<job>/latest`` names the newest complete one, ``best`` (jobs
with an eval set) the one of the best eval loss so far; pruning never removes either.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from lorafusion.core.errors import MissingFileError
from lorafusion.dist import is_rank0, multi_process
from lorafusion.rundir.atomic import file_sha256, write_bytes, write_text_atomic
from lorafusion.rundir.integrity import MANIFEST, check_manifest
from lorafusion.rundir.layout import best_checkpoint, latest_checkpoint, read_state, step_name


def _barrier():
    if multi_process():
        dist.barrier()


def _rank_file() -> str:
    return (f"rank_tp{parallel_state.get_tensor_model_parallel_rank()}"
            f"_pp{parallel_state.get_pipeline_model_parallel_rank()}.pt")


def save_job_checkpoint(job_dir: Path, step: int, *, adapter_params: dict[str, torch.Tensor],
                        optimizer_state: dict,
                        state: dict, adapter: tuple | None, keep_last: int | None = None) -> Path | None:
    """The checkpoint written now (collective over all ranks): :func:`start_job_checkpoint`'s write run at
    once, every rank returning once it is in place (rank 0 gets its path). ``adapter``: rank 0's
    ``peft_adapter_snapshot`` of the job (collective; None elsewhere)."""
    write = start_job_checkpoint(job_dir, step, adapter_params=adapter_params,
                                 optimizer_state=optimizer_state,
                                 state=state, adapter=adapter, keep_last=keep_last)
    final = write()
    _barrier()
    return final


def start_job_checkpoint(job_dir: Path, step: int, *, adapter_params: dict[str, torch.Tensor],
                         optimizer_state: dict,
                         state: dict, adapter: tuple | None, keep_last: int | None = None,
                         wait_s: float = 600.0) -> Callable[[], Path | None]:
    """A job's checkpoint in two halves — the one writer, run at once by :func:`save_job_checkpoint` or on a
    background thread for a write that must not stall training. This call is collective and quick: the
    temporary directory is made and this rank's tensors and optimizer state are copied to host memory. It
    returns the write, which calls no collectives: each writing rank's file appears in the temporary
    directory complete (renamed when written); rank 0 waits up to ``wait_s`` for every model-parallel rank's
    file there, writes the adapter (``adapter``: rank 0's ``peft_adapter_snapshot``) and ``state.json``, and
    renames the directory into place."""
    from lorafusion.export.peft import write_peft_adapter

    job_dir = Path(job_dir)
    final, tmp = _step_dirs(job_dir, step)
    rank0 = is_rank0()
    _make_tmp(job_dir, tmp, rank0)
    writer = parallel_state.get_data_parallel_rank() == 0
    host = _to_host({"adapter": {k: v.detach() for k, v in adapter_params.items()},
                     "optimizer": optimizer_state}) if writer else None
    expected = [f"rank_tp{t}_pp{p}.pt" for t in range(parallel_state.get_tensor_model_parallel_world_size())
                for p in range(parallel_state.get_pipeline_model_parallel_world_size())]

    def write() -> Path | None:
        try:
            if rank0:  # the adapter first: the file users read, so a full disk names it before the rank files
                write_peft_adapter(tmp / "adapter", *adapter)
                (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
            if writer:
                _write_rank_file(tmp, host)
            if not rank0:
                return None
            deadline = time.monotonic() + wait_s
            while missing := [n for n in expected if not (tmp / n).is_file()]:
                if time.monotonic() > deadline:
                    raise MissingFileError(f"{tmp}: {', '.join(missing)} not written by their ranks within "
                                           f"{wait_s:.0f} s; the checkpoint of step {step} is incomplete")
                time.sleep(0.02)
        except BaseException:
            _drop_tmp(job_dir, tmp, rank0)
            raise
        _install(job_dir, final, tmp, keep_last)
        return final

    return write


def _step_dirs(job_dir: Path, step: int) -> tuple[Path, Path]:
    return job_dir / step_name(step), job_dir / f".{step_name(step)}.tmp"


def _make_tmp(job_dir: Path, tmp: Path, rank0: bool) -> None:
    """A fresh temporary step directory, there for every rank once this returns (collective)."""
    if rank0:
        job_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()


def _drop_tmp(job_dir: Path, tmp: Path, rank0: bool) -> None:
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        try:  # the job's first checkpoint failed: an empty job_dir would mark output_dir as holding a run
            job_dir.rmdir()
        except OSError:
            pass


def _write_rank_file(tmp: Path, tensors: dict) -> None:
    """This model-parallel rank's file: serialised in memory, written by Python (a full disk or ``ulimit -f``
    is an OSError naming the file; torch's own file writer raises an anonymous RuntimeError), under a
    temporary name, then renamed (rank 0 waits for it to appear)."""
    buf = io.BytesIO()
    torch.save(tensors, buf)
    target = tmp / _rank_file()
    part = tmp / f".{target.name}.part"
    write_bytes(part, buf.getbuffer())
    os.replace(part, target)


def _install(job_dir: Path, final: Path, tmp: Path, keep_last: int | None) -> None:
    """Rank 0: the complete temporary directory becomes ``final``, named by ``latest``; older ones pruned."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(tmp)): file_sha256(p) for p in files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_text_atomic(job_dir / "latest", final.name + "\n")
    if keep_last:
        prune_checkpoints(job_dir, keep_last)





def _check_manifest(path: Path, names: list[str]) -> None:
    """DamagedFileError (a MissingFileError) unless the files ``names`` of checkpoint ``path`` are those its
    manifest records; a checkpoint without a manifest is not believed (rundir/integrity.py)."""
    check_manifest(path, names)


def _to_host(obj):
    """A copy of a (nested) state in host memory: tensors copied to the CPU, containers rebuilt."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def prune_checkpoints(job_dir: Path, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` complete ``step_*`` directories (never the ones ``latest`` and
    ``best`` name)."""
    job_dir = Path(job_dir)
    kept = {(job_dir / n).read_text().strip() for n in ("latest", "best") if (job_dir / n).is_file()}
    steps = sorted(p for p in job_dir.glob("step_*") if p.is_dir() and (p / "state.json").is_file())
    for p in steps[:-keep_last]:
        if p.name not in kept:
            shutil.rmtree(p, ignore_errors=True)


def mark_best(job_dir: Path, step: int) -> None:
    """Name checkpoint ``step_<step>`` (complete) as the job's best-eval checkpoint (``job_dir/best``)."""
    write_text_atomic(Path(job_dir) / "best", f"{step_name(step)}\n")


def load_newest_usable(job_dir: Path) -> tuple[Path | None, dict | None, dict | None, list[tuple[Path, str]]]:
    """The newest checkpoint of a job that loads: ``latest`` first, then the ``step_*`` directories newest
    first. Returns (path, state, tensors, [(skipped path, why)]); path None when there is no checkpoint."""
    job_dir = Path(job_dir)
    pointer = job_dir / "latest"
    candidates: list[Path] = []
    if pointer.is_file():
        try:
            candidates.append(job_dir / pointer.read_text().strip())
        except (OSError, UnicodeDecodeError):
            pass
    candidates += [p for p in sorted(job_dir.glob("step_*"), reverse=True) if p not in candidates]
    skipped = []
    for path in candidates:
        try:
            if not (path / "state.json").is_file():
                raise MissingFileError(f"{path / 'state.json'}: missing")
            state, tensors = load_job_checkpoint(path)
            return path, state, tensors, skipped
        except (MissingFileError, OSError, ValueError, RuntimeError, EOFError, KeyError) as e:
            skipped.append((path, str(e).splitlines()[0] if str(e) else type(e).__name__))
    if skipped:
        raise MissingFileError(f"{job_dir}: no usable checkpoint: " +
                               "; ".join(f"{p.name}: {why}" for p, why in skipped))
    return None, None, None, skipped


def load_job_checkpoint(path: Path) -> tuple[dict, dict]:
    """(state.json contents, this rank's tensors: {"adapter": ..., "optimizer": ...})."""
    path = Path(path)
    state = read_state(path)
    rank_file = path / _rank_file()
    if not rank_file.is_file():
        present = sorted(p.name for p in path.glob("rank_*.pt"))
        why = (f"the checkpoint was written with another parallel layout ({state.get('layout')}; it has "
               f"{', '.join(present)})" if present else "the checkpoint is incomplete")
        raise MissingFileError(f"{rank_file}: missing — {why}")
    _check_manifest(path, ["state.json", rank_file.name])
    try:
        tensors = torch.load(rank_file, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a truncated or garbled file, whatever torch raises for it
        raise MissingFileError(f"{rank_file}: cannot be read ({type(e).__name__}: {e})") from None
    if not (isinstance(tensors, dict) and isinstance(tensors.get("adapter"), dict)
            and isinstance(tensors.get("optimizer"), dict)):
        raise MissingFileError(f"{rank_file}: expected a checkpoint's 'adapter' and 'optimizer' states, got "
                               f"{sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__}")
    return state, tensors


__all__ = ["best_checkpoint", "latest_checkpoint", "load_job_checkpoint", "load_newest_usable", "mark_best",
           "prune_checkpoints", "read_state", "save_job_checkpoint", "start_job_checkpoint"]

"""Jobs joining and leaving a running run (tLoRA-style online jobs): ``lorafusion submit`` / ``cancel``.

At each chunk boundary :meth:`LiveJobs.poll` (collective) takes the requests in ``RUN_DIR/requests/`` on
global rank 0, broadcasts them, and every rank applies them in the same order:

- submit: the job is validated again (name free, ``dataset.max_seq_len`` within the token capacity, its data
  readable), its adapter and optimizer are added to the model, and it is recorded in ``RUN_DIR/submitted/`` (a
  resumed run takes it back from there). It is *admitted* when its memory fits (adapter, gradients and AdamW
  moments in fp32, plus its LoRA activations at the token capacity, against the GPU's free memory); otherwise
  it waits as ``queued``, by priority then arrival, and starts when a job leaves. Admitted jobs join the next
  chunk that is drawn (the feed may already hold the one after the current chunk).
- cancel: the job gets no more batches; once its planned batches have run it is checkpointed and exported and
  its status is ``cancelled``. A queued job is cancelled at once.

A job that ends (its last step ran, or it diverged or early-stopped) is *handed over* at the first boundary
where no prepared chunk holds its batches: its final checkpoint and its PEFT adapter in ``adapters/<job>/``
are taken to host memory and written in the background while the others train (checkpoint/handover.py;
``status`` says ``done`` once they are complete, not at the end of the run); if the run goes on (other jobs
remain, or it serves) its adapter and optimizer state also leave the model, so the memory is there for
queued jobs.

The answer to each request is written next to it in ``RUN_DIR/requests/done/``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lorafusion.config.load import job_config_from
from lorafusion.config.schema import JobConfig, RunConfig
from lorafusion.resolve import RunPlan
from lorafusion.core.errors import ConfigError, UserError
from lorafusion.core.lora import lora_memory_bytes
from lorafusion.dist import min_over_ranks, share_from_rank0
from lorafusion.rundir.atomic import write_text_atomic
from lorafusion.rundir.jsonfile import read_json_file
from lorafusion.rundir.layout import RunDir
from lorafusion.runtime.feed import Feed
from lorafusion.runtime.jobs import JobState, JobStatus
from lorafusion.rundir.requests import answer_request, pending_requests


def resume_submitted(out: Path, jobs: dict, add_job: Callable[[JobConfig], JobState], *, is_logger: bool,
                     log: Callable[[str], None] = print,
                     ended: Callable[[JobConfig, Exception], JobState] | None = None
                     ) -> list[JobConfig]:
    """Jobs a run accepted by ``submit`` (not in the YAML), added back by ``add_job`` for a resume; returns
    them. A record that is no valid job (edited, damaged, or accepted before a bound it breaks existed) is set
    aside — moved to ``requests/done/`` with the reason, which ``lorafusion status`` shows — so that no later
    resume meets it again; the other jobs resume."""
    d = RunDir(out).submitted
    added = []
    for path in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            job = job_config_from(_read_json(path), str(path))
        except UserError as e:
            log(f"job {path.stem}: not resumed: {e}")
            if is_logger:
                set_aside_submitted(out, path, f"refused at resume: {e}")
            continue
        if job.name not in jobs:
            try:
                jobs[job.name] = add_job(job)
            except UserError as e:  # (its data gone or unreadable: a job that ended needs none)
                if ended is None:
                    raise
                jobs[job.name] = ended(job, e)
            added.append(job)
    return added


def ended_without_data(out: Path, job: JobConfig, seed: int, attach: Callable[[JobState], None],
                       why: Exception, log: Callable[[str], None] = print) -> JobState:
    """Job ``job`` of a resumed run as it ended, without its data (deleted since): its newest checkpoint says
    it ended, and the resume loads its adapter and counts from it; ``why`` (the data's error) is raised for a
    job that has not ended."""
    from lorafusion.data import JobStream
    from lorafusion.rundir.layout import latest_checkpoint, read_state
    from lorafusion.rundir.states import ENDED

    try:
        ckpt = latest_checkpoint(RunDir(out).job_checkpoints(job.name))
        state = read_state(ckpt) if ckpt is not None else {}
        status, samples, step = state.get("status"), state["stream"]["num_samples"], state["step"]
        # (all steps run)
        done = step >= state["total_steps"] and (job.max_steps is None or job.max_steps <= step)
    except (UserError, OSError, KeyError, TypeError):
        raise why from None
    if not (status in ENDED or done) or not isinstance(samples, int):
        raise why
    status = status if status in ENDED else "done"
    stream = JobStream(job.name, samples, job.global_batch_size, seed, max_steps=job.max_steps,
                       num_epochs=job.num_epochs)
    js = JobState(job, [], stream, eval_samples=[] if job.has_eval else None)
    attach(js)
    log(f"job {job.name}: resumed as it ended ({status}) without its data, which it no longer needs ({why})")
    return js


def set_aside_submitted(out: Path, path: Path, answer: str) -> None:
    """Move submitted job record ``path`` to ``requests/done/`` with ``answer`` (rank 0)."""
    done = RunDir(out).requests / "done"
    done.mkdir(parents=True, exist_ok=True)
    name = f"{time.time_ns():020d}-submit-{path.stem}.json"
    write_text_atomic(done / name,
                      json.dumps({"kind": "submit", "name": path.stem, "answer": answer}, indent=2) + "\n")
    try:
        path.unlink(missing_ok=True)
    except IsADirectoryError:  # (moved aside whole, never read again)
        path.replace(done / f"{name}.not-a-file")


def _read_json(path: Path):
    try:
        return read_json_file(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable job record ({e})") from None


def device_memory_bytes() -> int:
    """The memory one rank's adapters live in: the GPU's, or the host's without CUDA."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_adapter_fits(plan: RunPlan, job: JobConfig, arch) -> None:
    """:func:`lorafusion.core.lora.check_adapter_memory` for this run: before anything is allocated, for a
    YAML job, a resumed one or a submission alike."""
    from lorafusion.core.lora import check_adapter_memory

    check_adapter_memory(job.name, job.lora, arch, **run_limits(plan))


def run_limits(plan: RunPlan) -> dict:
    """What a job must fit to join this run (``status.json``'s ``run.limits``; ``lorafusion submit`` checks a
    job against them before it answers, :func:`check_adapter_fits` and :meth:`LiveJobs._submit` again at the
    boundary)."""
    return {"token_capacity": plan.token_capacity, "memory_bytes": device_memory_bytes(),
            "model_parallel": plan.tp * plan.pp}


def _withdraw(model, name: str) -> None:
    """Take whatever of adapter ``name`` was added back off the model (the add may have stopped half-way)."""
    from lorafusion.layers import get_lora_context, lora_modules

    ctx = get_lora_context(model)
    if name in ctx.batch_adapters:
        ctx.set_batch(None, ())
    for _, mod in lora_modules(model):
        if name in mod.lora_A:
            mod.remove_lora(name)
    ctx.specs.pop(name, None)


class LiveJobs:
    """See the module docstring. ``jobs`` is the run's job registry (name -> :class:`JobState`; a submitted
    job joins it, never the config). ``add_job(job_cfg) -> JobState`` builds a job (data, stream, adapter,
    optimizer) on every rank; ``finish(name, release)`` hands an ended job over (checkpoint, export; with
    ``release`` its adapter and optimizer leave the model)."""

    def __init__(self, cfg: RunConfig, plan: RunPlan, out: Path, model, feed: Feed, jobs: dict[str, JobState],
                 *, is_logger: bool, add_job: Callable[[JobConfig], JobState],
                 finish: Callable[[str, bool], None], log: Callable[[str], None] = print):
        self.cfg, self.plan, self.out, self.model, self.feed = cfg, plan, Path(out), model, feed
        self.jobs = jobs
        self.is_logger, self._add_job, self._finish, self.log = is_logger, add_job, finish, log
        # cancelling job -> chunk boundaries until its planned batches have run
        self._wait: dict[str, int] = {}
        self._queue: list[str] = [n for n, js in jobs.items() if js.status == JobStatus.QUEUED]

    # ------------------------------------------------------------------------------------------ requests
    def _take(self) -> list[dict]:
        """Rank 0's pending requests, on every rank (collective)."""
        reqs: list = []
        if self.is_logger:
            reqs = [dict(r, _path=str(p)) for p, r in pending_requests(self.out)]
        return share_from_rank0(reqs)

    def poll(self) -> int:
        """Take and apply the pending requests (collective); then end cancelled jobs whose batches have run
        and admit queued jobs where there is room. Returns how many requests were applied."""
        reqs = self._take()
        for req in reqs:
            try:
                answer = self._submit(req) if req["kind"] == "submit" else self._cancel(req)
            except UserError as e:  # the same on every rank (the data and the checks are the same)
                answer = f"refused: {e}"
            except BaseException as e:
                # a bug or the machine: set aside first, so a resume does not meet it again
                if self.is_logger:
                    answer_request(Path(req.pop("_path")), req, f"failed: {type(e).__name__}: {e}")
                raise
            if self.is_logger:
                answer_request(Path(req.pop("_path")), req, answer)
                self.log(f"request {req['kind']} {req.get('name') or req.get('job')}: {answer}")
        self._end_cancelled()
        self._end_finished()
        self._admit()
        return len(reqs)

    def _submit(self, req: dict) -> str:
        job = job_config_from(req.get("job"), f"request {Path(req['_path']).name}: job")
        if job.name in self.jobs:
            raise ConfigError(f"jobs: a job named {job.name!r} is already in the run")
        if job.dataset.max_seq_len > self.plan.token_capacity:
            raise ConfigError(f"job {job.name!r}: dataset.max_seq_len {job.dataset.max_seq_len} exceeds the "
                              f"run's scheduler.token_capacity {self.plan.token_capacity}")
        js = self._build(job)  # data, stream, adapter, optimizer; on every rank, or on none
        if self.is_logger:
            RunDir(self.out).submitted.mkdir(exist_ok=True)
            write_text_atomic(RunDir(self.out).submitted / f"{job.name}.json",
                              json.dumps(job.model_dump(mode="json")) + "\n")
        js.queue()
        self.feed.update_jobs(lambda jobs: jobs.__setitem__(job.name, js))
        self._queue.append(job.name)
        return f"accepted at step boundary (queued until admitted; {len(self._queue)} in the queue)"

    def _build(self, job: JobConfig) -> JobState:
        """``add_job(job)`` on every rank, or on none: whatever fails while the job is added (bad data, its
        adapter or optimizer, any error on any rank) takes the job back out everywhere and refuses it alone;
        the run goes on (collective)."""
        js, why = None, None
        try:
            js = self._add_job(job)
        except UserError as e:
            why = e
        except Exception as e:  # noqa: BLE001 - only this job is at fault: it never joins, the run continues
            import traceback

            self.log(f"request submit {job.name}: failed while adding it:\n{traceback.format_exc().rstrip()}")
            why = ConfigError(f"failed while adding the job ({type(e).__name__}: {str(e)[:300]})")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if min_over_ranks(int(why is None), device=device) < 1:
            _withdraw(self.model, job.name)
            raise why or ConfigError("another rank could not add the job")
        return js

    def _cancel(self, req: dict) -> str:
        name = req.get("job")
        js = self.jobs.get(name) if isinstance(name, str) else None
        if js is None:
            raise ConfigError(f"--job: no job {name!r} in this run")
        if js.status == JobStatus.QUEUED:
            self._queue.remove(name)
            self.feed.update_jobs(lambda jobs: js.cancel())
            return "cancelled (it had not started)"
        if js.status != JobStatus.RUNNING or js.finished:
            return ("nothing to do: the job is "
                    f"{js.status if js.status != JobStatus.RUNNING else JobStatus.DONE}")
        prepared = self.feed.update_jobs(lambda jobs: js.begin_cancel())
        self._wait[name] = 1 if name in prepared else 0
        return "cancelling: it leaves once its planned batches have run"

    # --------------------------------------------------------------------------------------- each boundary
    def _end_cancelled(self) -> None:
        for name in list(self._wait):
            if self._wait[name] > 0:
                self._wait[name] -= 1
                continue
            del self._wait[name]
            self.jobs[name].cancel()
            self._hand_over(name)
            self.log(f"job {name}: cancelled at step {self.jobs[name].steps}; checkpointed and exported")

    def _end_finished(self) -> None:
        ended = [n for n, js in self.jobs.items() if js.ended and js.status != JobStatus.CANCELLED
                 and not js.handed_over]
        if not ended:
            return
        prepared = self.feed.update_jobs(lambda jobs: None)  # a halted job's planned batches run first
        for name in ended:
            if name not in prepared:
                self._hand_over(name)
                self.log(f"job {name}: {self.jobs[name].final_status} at step {self.jobs[name].steps}; its "
                         f"adapter goes to {self.out / 'adapters' / name}")

    def _hand_over(self, name: str) -> None:
        # the memory goes back only if someone may use it: a run that ends now keeps the trained model whole
        goes_on = self.cfg.serve or any(not js.ended for n, js in self.jobs.items() if n != name)
        self._finish(name, goes_on)

    def _fits(self, name: str) -> bool:
        if not torch.cuda.is_available():
            return True
        free, _ = torch.cuda.mem_get_info()
        # the allocator's cache is free too
        free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        # what the job still needs on the rank with the most layers once it trains (its weights are on the
        # model): fp32 gradients and AdamW moments, and its LoRA activations at the token capacity
        need = lora_memory_bytes(self.jobs[name].cfg.lora, self.plan.setup.arch, self.plan.token_capacity,
                                 layers=max(self.plan.layers_per_rank), tp=self.plan.tp, bytes_per_param=12)
        return bool(min_over_ranks(int(free - (1 << 30) >= need)))  # admitted only where every rank has room

    def _admit(self) -> None:
        """Start queued jobs by priority (then arrival) while they fit."""
        order = sorted(self._queue, key=lambda n: (-self.jobs[n].cfg.priority, self._queue.index(n)))
        for name in order:
            if not self._fits(name):
                break  # a job of higher priority waits first
            self._queue.remove(name)
            self.feed.update_jobs(lambda jobs, js=self.jobs[name]: js.admit())
            self.log(f"job {name}: admitted (joins the next chunk drawn)")

    @property
    def busy(self) -> bool:
        """Jobs still waiting to start or to end."""
        return bool(self._queue or self._wait)

"""A run's per-job checkpoints, whatever the training recipe: when each job is saved (``save_every``, timed,
on a stop signal, at the end), what a save records, and resuming every job from its newest usable checkpoint
after checking that its settings did not change. The files themselves: :mod:`.format`."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from lorafusion.core.errors import ConfigError, MissingFileError
from lorafusion.rundir.atomic import file_sha256
from lorafusion.rundir.integrity import model_digest  # noqa: F401 (its home before)
from lorafusion.rundir.layout import RunDir
from lorafusion.rundir.states import JobStatus


class JobCheckpoints:
    """Checkpoints of the jobs ``jobs`` (the run's job registry: name -> job state with ``cfg``, ``steps``,
    ``stream``, ``optimizer``…) of run ``cfg`` under ``OUTPUT_DIR/checkpoints/<job>/``; ``plan`` is the run's
    resolved plan (``lorafusion.resolve.RunPlan``: the layout and scheduler settings a checkpoint records).
    ``snapshot(name)`` takes a job's PEFT adapter to host memory (collective; rank 0 gets it). Saving and
    loading are collective over all ranks."""

    def __init__(self, cfg, plan, jobs: dict, model, snapshot, *, is_logger: bool,
                 allow_different_result: bool = False):
        self.cfg, self.plan, self.jobs, self.model, self.snapshot = cfg, plan, jobs, model, snapshot
        self.is_logger = is_logger
        self.allow_different_result = allow_different_result  # changed _PACKING settings: resumed anyway
        self.root = RunDir(cfg.output_dir).checkpoints
        self._fingerprints: dict[str, dict] = {}
        self._saved_step: dict[str, int] = {}  # job -> step of its newest checkpoint
        self._saved_status: dict[str, str] = {}  # job -> the status that checkpoint recorded
        self._stream_states: dict[str, dict] = {}  # job -> stream state at the newest chunk boundary

    def chunk_done(self, chunk) -> None:
        """Note the stream states at the end of ``chunk`` (a feed ``Chunk``) of the jobs still training."""
        self._stream_states.update({n: s for n, s in chunk.stream_states.items()
                                    if not self.jobs[n].halted})

    def save_due(self, chunk) -> None:
        """Checkpoint every job of ``chunk`` whose ``save_every`` divides a step the chunk took (unless it was
        saved at its current step already: a best-eval checkpoint)."""
        for name, batches in chunk.batches.items():
            js = self.jobs[name]
            every = js.cfg.save_every
            took = range(js.steps - len(batches) + 1, js.steps + 1)
            if every and not js.halted and self._saved_step.get(name) != js.steps and any(
                s % every == 0 for s in took):
                self.save(name, chunk.stream_states[name])

    def save_all(self, *, only_default_policy: bool) -> None:
        """Checkpoint every job not yet saved at its current step (``only_default_policy``: only jobs without
        ``save_every``, whose policy is time-based and at the end; a stop signal saves every job). Each
        records where all of them stood (``together``: a resume checks they agree,
        checkpoint/consistent.py)."""
        todo = [name for name, js in self.jobs.items()  # (a handed-over job was saved when it ended)
                if not ((only_default_policy and js.cfg.save_every) or js.handed_over)
                and self._saved_step.get(name) != js.steps and name in self._stream_states]
        together = {n: self.jobs[n].steps for n in todo} if len(todo) > 1 else None
        for name in todo:
            self.save(name, self._stream_states[name], together=together)

    def halt(self, name: str, why: JobStatus) -> None:
        """Pause job ``name`` for good (diverged or early stopped: no more batches, no more updates) and
        checkpoint it now — the one way a job pauses (the trainer's divergence, the evaluator's early
        stop)."""
        self.jobs[name].halt(why)
        self.save_now(name)

    def save_now(self, name: str) -> None:
        """Checkpoint job ``name`` at the newest chunk boundary, saved at this step before or not."""
        self._saved_step.pop(name, None)
        self.save(name, self._boundary_stream(name))

    def _boundary_stream(self, name: str) -> dict:
        """Job ``name``'s data stream as of the newest chunk boundary (a job that has not run a chunk yet —
        cancelled at once — is at the start of its stream)."""
        return self._stream_states.get(name) or self.jobs[name].stream.state_dict()

    def start_final(self, name: str, adapter: tuple | None):
        """A job that ended, handed over before the run's end (collective, quick): the checkpoint the end of
        the run would write for it (a job with ``save_every`` keeps its own steps), and a cancelled job's
        always — unless its newest checkpoint holds that state already (a resumed job; a halted job was saved
        when it halted). Returns the write (no collectives; see ``checkpoint.start_job_checkpoint``), or None
        when there is nothing to save. ``adapter``: rank 0's ``peft_adapter_snapshot`` of the job."""
        from lorafusion.layers import adapter_parameters
        from lorafusion.checkpoint.format import start_job_checkpoint

        js = self.jobs[name]
        if self._saved_step.get(name) == js.steps and self._saved_status.get(name) == js.status:
            return None
        if js.status == JobStatus.CANCELLED:
            stream = self._boundary_stream(name)
        elif not js.cfg.save_every and name in self._stream_states:
            stream = self._stream_states[name]
        else:
            return None
        write = start_job_checkpoint(self.root / name, js.steps,
                                     adapter_params=adapter_parameters(self.model, name),
                                     optimizer_state=js.optimizer.state_dict(),
                                     state=self._state(name, stream),
                                     adapter=adapter, keep_last=self.cfg.checkpoint.keep_last)
        self._saved_step[name], self._saved_status[name] = js.steps, js.status
        return write

    def save(self, name: str, stream_state: dict, together: dict | None = None) -> None:
        """``stream_state``: the job's data stream as of the chunk boundary being saved (the feed's live
        stream is already a chunk further); ``together``: the jobs saved at this boundary with it, and their
        steps."""
        from lorafusion.layers import adapter_parameters
        from lorafusion.checkpoint.format import save_job_checkpoint

        js = self.jobs[name]
        state = {**self._state(name, stream_state), **({"together": together} if together else {})}
        save_job_checkpoint(self.root / name, js.steps,
                            adapter_params=adapter_parameters(self.model, name),
                            optimizer_state=js.optimizer.state_dict(), state=state,
                            adapter=self.snapshot(name), keep_last=self.cfg.checkpoint.keep_last)
        self._saved_step[name], self._saved_status[name] = js.steps, js.status

    def _state(self, name: str, stream_state: dict) -> dict:
        """A checkpoint's ``state.json`` for job ``name`` as it is now."""
        js = self.jobs[name]
        return {"job": name, "step": js.steps, "tokens": js.tokens, "stream": stream_state,
                "first_loss": js.first_loss, "last_loss": js.last_loss, "status": js.status,
                "nonfinite": js.nonfinite, "eval": {"last": js.last_eval, "best": js.best_eval,
                                                    "best_step": js.best_step,
                                                    "since_best": js.evals_since_best},
                "seed": self.cfg.seed, "layout": self.plan.parallelism,
                "total_steps": js.stream.total_steps,
                "settings": self._settings(name)}

    def save_best(self, name: str) -> None:
        """Checkpoint job ``name`` at its current step (unless saved at it already) and mark that checkpoint
        as its best-eval one: ``checkpoints/<job>/best`` names it and pruning keeps it."""
        from lorafusion.checkpoint.format import mark_best

        if self._saved_step.get(name) != self.jobs[name].steps:
            self.save_now(name)
        if self.is_logger:
            mark_best(self.root / name, self.jobs[name].steps)

    def _settings(self, name: str) -> dict:
        """What a resume must find unchanged for job ``name`` (flat dotted keys as in the YAML): everything
        that changes its result except ``max_steps`` / ``num_epochs`` (raising them continues the job; its lr
        schedule then spans the new total) and ``save_every``."""
        if name not in self._fingerprints:
            cfg, job = self.cfg, self.jobs[name].cfg
            ds = job.dataset.model_dump(exclude={"path"})
            # (gone: a job that ended, resumed without its data — nothing to compare)
            path = Path(job.dataset.path)
            ds["sha256"] = file_sha256(path) if path.is_file() else None
            tree = {"eval_split": job.eval_split,  # the held-out share changes the training samples
                    "lora": job.lora.model_dump(mode="json"),
                    "optimizer": job.optimizer.model_dump(mode="json"),
                    "global_batch_size": job.global_batch_size, "dataset": ds}
            flat = _flatten(tree)
            # (paths by name only: a run directory that moved with its data still resumes)
            flat.update({"(run) seed": cfg.seed, "(run) model.dtype": cfg.model.dtype,
                         "(run) model": Path(cfg.model.path).name if cfg.model.path else cfg.model.preset,
                         "(run) model.digest": model_digest(Path(cfg.model.path)) if cfg.model.path else None,
                         "(run) tokenizer.type": cfg.tokenizer.type,
                         **{f"(run) scheduler.{k}": getattr(self.plan.scheduler, k) for k in _PACKING}})
            # (absent = bf16: checkpoints written before the field resume)
            if cfg.model.base_precision != "bf16":
                flat["(run) model.base_precision"] = cfg.model.base_precision
            self._fingerprints[name] = flat
        return self._fingerprints[name]

    def _check_settings(self, name: str, path: Path, saved: dict | None) -> None:
        if saved is None:  # a checkpoint written before settings were recorded
            return
        # before PEFT's A per projection: one shared A
        if "lora.r" in saved and "lora.shared_fused_a" not in saved:
            saved = {**saved, "lora.shared_fused_a": True}
        index = list(self.jobs).index(name)
        now = self._settings(name)
        for key in sorted(set(saved) | set(now)):
            if key not in saved and key in _ADDED or key == "dataset.sha256" and now.get(key) is None:
                continue  # a checkpoint from before the key was recorded; an ended job's data, gone
            if (saved.get(key) != now.get(key) and key.startswith("(run) scheduler.")
                    and self.allow_different_result):
                if self.is_logger:
                    print(f"job {name}: resumed with {key[6:]} {now.get(key)!r} (the checkpoint's: "
                          f"{saved.get(key)!r}); --allow-different-result: its result differs from an "
                          f"uninterrupted run's", file=sys.stderr, flush=True)
                continue
            if saved.get(key) != now.get(key):
                field = key.replace("(run) ", "") if key.startswith("(run) ") else \
                    f"jobs.{index}.{key.replace('dataset.sha256', 'dataset.path')}"
                what = "the data file's contents changed" if key == "dataset.sha256" else \
                    f"the checkpoint has {saved.get(key)!r}, the config {now.get(key)!r}"
                if key == "(run) model.digest":
                    field, what = "model.path", ("the base model's config or weights differ from those the "
                                                 "checkpoint was trained on")
                if key.startswith("(run) scheduler."):
                    what += ("; the data would be packed otherwise, so the result would differ from an "
                             "uninterrupted run: pass --allow-different-result to resume anyway")
                if key == "lora.shared_fused_a" and saved.get(key):
                    what += (" (the checkpoint's fused q/k/v and gate/up share one A; set "
                             "lora.shared_fused_a: true to resume it)")
                raise ConfigError(f"{self.cfg.source}: {field}: cannot resume job {name!r} from {path}: "
                                  f"{what}; resuming would change its result (raising max_steps/num_epochs "
                                  f"is allowed; otherwise use a new output_dir)")

    def _check_total(self, name: str, path: Path, state: dict) -> None:
        """A resume may raise or lower a job's total steps (its lr schedule then spans the new total from the
        first resumed step), never below the step its checkpoint is at."""
        js, step = self.jobs[name], state["step"]
        index = list(self.jobs).index(name)
        key = "max_steps" if js.cfg.max_steps is not None else "num_epochs"
        if js.stream.total_steps < step:
            raise ConfigError(f"{self.cfg.source}: jobs.{index}.{key}: cannot resume job {name!r} from "
                              f"{path}: it is at step {step}, beyond the {js.stream.total_steps} steps {key} "
                              f"= {getattr(js.cfg, key)} gives; expected at least {step} steps")
        if state.get("total_steps", js.stream.total_steps) != js.stream.total_steps and self.is_logger:
            print(f"job {name}: {state['total_steps']} -> {js.stream.total_steps} steps ({key} = "
                  f"{getattr(js.cfg, key)}); its lr schedule spans the new total from step {step + 1}",
                  file=sys.stderr, flush=True)

    def load(self) -> None:
        """Resume every job that has a checkpoint: adapter, optimizer, data stream and counters — from a set
        of checkpoints that agree across the jobs (checkpoint/consistent.py)."""
        from lorafusion.checkpoint.consistent import consistent_picks

        picks = {name: self._newest(name) for name in self.jobs}
        log = (lambda m: print(m, file=sys.stderr, flush=True)) if self.is_logger else (lambda m: None)
        picks = consistent_picks(picks, _older, source=self.cfg.source,
                                 allow_different_result=self.allow_different_result, log=log)
        for name, (path, state, tensors) in picks.items():
            if path is not None:
                self._apply(name, path, state, tensors)

    def _newest(self, name: str) -> tuple:
        """(path, state, tensors) of job ``name``'s newest usable checkpoint ((None, None, None): none)."""
        import torch.distributed as dist

        from lorafusion.dist import multi_process
        from lorafusion.checkpoint.format import load_newest_usable

        path, state, tensors, skipped = load_newest_usable(self.root / name)
        if multi_process():  # every rank must resume the same step
            steps = [None] * dist.get_world_size()
            dist.all_gather_object(steps, None if path is None else path.name)
            if len(set(steps)) > 1:
                raise MissingFileError(f"{self.root / name}: ranks found different usable "
                                       f"checkpoints ({sorted(set(map(str, steps)))}); a checkpoint is "
                                       "damaged")
        if path is None:  # (--resume of a job never checkpointed: said, not silent — a mistyped output_dir?)
            if self.is_logger:
                print(f"job {name}: --resume: no checkpoint in {self.root / name}; it starts from step 0",
                      file=sys.stderr, flush=True)
        elif skipped and self.is_logger:
            for bad, why in skipped:
                print(f"job {name}: checkpoint {bad} is not usable ({why}); falling back",
                      file=sys.stderr, flush=True)
            print(f"job {name}: resuming from {path}", file=sys.stderr, flush=True)
        return path, state, tensors

    def _apply(self, name: str, path: Path, state: dict, tensors: dict) -> None:
        from lorafusion.layers import adapter_parameters

        js = self.jobs[name]
        self._check_settings(name, path, state.get("settings"))
        params = adapter_parameters(self.model, name)
        with torch.no_grad():
            for k, p in params.items():
                if k not in tensors["adapter"] or tensors["adapter"][k].shape != p.shape:
                    raise ConfigError(f"{path}: adapter tensor {k} is missing or has another shape; "
                                      f"the checkpoint does not match job {name!r}'s lora settings" + (
                                          " (a checkpoint from before lora.shared_fused_a existed has one A "
                                          "shared by q/k/v and gate/up: set lora.shared_fused_a: true)"
                                          if k in tensors["adapter"] and k.endswith(("linear_qkv.lora_A",
                                                                                    "linear_fc1.lora_A"))
                                          else ""))
                p.copy_(tensors["adapter"][k])
        self._check_total(name, path, state)
        js.optimizer.load_state_dict(tensors["optimizer"])
        js.stream.load_state_dict(state["stream"])
        js.steps, js.tokens = state["step"], state.get("tokens", 0)
        js.first_loss, js.last_loss = state.get("first_loss"), state.get("last_loss")
        js.restore(state.get("status", JobStatus.RUNNING), state.get("nonfinite", 0))
        ev = state.get("eval") or {}
        js.last_eval, js.best_eval, js.best_step = ev.get("last"), ev.get("best"), ev.get("best_step")
        js.evals_since_best = ev.get("since_best", 0)
        self._saved_step[name], self._saved_status[name] = js.steps, js.status
        self._stream_states[name] = state["stream"]


def _older(name_unused: str, path: Path) -> Iterator[tuple]:
    """The usable checkpoints of ``path``'s job older than ``path``, newest first (loaded on demand)."""
    from lorafusion.checkpoint.format import load_job_checkpoint

    def usable():
        for p in sorted(path.parent.glob("step_*"), reverse=True):
            if p.name >= path.name or not (p / "state.json").is_file():
                continue
            try:
                yield (p, *load_job_checkpoint(p))
            except (MissingFileError, OSError, ValueError, RuntimeError, EOFError, KeyError):
                continue

    return usable()


# scheduler settings that decide only how the data is packed: changed on resume, the numbers differ slightly
# (fp32 summation order), the job is the same — refused unless --allow-different-result says so
_PACKING = ("token_capacity", "lookahead_batches", "grouping", "policy", "solver")
# settings added to the record later: absent from older checkpoints, which resume as before
_ADDED = {"(run) model.digest", *(f"(run) scheduler.{k}" for k in _PACKING)}


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out

"""Resolve once: every ``auto`` of a run config made a value, in one frozen :class:`RunPlan` (torch-free).

``resolve(cfg, world, gpu) -> RunPlan`` is the one place where the run's open settings are decided:

- ``parallelism.dp`` (``auto``: the launch's processes over tp*pp) and the check that tp*pp*dp is the launch;
- ``parallelism.stage_layers`` (None: even; ``auto``: the loss-aware split of :mod:`.scheduler.stages`) and
  the virtual stages;
- ``scheduler.token_capacity`` and ``model.recompute_layers`` per pipeline stage: with a GPU, the memory plan
  (:func:`lorafusion.scheduler.sizing.choose` on :mod:`lorafusion.scheduler.memory`: the fastest candidate
  that fits ``gpu.free``); without one, the cost model's capacity
  (:func:`.scheduler.costmodel.auto_token_capacity` at the longest ``dataset.max_seq_len``) and every layer
  recomputed for ``recompute_layers: auto``;
- ``kernels`` (``auto``: fused with a GPU, reference without), the base precision, and the attention path the
  memory model counts: the runtime's own (``attention``: what ``model.attention`` selected on this GPU,
  lorafusion.models.attention.select_attention), else :func:`attention_guess`;
- ``parallelism.tp_overlap`` (``auto``: off — the overlap has not been measured to pay yet (1.016x on
  2x H200, within noise); ``on`` overlaps the TP collectives with compute where tp > 1, refused with an FP8
  base, whose GEMM keeps Megatron's collectives);
- the scheduler's settings (:class:`lorafusion.scheduler.SchedulerConfig`: the run YAML's ``scheduler``
  section with the layout and the capacity filled in).

Inputs: ``cfg`` the loaded run config (never written), ``world`` the launch (:class:`World`: processes),
``gpu`` the memory of one GPU (:class:`GpuMemory`: free and total bytes, the free part the smallest over the
ranks) or None on a machine without one. The runtime reads ``gpu`` with torch and passes it in;
``lorafusion plan`` passes ``--gpu-memory`` sizes (or None). Both print :meth:`RunPlan.lines`;
``summary.json`` records :meth:`RunPlan.to_dict`. Only the jobs in the YAML are planned for (their samples
taken at ``dataset.max_seq_len``: no data is read); jobs submitted later are checked against the plan's
capacity and memory when they arrive.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path

from lorafusion.config.schema import RunConfig
from lorafusion.core.arch import ModelArch, arch_from_hf_config, preset
from lorafusion.core.errors import ConfigError
from lorafusion.core.pipeline import MAX_AUTO_VIRTUAL_STAGES, virtual_stage_choices
from lorafusion.core.precision import FP8_BF16_LEADING_LAYERS
from lorafusion.scheduler import PlanError, SchedulerConfig, stages
from lorafusion.scheduler.costmodel import CostModel, auto_token_capacity
from lorafusion.scheduler.host import HostNeed, available_bytes, host_need, no_fit_on_host
from lorafusion.scheduler.memory import ATTENTION_DEFAULT, GIB, AdapterShape, Coefficients, MemorySetup, \
    load_coefficients
from lorafusion.scheduler.sizing import MemoryFitError, MemoryPlan, choose, memory_reasons, no_fit_message
from lorafusion.scheduler.virtual import VirtualChoice, candidate, choose_virtual, synthetic_jobs

__all__ = ["GpuMemory", "MemoryFitError", "RunPlan", "World", "check_run_on_host", "memory_setup", "resolve",
           "run_arch", "run_need"]


@dataclass(frozen=True)
class World:
    """The launch: how many processes run the training (torchrun's / Slurm's ``WORLD_SIZE``); for a run
    without GPUs also how many of them share this host (``LOCAL_WORLD_SIZE``; None: all) and the host memory
    available to them (bytes; None: not checked)."""

    processes: int = 1
    local_processes: int | None = None
    host_bytes: float | None = None

    @classmethod
    def from_env(cls, host_bytes: float | None = None) -> "World":
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        return cls(world, int(os.environ.get("LOCAL_WORLD_SIZE", world) or world), host_bytes)

    @classmethod
    def for_plan(cls, cfg: RunConfig, gpus: int | None = None) -> "World":
        """The launch ``lorafusion plan`` plans for (it launches nothing): ``gpus`` processes when given, else
        the config's own layout, tp*pp*dp (``dp: auto``: one replica, tp*pp)."""
        p = cfg.parallelism
        return cls(gpus if gpus is not None else p.tp * p.pp * (p.dp if isinstance(p.dp, int) else 1))


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory in bytes: ``free`` (what a plan may use: the smallest over the ranks) and
    ``total``."""

    free: float
    total: float


@dataclass(frozen=True)
class RunPlan:
    """Every setting of a run with ``auto`` made a value (see the module docstring). Frozen: read it, never
    write it. ``auto`` names the settings that were ``auto`` in the config."""

    source: str
    model: str
    world: int
    tp: int
    pp: int
    dp: int
    sequence_parallel: bool
    virtual_stages: int
    stage_layers: tuple[int, ...]  # decoder layers per virtual stage, in layer order
    even_split: bool  # stage_layers was not given: the model builder's own even split
    token_capacity: int
    # per pipeline rank: the model builder's (recompute, layers)
    recompute: tuple[tuple[bool, int | None], ...]
    recompute_layers: tuple[int, ...]  # per pipeline rank: how many of its decoder layers are recomputed
    kernels: str  # "fused" | "reference"
    attention: str  # the attention path the memory model counts (scheduler.memory.ATTENTION_PATHS)
    base_precision: str
    adapters: int
    scheduler: SchedulerConfig
    memory: MemoryPlan | None  # None without a GPU
    gpu: GpuMemory | None
    auto: tuple[str, ...]
    # why the run does not fit the GPU's (or without one the host's) memory; None: it does
    no_fit: str | None = None
    host: HostNeed | None = None  # without a GPU: what the ranks on this host need
    # the run's shape for the memory model (advice after an out-of-memory error)
    setup: MemorySetup | None = None
    # why the memory plan is what it is: without recompute, the alternatives it beat
    why: tuple[str, ...] = ()
    longest: int = 1  # the longest sample a job may have (its dataset.max_seq_len)
    tp_overlap: int = 0  # nano-batches of each TP linear with its collectives overlapped; 0: off
    tp_overlap_why: str = ""  # why off, when it is
    virtual: VirtualChoice | None = None  # virtual_stages: auto decided (the alternatives it beat)

    # ------------------------------------------------------------------------------------- for the runtime
    @property
    def model_stage_layers(self) -> list[int] | None:
        """``stage_layers`` for the model builder (None: its own even split)."""
        return None if self.even_split else list(self.stage_layers)

    def recompute_kwargs(self, stage: int) -> dict:
        """``recompute`` / ``recompute_layers`` for pipeline rank ``stage``'s model (Megatron counts per
        chunk)."""
        on, layers = self.recompute[stage]
        return {"recompute": on, "recompute_layers": layers}

    def model_kwargs(self, stage: int) -> dict:
        """What the model builder takes from the plan for pipeline rank ``stage``."""
        return {**self.recompute_kwargs(stage), "base_precision": self.base_precision,
                "sequence_parallel": self.sequence_parallel, "tp_overlap": self.tp_overlap,
                "stage_layers": self.model_stage_layers}

    @property
    def layers_per_rank(self) -> list[int]:
        v, pp = self.virtual_stages, self.pp
        return [sum(self.stage_layers[c * pp + k] for c in range(v)) for k in range(pp)]

    @property
    def fits(self) -> bool:
        return self.no_fit is None

    @property
    def parallelism(self) -> dict:
        """The layout as the config spells it, dp resolved (summary.json, checkpoints)."""
        split = (None if self.even_split else "auto" if "stage_layers" in self.auto
                 else list(self.stage_layers))
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "sequence_parallel": self.sequence_parallel,
                "stage_layers": split, "virtual_stages": self.virtual_stages}

    # ---------------------------------------------------------------------------------------- for people
    def _said(self, name: str, value) -> str:
        return f"{name} {value}{' (auto)' if name in self.auto else ''}"

    def lines(self) -> list[str]:
        """What ``train`` and ``plan`` print: a head line, the memory table (with a GPU), the other settings,
        and whether it fits."""
        where = (f"memory plan for {self.gpu.free / GIB:.1f} GiB free of {self.gpu.total / GIB:.1f} GiB "
                 "per GPU" if self.gpu is not None else "run plan without a GPU (no memory limit)")
        head = (f"{where} ({self.model}, tp={self.tp} pp={self.pp} dp={self.dp}, {self.adapters} adapters): "
                f"{self._said('token_capacity', self.token_capacity)}, "
                f"recompute_layers per stage {list(self.recompute_layers)}"
                f"{' (auto)' if 'recompute_layers' in self.auto else ''}")
        out = [head] + (["  " + x for x in [*self.memory.lines(), *self.why]]
                        if self.memory is not None else [])
        out += ["  " + x for x in (self.virtual.lines() if self.virtual is not None else [])]
        out.append(f"  {self._said('stage_layers', list(self.stage_layers))}, "
                   f"{self._said('virtual_stages', self.virtual_stages)}, "
                   f"{self._said('kernels', self.kernels)}, {self._said('attention', self.attention)}, "
                   f"base_precision {self.base_precision}, " + self._said(
                       "tp_overlap", ("on, per sequence shard" if self.sequence_parallel else
                                      f"on, {self.tp_overlap} nano-batches") if self.tp_overlap else
                       f"off{self.tp_overlap_why}"))
        if self.host is not None:
            out.append(f"  host memory: {self.host.total / GIB:.1f} GiB for {self.host.processes} "
                       f"process(es) ({self.host.describe()})")
        if self.memory is not None or not self.fits:
            out.append("  fits" if self.fits else "  does NOT fit: " + (self.no_fit or ""))
        return out

    def to_dict(self) -> dict:
        return {"world": self.world, "parallelism": self.parallelism, "token_capacity": self.token_capacity,
                "recompute_layers": list(self.recompute_layers), "stage_layers": list(self.stage_layers),
                "kernels": self.kernels, "attention": self.attention, "base_precision": self.base_precision,
                "tp_overlap": self.tp_overlap,
                "virtual_stages": None if self.virtual is None else self.virtual.to_dict(),
                "auto": list(self.auto), "gpu_memory_gib": None if self.gpu is None else
                {"free": round(self.gpu.free / GIB, 2), "total": round(self.gpu.total / GIB, 2)},
                "memory_plan": None if self.memory is None else self.memory.to_dict(), "fits": self.fits}


def run_arch(cfg: RunConfig) -> ModelArch:
    """The ``ModelArch`` of a run config without loading weights (preset, or the HF directory's
    config.json)."""
    if cfg.model.path is None:
        return preset(cfg.model.preset)
    src = Path(cfg.model.path) / "config.json"
    try:
        data = json.loads(src.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{cfg.source}: model.path: cannot read {src}: {e}") from None
    return arch_from_hf_config(data, str(src))


def _split(cfg: RunConfig, arch: ModelArch) -> list[int]:
    p = cfg.parallelism
    try:
        lead = FP8_BF16_LEADING_LAYERS if cfg.model.base_precision == "fp8" else None
        return stages.resolve_split(p.stage_layers, arch.num_layers, p.pp, p.virtual_stages,
                                    *stages.split_weights(arch, lead))
    except PlanError as e:
        what = "parallelism.stage_layers: auto: " if p.stage_layers == "auto" else ""
        raise ConfigError(f"{cfg.source}: {what}{e}") from None


def attention_guess(cfg: RunConfig, gpu: bool = True) -> str:
    """The attention path (scheduler.memory.ATTENTION_PATHS) a run of ``cfg`` would count without asking the
    GPU: per-sample without one or in float32; fa4 when chosen, or for ``auto`` when flash-attn-4 is installed
    here; else torch's varlen op with k and v expanded (the conservative count of fa2)."""
    choice = cfg.model.attention
    if choice == "per-sample" or not gpu or cfg.model.dtype == "float32":
        return "per-sample"
    if choice == "fa4" or (choice == "auto" and _installed("flash-attn-4")):
        return "fa4"
    return ATTENTION_DEFAULT


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def memory_setup(cfg: RunConfig, arch: ModelArch, dp: int = 1, split: list[int] | None = None,
                 attention: str | None = None) -> MemorySetup:
    """The :class:`MemorySetup` of a run config and its ``ModelArch`` (``split``: decoder layers per virtual
    stage; default the config's, resolved; ``attention``: the path, default :func:`attention_guess`)."""
    p, m = cfg.parallelism, cfg.model
    split = _split(cfg, arch) if split is None else split
    per_rank = tuple(sum(split[c * p.pp + k] for c in range(p.virtual_stages)) for k in range(p.pp))
    # PEFT-exact fused projections (an A per projection) where the LoRA spec has them, else one shared A
    adapters = tuple(AdapterShape(j.lora.r, tuple(j.lora.target_modules), j.lora.lora_dropout,
                                  independent_a=not j.lora.shared_fused_a) for j in cfg.jobs)
    fp8 = m.base_precision == "fp8"
    return MemorySetup(arch, adapters, dtype=m.dtype, base_bytes_per_param=1.0 if fp8 else None,
                       row_scale_bytes=4 if fp8 else 0,
                       bf16_base_layers=FP8_BF16_LEADING_LAYERS if fp8 else 0,
                       tp=p.tp, pp=p.pp, dp=dp, sequence_parallel=p.sequence_parallel, stage_layers=per_rank,
                       virtual_stages=p.virtual_stages, fused_ops=True,
                       attention=attention or attention_guess(cfg))


def _recompute_setting(cfg: RunConfig, per_rank: list[int]) -> int | list[int] | str:
    m = cfg.model
    if m.recompute_layers == "auto":
        return "auto"
    if not m.recompute:
        return 0
    return m.recompute_layers if m.recompute_layers is not None else list(per_rank)


def _model_recompute(cfg: RunConfig, counts: list[int], per_rank: list[int]) -> tuple:
    """Per rank, the model builder's (recompute, recompute_layers): the config's own, or for ``auto`` the
    plan's counts (none: no recompute; all: every layer; else rounded up to Megatron's count per model
    chunk)."""
    m, v = cfg.model, cfg.parallelism.virtual_stages
    if m.recompute_layers != "auto":
        return tuple((m.recompute, m.recompute_layers) for _ in per_rank)
    out = []
    for n, layers in zip(counts, per_rank, strict=True):
        out.append((False, None) if n <= 0 else (True, None) if n >= layers else (True, -(-n // v)))
    return tuple(out)


def _chunk_tokens(cfg: RunConfig) -> float:
    """Tokens of one planned chunk, estimated from the config: every job's ``lookahead_batches`` global
    batches at half its ``dataset.max_seq_len``."""
    look = cfg.scheduler.lookahead_batches
    return sum(j.global_batch_size * look * j.dataset.max_seq_len / 2 for j in cfg.jobs)


def _tp_overlap(cfg: RunConfig) -> tuple[int, str]:
    """(nano-batches of each TP linear, 0: off; why off) for ``parallelism.tp_overlap``."""
    p = cfg.parallelism
    if p.tp_overlap == "off" or p.tp == 1:
        return 0, " (tp = 1)" if p.tp == 1 else ""
    if p.tp_overlap == "auto":  # off until a measurement shows it pays (docs/DESIGN.md, "TP overlap")
        return 0, " (not measured to help yet)"
    if cfg.model.base_precision == "fp8":
        raise ConfigError(f"{cfg.source}: parallelism.tp_overlap: on does not apply with "
                          "model.base_precision: fp8 (its FP8 GEMM keeps Megatron's collectives); "
                          "use auto or off")
    return p.tp_overlap_chunks, ""


def _auto_virtual(cfg: RunConfig, world: World, gpu: GpuMemory | None, **kw) -> RunPlan:
    """``virtual_stages: auto``: the run resolved at every V the layers allow
    (:func:`~lorafusion.core.pipeline.virtual_stage_choices`), each simulated on a chunk planned at its
    capacity with its recompute (:mod:`lorafusion.scheduler.virtual`); the fastest that fits."""
    p, arch = cfg.parallelism, run_arch(cfg)
    choices = virtual_stage_choices(p.pp, arch.num_layers, p.stage_layers)
    if not choices:
        raise ConfigError(f"{cfg.source}: parallelism.virtual_stages: auto: no virtual-stage count up to "
                          f"{MAX_AUTO_VIRTUAL_STAGES} splits {arch.num_layers} decoder layers evenly over pp="
                          f"{p.pp} x V stages; set parallelism.stage_layers: auto or a virtual_stages count")
    plans = {v: resolve(cfg.model_copy(update={"parallelism": p.model_copy(update={"virtual_stages": v})}),
                        world, gpu, **kw) for v in choices}
    if len(choices) == 1:
        why = "no pipeline (pp = 1)" if p.pp == 1 else f"the only count the layers allow ({choices[0]})"
        choice = VirtualChoice(choices[0], reason=why)
    else:
        jobs = synthetic_jobs([(j.name, j.global_batch_size, j.dataset.max_seq_len) for j in cfg.jobs],
                              cfg.scheduler.lookahead_batches)
        choice = choose_virtual([candidate(q, arch, jobs) for q in plans.values()])
    best = plans[choice.chosen]
    return dataclasses.replace(best, auto=(*best.auto, "virtual_stages"), virtual=choice)


def resolve(cfg: RunConfig, world: World, gpu: GpuMemory | None, *,
            coeffs: Coefficients | None = None, attention: str | None = None) -> RunPlan:
    """The :class:`RunPlan` of ``cfg`` for ``world`` on ``gpu`` (None: no GPU). Raises ConfigError for a
    layout that does not match the launch or a split that does not exist; never for memory (a plan that does
    not fit says so: ``fits``, ``no_fit``; the runtime refuses it when it chose the settings)."""
    if cfg.parallelism.virtual_stages == "auto":
        return _auto_virtual(cfg, world, gpu, coeffs=coeffs, attention=attention)
    dp = cfg.check_world_size(world.processes)
    arch, p, m, sched = run_arch(cfg), cfg.parallelism, cfg.model, cfg.scheduler
    split = _split(cfg, arch)
    attention = attention or attention_guess(cfg, gpu is not None)
    setup = memory_setup(cfg, arch, dp, split, attention)
    per_rank = [setup.layers(k) for k in range(p.pp)]
    longest = {j.name: j.dataset.max_seq_len for j in cfg.jobs}
    auto = [name for name, value in (("dp", p.dp), ("stage_layers", p.stage_layers), ("kernels", cfg.kernels),
                                     ("token_capacity", sched.token_capacity),
                                     ("recompute_layers", m.recompute_layers), ("attention", m.attention),
                                     ("tp_overlap", p.tp_overlap)) if value == "auto"]
    memory, no_fit, host, why = None, None, None, ()
    if gpu is not None:
        coeffs = coeffs or load_coefficients()
        memory = choose(setup, gpu.free, max(longest.values(), default=1), capacity=sched.token_capacity,
                        recompute=_recompute_setting(cfg, per_rank), coeffs=coeffs,
                        chunk_tokens=_chunk_tokens(cfg), split=p.stage_layers)
        capacity, counts = memory.capacity, list(memory.recompute_layers)
        if memory.stage_layers is not None:  # the memory-balanced split (one model chunk per rank)
            split = per_rank = list(memory.stage_layers)
        if not memory.fits:
            no_fit = no_fit_message(setup, memory, longest, cfg.source, coeffs)
        why = memory_reasons(setup, memory, max(longest.values(), default=1), coeffs,
                             _recompute_setting(cfg, per_rank), sched.token_capacity, _chunk_tokens(cfg))
    else:
        capacity = sched.token_capacity if sched.token_capacity != "auto" else \
            auto_token_capacity(CostModel(), max(longest.values(), default=1))
        rc = _recompute_setting(cfg, per_rank)
        counts = per_rank if rc == "auto" else [min(n, k) for n, k in zip(
            [rc] * p.pp if isinstance(rc, int) else rc, per_rank, strict=True)]
        host = host_need(setup, capacity, counts, world.local_processes or world.processes)
        no_fit = no_fit_on_host(host, world.host_bytes, cfg.source)
    kernels = cfg.kernels if cfg.kernels != "auto" else ("fused" if gpu is not None else "reference")
    scheduler = SchedulerConfig(pipeline_depth=p.pp, dp_size=dp, virtual_stages=p.virtual_stages,
                                **{**sched.model_dump(), "token_capacity": capacity})
    return RunPlan(cfg.source, str(m.preset or m.path), world.processes, p.tp, p.pp, dp, p.sequence_parallel,
                   p.virtual_stages, tuple(split), p.stage_layers is None, capacity,
                   _model_recompute(cfg, counts, per_rank), tuple(counts), kernels,
                   attention, m.base_precision, len(cfg.jobs),
                   scheduler, memory, gpu, tuple(auto), no_fit, host, setup, why,
                   max(longest.values(), default=1), *_tp_overlap(cfg))


def run_need(cfg: RunConfig, processes: int) -> HostNeed:
    """What ``processes`` ranks of ``cfg`` on one host need without GPUs, at the capacity and recompute its
    CPU run resolves to."""
    return resolve(cfg, dataclasses.replace(World.for_plan(cfg), local_processes=processes), None).host


def check_run_on_host(cfg: RunConfig, available: float | None = None,
                      processes: int | None = None) -> RunPlan:
    """The run's plan without a GPU, refused (:class:`MemoryFitError`, one line) when its ranks on this host
    need more memory than it has (``available``: default what the system says; ``processes``: the launch's
    ranks on this host, default ``LOCAL_WORLD_SIZE``)."""
    world = World.from_env(available_bytes() if available is None else available)
    if processes is not None:
        world = dataclasses.replace(world, local_processes=processes)
    plan = resolve(cfg, world, None)
    if not plan.fits:
        raise MemoryFitError(plan.no_fit)
    return plan

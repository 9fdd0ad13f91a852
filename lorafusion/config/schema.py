"""Run and job configuration models (pydantic v2), built on the core types.

A **run** names the base model, tokenizer, parallelism, scheduler, kernels, output directory, seed, logging
and its **jobs**. A job's ``lora`` section is validated by :class:`lorafusion.core.lora.LoRASpec` itself
(the one LoRA schema). Reading YAML, overrides, relative paths and error messages live in
:mod:`lorafusion.config.load`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, field_validator,
                      model_validator)

from lorafusion.config.bounds import (MAX_BATCH, MAX_COUNT, MAX_EPOCHS, MAX_EPS, MAX_GRAD_NORM,
                                      MAX_JOB_TOKENS, MAX_LR, MAX_PARALLEL, MAX_PRIORITY, MAX_SECONDS,
                                      MAX_SEQ_LEN, MAX_STEPS, MAX_WEIGHT_DECAY)
from lorafusion.core.errors import ConfigError
from lorafusion.core.lora import LoRASpec, check_adapter_name
from lorafusion.core.pipeline import virtual_stages_problem
from lorafusion.config.trackers import MlflowConfig, WandbConfig

__all__ = ["DATASET_FILE_TYPES", "DatasetConfig", "JobConfig", "LoggingConfig", "ModelConfig",
           "OptimizerConfig", "ParallelismConfig", "RunConfig", "SchedulerSection", "TokenizerConfig"]

# extension → `datasets` builder name
DATASET_FILE_TYPES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def _betas(v: Any) -> Any:
    if not isinstance(v, list | tuple) or len(v) != 2:
        raise ValueError(f"expected a list of two numbers [beta1, beta2], got {v!r}")
    return tuple(v)


class _Strict(BaseModel):
    # allow_inf_nan=False: .inf and .nan are rejected in every float field (a NaN lr or alpha trains nothing);
    # frozen: a loaded config is never written (what is derived from it lives in lorafusion.resolve.RunPlan)
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=False,
                              allow_inf_nan=False, frozen=True)


def _recompute_layers(v: Any) -> Any:
    if v is None or (isinstance(v, str) and v == "auto"):
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"expected an integer >= 1 or 'auto', got {v!r}")
    if v > MAX_PARALLEL:
        raise ValueError(f"expected an integer <= {MAX_PARALLEL} or 'auto', got {v!r:.40}")
    return v


class ModelConfig(_Strict):
    preset: str | None = None
    path: str | None = None  # HF model directory (config.json + safetensors)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    recompute: bool = False
    # with recompute: only the first N decoder layers of each pipeline stage are recomputed (Megatron's
    # "block" method), the others keep their activations: less recompute where the GPU has memory to spare.
    # "auto": the fewest per stage that make the run fit the GPU (scheduler/sizing.py; every layer on a CPU)
    recompute_layers: Annotated[int | Literal["auto"] | None, BeforeValidator(_recompute_layers)] = None
    # precision of the frozen base's decoder linears (qkv, proj, fc1, fc2). "fp8": each weight is quantized
    # once at load to float8_e4m3fn with one scale per output channel (its bf16 copy freed: half the bytes), X
    # and dY are quantized per row on the fly and the forward and input-gradient GEMMs run in FP8
    # (torch._scaled_mm; needs an sm_89+ GPU, or the CPU). The LoRA path, embeddings, norms, the output layer
    # and the first decoder layer's linears (lorafusion.core.precision.FP8_BF16_LEADING_LAYERS) stay in
    # `dtype`. Needs dtype: bfloat16. Exports and merges use the original bf16 weights, reloaded from the
    # source.
    base_precision: Literal["bf16", "fp8"] = "bf16"
    attention: Literal["auto", "fa4", "fa2", "per-sample"] = "auto"  # packed: models/attention.py's choices

    @model_validator(mode="after")
    def _one_source(self):
        if (self.preset is None) == (self.path is None):
            raise ValueError(
                "expected exactly one of `preset` (a preset name) or `path` (a HF model directory)")
        if self.recompute_layers is not None and not self.recompute:
            raise ValueError(f"recompute_layers: {self.recompute_layers} needs recompute: true")
        if self.base_precision == "fp8" and self.dtype != "bfloat16":
            raise ValueError("base_precision: fp8 needs dtype: bfloat16 (the FP8 GEMMs write bf16), got "
                             f"{self.dtype}")
        return self


class TokenizerConfig(_Strict):
    type: Literal["byte", "hf", "sentencepiece"] = "byte"
    # hf: a directory with tokenizer.json (default: model.path); sentencepiece: a .model file or a
    # directory holding tokenizer.model
    path: str | None = None

    @model_validator(mode="after")
    def _path_used(self) -> "TokenizerConfig":
        if self.type == "byte" and self.path is not None:  # (it was ignored, even when missing)
            raise ValueError("path: the byte tokenizer reads no file; remove tokenizer.path or set "
                             "tokenizer.type")
        return self


def _int_or_auto(v: Any) -> Any:
    if isinstance(v, str) and v == "auto":
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"expected an integer >= 1 or 'auto', got {v!r}")
    if v > MAX_PARALLEL:
        raise ValueError(f"expected an integer <= {MAX_PARALLEL} or 'auto', got {v!r:.40}")
    return v


class ParallelismConfig(_Strict):
    tp: int = Field(1, ge=1, le=MAX_PARALLEL)
    pp: int = Field(1, ge=1, le=MAX_PARALLEL)
    # "auto": every launched process not used by tp*pp is a data-parallel replica (world / (tp*pp))
    dp: Annotated[int | Literal["auto"], BeforeValidator(_int_or_auto)] = 1
    # Megatron sequence parallelism: activations between TP regions split along the sequence (needs tp > 1)
    sequence_parallel: bool = False
    # decoder layers per pipeline stage, first to last (None: even); virtual_stages V > 1: one per virtual
    # stage, pp*V in layer order (stage c*pp + r is chunk c of rank r); "auto": by the stage cost model,
    # output layer and loss on the last stage (scheduler/stages.py); uneven: Megatron's first/last or layout
    stage_layers: list[Annotated[int, Field(ge=1, le=MAX_PARALLEL)]] | Literal["auto"] | None = None
    # model chunks per pipeline rank: Megatron-core's interleaved 1F1B (virtual_pipeline_model_parallel_size);
    # "auto": the count the pipeline simulator predicts fastest on the GPU's memory (resolve.py)
    virtual_stages: Annotated[int | Literal["auto"], BeforeValidator(_int_or_auto)] = 1
    # TP collectives overlapped with compute (ops/tp_overlap.py; auto: resolve.py); chunks: without SP
    tp_overlap: Annotated[Literal["auto", "on", "off"], BeforeValidator(  # (YAML 1.1: on/off are booleans)
        lambda v: ("on" if v else "off") if isinstance(v, bool) else v)] = "auto"
    tp_overlap_chunks: int = Field(2, ge=2, le=64)

    @model_validator(mode="after")
    def _sp_needs_tp(self) -> "ParallelismConfig":
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel: true needs tp > 1 (it splits activations over the TP group)")
        if self.tp_overlap == "on" and self.tp == 1:
            raise ValueError("tp_overlap: on needs tp > 1 (it overlaps the tensor-parallel collectives)")
        if (v := self.virtual_stages) != "auto" and (why := virtual_stages_problem(self.pp, v)):
            raise ValueError(f"virtual_stages: {why}")
        if isinstance(sl := self.stage_layers, list) and len(sl) != self.pp * (
                max(1, len(sl) // self.pp) if v == "auto" else v):
            n = "pp x V for virtual_stages: auto" if v == "auto" else f"pp x virtual_stages = {self.pp * v}"
            per = "pipeline stage" if v == 1 else f"virtual stage ({n}, in layer order)"
            raise ValueError(f"stage_layers: expected one count per {per} (pp = {self.pp}), got {sl}")
        return self

    def resolve_dp(self, world: int) -> int:
        """dp for ``world`` processes: the integer, or world / (tp*pp) for auto (ValueError: no divisor)."""
        if self.dp != "auto":
            return self.dp
        mp = self.tp * self.pp
        if world % mp:
            raise ValueError(f"dp: auto needs tp*pp = {self.tp}*{self.pp} = {mp} to divide the launch's "
                             f"{world} process(es) (WORLD_SIZE; outside a launch, e.g. for "
                             f"`lorafusion plan`, set parallelism.dp to the replica count)")
        return world // mp


def _capacity(v: Any) -> Any:
    if v == "auto" and isinstance(v, str):
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"expected a positive integer or 'auto', got {v!r}")
    if v > MAX_TOKEN_CAPACITY:  # (a typo's 10**23 was refused as an adapter needing 8e16 GiB, naming lora.r)
        raise ValueError(f"expected at most {MAX_TOKEN_CAPACITY:,} tokens a microbatch or 'auto', got {v:,}")
    return v


MAX_TOKEN_CAPACITY = 1 << 24  # tokens a microbatch: far above any GPU's memory for a packed LLM microbatch


class SchedulerSection(_Strict):
    """The run YAML's ``scheduler`` section: how the data is planned. Read by
    :func:`lorafusion.resolve.resolve` only, which makes ``token_capacity: auto`` a value and hands the
    scheduler these settings as its ``SchedulerConfig`` (the one type the scheduler and the runtime read)."""

    token_capacity: Annotated[int | Literal["auto"], BeforeValidator(_capacity)] = 4096
    milp_time_limit_s: float = Field(1.0, gt=0, le=MAX_SECONDS)
    # "greedy" packs without the MILP: plans that do not depend on the machine's load (a time-limited
    # MILP can stop at different points in two runs), at some cost in padding and balance
    solver: Literal["auto", "cbc", "highs", "greedy"] = "auto"
    grouping: bool = True
    lookahead_batches: int = Field(2, ge=1, le=MAX_COUNT)  # global batches of every job per planned chunk
    # whose batches a chunk holds: every running job's ("together"), or the job with the least work left
    # (priority first) with the others filling the pipeline's idle slots ("shortest_first": the lowest mean
    # job completion time when jobs come and go), or one job at a time in arrival order ("fifo"); see
    # lorafusion/scheduler/policy.py
    policy: Literal["together", "shortest_first", "fifo"] = "together"


class DatasetConfig(_Strict):
    path: str
    format: Literal["prompt_response", "chat", "text"]
    file_type: Literal["json", "jsonl", "parquet", "csv"] | None = None
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    text_field: str = "text"
    max_seq_len: int = Field(2048, ge=2, le=MAX_SEQ_LEN)
    truncate: bool = False
    mask_prompt: bool = True

    @model_validator(mode="after")
    def _known_type(self):
        if Path(self.path).is_dir():  # (its extension is not what is wrong)
            raise ValueError(f"path: expected a data file, got a directory: {self.path!r}")
        if self.file_type is None and Path(self.path).suffix.lower() not in DATASET_FILE_TYPES:
            raise ValueError(
                f"path: cannot tell the file type of {self.path!r} from its extension; expected one of "
                f"{', '.join(DATASET_FILE_TYPES)} or set dataset.file_type"
            )
        return self

    @property
    def builder(self) -> str:
        """The ``datasets`` builder name for this file ("json", "parquet" or "csv")."""
        if self.file_type is not None:
            return "json" if self.file_type == "jsonl" else self.file_type
        return DATASET_FILE_TYPES[Path(self.path).suffix.lower()]


class OptimizerConfig(_Strict):
    lr: float = Field(2e-4, gt=0, le=MAX_LR)
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT_DECAY)
    betas: Annotated[tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]],
                     BeforeValidator(_betas)] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0, le=MAX_EPS)
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float | None = Field(1.0, gt=0, le=MAX_GRAD_NORM)


class JobConfig(_Strict):
    name: str
    dataset: DatasetConfig
    lora: LoRASpec
    # a PEFT adapter directory to start from (continued training); its settings fill lora's keys left out and
    # must agree with those given (config/init_from.py)
    init_from: str | None = None
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    global_batch_size: int = Field(ge=1, le=MAX_BATCH)  # samples per optimizer step
    max_steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    num_epochs: int | None = Field(None, ge=1, le=MAX_EPOCHS)
    save_every: int | None = Field(None, ge=1, le=MAX_STEPS)
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    # steps in a row with a non-finite loss or gradient norm (each skipped) before the job is paused: diverged
    max_nonfinite_steps: int = Field(3, ge=1, le=MAX_COUNT)
    # evaluation (runtime/evaluate.py): a held-out set — its own file, or a share of the training file drawn
    # by the run seed and removed from training — scored every eval_every steps and at the job's end
    eval_dataset: DatasetConfig | None = None
    eval_split: float | None = Field(None, gt=0, lt=1)
    eval_every: int | None = Field(None, ge=1, le=MAX_STEPS)
    early_stopping_patience: int | None = Field(None, ge=1, le=MAX_COUNT)  # evaluations without a better loss

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_adapter_name(v, field=None)

    @model_validator(mode="after")
    def _stop_rule(self):
        if self.max_steps is None and self.num_epochs is None:
            raise ValueError("max_steps: expected max_steps or num_epochs (at least one), got neither")
        if self.max_steps is not None and self.max_steps * self.global_batch_size * self.dataset.max_seq_len \
                > MAX_JOB_TOKENS:  # (token counts are int64)
            raise ValueError("max_steps: max_steps x global_batch_size x dataset.max_seq_len = "
                             f"{self.max_steps:,} x {self.global_batch_size:,} x "
                             f"{self.dataset.max_seq_len:,} tokens is over {MAX_JOB_TOKENS:,}")
        # (num_epochs: at load)
        if self.max_steps is not None and self.optimizer.warmup_steps > self.max_steps:
            raise ValueError(f"optimizer.warmup_steps: expected at most max_steps ({self.max_steps}), got "
                             f"{self.optimizer.warmup_steps}: the lr would never reach optimizer.lr")
        if self.eval_dataset is not None and self.eval_split is not None:
            raise ValueError("eval_split: expected eval_dataset (a file) or eval_split (a share of the "
                             "training file), not both")
        if self.eval_every is not None and not self.has_eval:
            raise ValueError("eval_every: needs an eval set (eval_dataset or eval_split)")
        if self.early_stopping_patience is not None and self.eval_every is None:
            raise ValueError(
                "early_stopping_patience: needs eval_every (and an eval set) to count evaluations")
        return self

    @property
    def has_eval(self) -> bool:
        return self.eval_dataset is not None or self.eval_split is not None


class LoggingConfig(_Strict):
    """``progress``: on a terminal a live table (a row per job: step/max, loss, eval loss, tokens/s, ETA); in
    a log file a job's line at its first and last step and in between at most every ``log_every_s`` seconds,
    at steps that are multiples of ``log_every``. Trackers: ``tensorboard`` (OUTPUT_DIR/tensorboard),
    ``wandb`` (:class:`WandbConfig`; ``wandb: true`` = its defaults, offline) and ``mlflow``
    (:class:`MlflowConfig`; ``mlflow: true`` = its defaults, a file store in OUTPUT_DIR/mlruns)."""

    tensorboard: bool = True
    progress: bool = True
    log_every: int = Field(1, ge=1, le=MAX_STEPS)
    log_every_s: float = Field(30.0, ge=0, le=MAX_SECONDS)
    wandb: Annotated[WandbConfig | None,
                     BeforeValidator(lambda v: {} if v is True else None if v is False else v)] = None
    mlflow: Annotated[MlflowConfig | None,
                      BeforeValidator(lambda v: {} if v is True else None if v is False else v)] = None


class CheckpointConfig(_Strict):
    """When jobs without ``save_every`` are checkpointed: every ``every_minutes`` of training (all jobs at one
    chunk boundary) and at the end; a stop signal (SIGTERM, SIGUSR1, SIGINT) checkpoints every job too.
    ``keep_last``: complete checkpoints kept per job (older ones are removed)."""

    every_minutes: float = Field(30.0, gt=0, le=MAX_SECONDS / 60)
    keep_last: int = Field(3, ge=1, le=MAX_COUNT)


class RunConfig(_Strict):
    model: ModelConfig
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    kernels: Literal["auto", "fused", "reference"] = "auto"
    """The LoRA ops' implementation: "fused" (the Triton kernels, CUDA only), "reference" (plain torch),
    "auto" (fused on CUDA, reference elsewhere); internally "triton" / "torch" / None
    (:mod:`lorafusion.core.impls`)."""
    jobs: list[JobConfig] = Field(min_length=1)
    output_dir: str
    seed: int = Field(1234, ge=0, le=2**63 - 1)  # torch and Megatron take seeds of at most 64 bits
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    # after the last job ends, keep waiting for `lorafusion submit` (until serve_idle_minutes)
    serve: bool = False
    serve_idle_minutes: float = Field(30.0, gt=0, le=MAX_SECONDS / 60)

    @field_validator("output_dir")
    @classmethod
    def _output_dir(cls, v: str) -> str:
        if not v:  # "" would train into the current directory
            raise ValueError(f"expected a directory path (the run's own directory), got {v!r}")
        if long := [p for p in Path(v).parts if len(p.encode()) > 255]:  # (every later stat: ENAMETOOLONG)
            raise ValueError(f"a name in it is {len(long[0].encode())} bytes, over the file system's 255: "
                             f"{long[0]:.40}...")
        return v

    @model_validator(mode="after")
    def _cross(self):
        seen: dict[str, int] = {}
        for i, job in enumerate(self.jobs):
            if job.name in seen:
                raise ValueError(f"jobs: duplicate job name {job.name!r} (jobs {seen[job.name]} and {i}); "
                                 f"expected unique names")
            seen[job.name] = i
        if "tokenizer" not in self.model_fields_set and self.model.path is not None:
            # a real model without a tokenizer section: its own tokenizer files, never byte ids on its
            # vocabulary (set while validating: the model is frozen once built)
            d = Path(self.model.path)
            if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file() or not d.is_dir():
                object.__setattr__(self, "tokenizer", TokenizerConfig(type="hf"))
            elif (d / "tokenizer.model").is_file():
                object.__setattr__(self, "tokenizer", TokenizerConfig(type="sentencepiece",
                                                                      path=str(d / "tokenizer.model")))
            else:
                raise ValueError(f"tokenizer: model.path {self.model.path} has no tokenizer files "
                                 "(tokenizer.json, tokenizer_config.json or tokenizer.model); add a "
                                 f"tokenizer section (type hf with a path, or sentencepiece)")
        if self.tokenizer.type == "hf" and self.tokenizer.path is None and self.model.path is None:
            raise ValueError("tokenizer.path: expected a HF tokenizer directory (required when model.path "
                             "is not set)")
        if self.tokenizer.type == "sentencepiece" and self.tokenizer.path is None:
            raise ValueError("tokenizer.path: expected the sentencepiece model file")
        cap = self.scheduler.token_capacity
        if cap != "auto":
            for i, job in enumerate(self.jobs):
                if job.dataset.max_seq_len > cap:  # (an eval sample over the capacity is evaluated alone)
                    raise ValueError(
                        f"jobs.{i}.dataset.max_seq_len: expected at most scheduler.token_capacity ({cap}) "
                        f"so every sample fits one microbatch, got {job.dataset.max_seq_len}")
        return self

    # the run YAML this came from (set by load_run_config), for errors raised after loading
    _source: str = PrivateAttr(default="<config>")

    @property
    def source(self) -> str:
        """The run YAML as shown in messages (``<config>`` when built in code)."""
        return self._source

    def check_world_size(self, world_size: int | None = None) -> int:
        """The data-parallel size for ``world_size`` launched processes (default: the ``WORLD_SIZE``
        torchrun/Slurm set, 1 without it): ``parallelism.dp``, or for ``auto`` the launch over tp*pp.
        ConfigError unless tp * pp * dp equals the launch. Nothing is written:
        :func:`lorafusion.resolve.resolve` records the value."""
        world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        p = self.parallelism
        try:
            dp = p.resolve_dp(world)
        except ValueError as e:
            raise ConfigError(f"{self.source}: parallelism.{e}") from None
        if p.tp * p.pp * dp != world:
            raise ConfigError(f"{self.source}: parallelism: tp*pp*dp = {p.tp}*{p.pp}*{dp} = "
                              f"{p.tp * p.pp * dp}, but the launch has {world} process(es)")
        return dp

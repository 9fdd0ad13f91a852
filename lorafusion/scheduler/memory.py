"""Peak GPU memory of one pipeline stage, torch-free: what sizes the token capacity and the recompute.

A stage's peak allocated bytes (what ``torch.cuda.max_memory_allocated`` reports) are modelled as::

    static     = frozen base weights (bytes per parameter by precision: bf16 2, fp8 1 + per-row scales)
               + every job's LoRA weights and fp32 AdamW moments (12 bytes per parameter)
    per mb     = capacity · Σ_layers saved(layer) · act_scale       saved activations of one microbatch:
                 a layer that keeps its activations saves its tensors (``saved_elems``), a recomputed one
                 its input; plus the microbatch's bf16 copies of its adapters' A and B in each layer that
                 keeps them, the stage output the schedule keeps (not the last stage) and the loss's saved
                 hidden-size tensors (last stage)
    transient  = max(backward working set of one layer, one logits chunk of the fused linear cross-entropy
                     (last stage)); gradients = the jobs' fp32 LoRA gradients (4 bytes per parameter)
    peak       = static + constant + the largest of (others = (in_flight - 1) · per mb):
                   others + per mb + transient                      the start of the backward
                   others + recomputed layers' checkpoints + one recomputed layer + workspace + gradients
                   others + gradients + one job's optimizer step

``in_flight`` is the number of microbatches whose activations a stage holds at once: ``pp - stage`` under
1F1B; interleaved 1F1B with ``v`` virtual stages holds ``(2·(pp - stage - 1) + (v - 1)·pp + 1)`` model
chunks of ``1/v`` of the stage's layers (Megatron's warm-up count), i.e. that many ``/ v`` microbatches.

The analytic parts count tensors from the code (ops/fused.py saves X, S, A_cat, B_cat; the fused SwiGLU saves
fc1's output; RMSNorm its input; the packed attention what its path keeps, ``attention_elems``: counting one
path for points measured on another was the 8B shape's 4-5% over-prediction). With the fused ops, the X of
linear_qkv, linear_fc1 (the normed inputs) and linear_fc2 (the SwiGLU output) is not kept but rebuilt in
backward from what the norms and the SwiGLU keep (ops/saved.py; ``saved_elems``); the frozen bases keep no X.
The committed calibration points were measured before that (``MemorySetup.rebuilt_inputs`` False). Four
coefficients are measured on a GPU and fitted (``scripts/calibrate_memory.py``): ``act_scale`` (measured /
counted saved activations), ``workspace`` (the backward working set per token, in units of ``2·ffn +
2·hidden`` elements), ``opt_copies`` (an optimizer step's fp32 temporaries: the flat copies kept to undo a
non-finite step, AdamW's foreach math, in units of the job's parameters) and ``constant_bytes`` (cuBLAS
workspace, routing tables, RoPE caches; negative when the counts over-estimate). ``margin_frac`` /
``margin_bytes``: what a plan keeps free on top of the prediction (the model's error, the allocator's reserved
memory above allocated, CUDA context and NCCL buffers outside the allocator). See ``memory_coefficients.json``
and docs/BENCHMARKS.md "Memory model".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from lorafusion.core.arch import ModelArch
from lorafusion.core.lora import lora_layer_params, lora_s_width
from lorafusion.core.targets import MEGATRON_TARGETS, resolve_target_modules

__all__ = ["ATTENTION_PATHS", "GIB", "AdapterShape", "Coefficients", "MemorySetup", "StageMemory",
           "in_flight", "load_coefficients", "plan_memory", "stage_memory"]

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LORA_STATE_BYTES = 16  # fp32 weight + fp32 gradient + fp32 AdamW exp_avg and exp_avg_sq (runtime/optim.py)
LOGITS_CHUNK_BYTES = 1 << 30  # models/fused/linear_cross_entropy.py: one chunk's fp32 logits stay under this
COEFFICIENTS_FILE = Path(__file__).with_name("memory_coefficients.json")
ATTENTION_PATHS = ("varlen", "varlen-gqa", "fa4", "per-sample")
ATTENTION_DEFAULT = "varlen"


@dataclass(frozen=True)
class AdapterShape:
    """What of a job's LoRA settings memory depends on."""

    r: int
    targets: tuple[str, ...] = MEGATRON_TARGETS
    dropout: float = 0.0
    # one A per projection of a fused linear (q, k, v; gate, up: PEFT's layout) or one A shared by the fused
    # linear (the layers' layout before PEFT-exact fused projections)
    independent_a: bool = False


@dataclass(frozen=True)
class Coefficients:
    """Fitted on a GPU by ``scripts/calibrate_memory.py`` (``source`` says where and when)."""

    act_scale: float = 1.0
    workspace: float = 1.0
    constant_bytes: float = 1.0 * GIB
    opt_copies: float = 7.0  # a step's fp32 temporaries in units of the job's LoRA parameters
    margin_frac: float = 0.05
    margin_bytes: float = 1.5 * GIB
    # more kept free when the run spans several GPUs (pipeline p2p and collectives: NCCL's memory outside the
    # allocator that grows after the start, the allocator's reserve under microbatches of changing size)
    multi_gpu_margin_bytes: float = 0.0
    source: str = "defaults (not measured)"


def load_coefficients(path: str | Path | None = None) -> Coefficients:
    """The committed coefficients (``memory_coefficients.json`` beside this module)."""
    data = json.loads(Path(path or COEFFICIENTS_FILE).read_text())
    names = {f.name for f in fields(Coefficients)}
    return Coefficients(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class MemorySetup:
    """A run's shape as far as memory goes (one stage's share is computed from it)."""

    arch: ModelArch
    adapters: tuple[AdapterShape, ...]
    dtype: str = "bfloat16"
    # bytes per frozen parameter of the decoder's linears; None: the dtype's. FP8 base: 1 (scales:
    # row_scale_bytes)
    base_bytes_per_param: float | None = None
    row_scale_bytes: int = 0  # per output row of each base linear (fp8: one fp32 scale per channel = 4)
    # fp8 base: the model's first decoder layers whose linears keep the dtype (stage 0)
    bf16_base_layers: int = 0
    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    stage_layers: tuple[int, ...] | None = None
    virtual_stages: int = 1
    fused_ops: bool = True  # the fused RMSNorm / SwiGLU / linear cross-entropy (the GPU default)
    # what the core attention saves (``attention_elems``): "varlen" (torch's FlashAttention varlen op, k and v
    # expanded to the query heads first: a torch without its enable_gqa), "varlen-gqa" (the same op given the
    # grouped k and v), "fa4" (FlashAttention-4, grouped k and v) or "per-sample" (one SDPA per sample:
    # models/attention.py's fallback and CPU path)
    attention: str = ATTENTION_DEFAULT
    # the LoRA linears' inputs that are cheap functions of kept tensors (the normed inputs of qkv and fc1,
    # the SwiGLU output) rebuilt in backward (``saved_elems``); False: kept, as by the code that measured the
    # committed calibration points (their raw records have no ``rebuilt_inputs`` field)
    rebuilt_inputs: bool = True

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def layers(self, stage: int) -> int:
        if self.stage_layers is not None:
            return self.stage_layers[stage]
        return self.arch.num_layers // self.pp


@dataclass
class StageMemory:
    """Predicted bytes of one stage at one capacity and recompute setting (``peak`` = allocated)."""

    stage: int
    layers: int
    recompute_layers: int
    capacity: int
    in_flight: float
    weights: float
    lora: float
    per_microbatch: float
    transient: float
    optimizer_step: float
    constant: float
    peak: float = 0.0
    need: float = 0.0  # peak with the margin: what must be free on the GPU
    parts: dict = field(default_factory=dict)

    def fits(self, gpu_bytes: float) -> bool:
        return self.need <= gpu_bytes


def in_flight(pp: int, stage: int, virtual_stages: int = 1) -> float:
    """Microbatches' worth of this stage's activations held at the peak (1F1B: ``pp - stage``)."""
    v = max(1, virtual_stages)
    if v == 1:
        return float(pp - stage)
    return (2 * (pp - stage - 1) + (v - 1) * pp + 1) / v


def _linear_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """(in, out) features of each decoder linear (unsharded)."""
    h, kv = arch.hidden_size, arch.kv_channels
    q, g = arch.num_attention_heads * kv, arch.num_query_groups * kv
    return {"linear_qkv": (h, q + 2 * g), "linear_proj": (q, h), "linear_fc1": (h, 2 * arch.ffn_hidden_size),
            "linear_fc2": (arch.ffn_hidden_size, h)}


def lora_params_per_layer(arch: ModelArch, a: AdapterShape, tp: int = 1) -> float:
    """One adapter's LoRA parameters in one decoder layer on one TP rank
    (:func:`lorafusion.core.lora.lora_layer_params`: the one count of an adapter's size)."""
    return float(lora_layer_params(arch, a.r, a.targets, shared_a=not a.independent_a, tp=tp))


def base_bytes_per_layer(s: MemorySetup) -> float:
    """Frozen bytes of one decoder layer on one TP rank (linears at the base precision, norms at the
    dtype)."""
    per = s.dtype_bytes if s.base_bytes_per_param is None else s.base_bytes_per_param
    total = 0.0
    for fin, fout in _linear_shapes(s.arch).values():
        total += fin * fout / s.tp * per + fout / s.tp * s.row_scale_bytes
    if s.arch.qkv_bias:
        total += _linear_shapes(s.arch)["linear_qkv"][1] / s.tp * s.dtype_bytes
    return total + 2 * s.arch.hidden_size * s.dtype_bytes


def attention_elems(s: MemorySetup) -> float:
    """Elements per token the core attention keeps for backward (unsharded; q = heads x head dim, g = query
    groups x head dim), counted with ``torch.autograd.graph.saved_tensors_hooks`` on the model code
    (``scripts/count_saved_bytes.py``; storages counted once):

    - "varlen-gqa": qkv's output (v is a view of it), the rotated q and k, the output (which linear_proj saves
      as its input too): ``(q + 2g) + (q + g) + q``;
    - "fa4": the rotated q and k, v copied out of qkv's output (so that is not kept), the output and
      FlashAttention-4's fp32 log-sum-exp, one per head: ``2q + 2g + 4·heads / dtype bytes``;
    - "varlen": the rotated q, k and v expanded to the query heads (new tensors: neither the rotated k nor
      qkv's output is kept), the output: ``4q``;
    - "per-sample": as "varlen", plus the per-sample outputs SDPA keeps beside their concatenation (what
      linear_proj saves): ``5q``. The committed calibration grids ran most of their points on this path: an
      out-of-memory error inside ``varlen_attn`` switched models/attention.py to its per-sample fallback for
      the rest of the process (it caught ``RuntimeError``, ``torch.OutOfMemoryError`` included). On the H100
      grid every point after the first out-of-memory one peaked exactly 2q bytes per token per kept layer
      above the same point on the H200 grid, which had none (8B, half recompute: 131,072 B per token = 16
      layers x 4,096 x 2)."""
    a = s.arch
    q, g = a.num_attention_heads * a.kv_channels, a.num_query_groups * a.kv_channels
    if s.attention == "varlen-gqa":
        return 3 * q + 3 * g
    if s.attention == "fa4":
        return 2 * q + 2 * g + a.num_attention_heads * 4 / s.dtype_bytes
    if s.attention == "varlen":
        return 4 * q
    if s.attention == "per-sample":
        return 5 * q
    raise ValueError(f"attention: expected one of {ATTENTION_PATHS}, got {s.attention!r}")


def saved_elems(s: MemorySetup) -> float:
    """Elements saved per token by one decoder layer that keeps its activations (one TP rank).

    With the fused ops (``fused_ops``, the GPU default): the layer input and the pre-MLP residual (what the
    two RMSNorms keep; sharded under sequence parallelism), the attention's tensors (:func:`attention_elems`;
    linear_proj's input is the attention output counted there) and fc1's output (the SwiGLU's backward).
    The LoRA linears' other inputs are cheap functions of those and are rebuilt in backward instead of kept
    (lorafusion/ops/saved.py): linear_fc2's, the SwiGLU output (``f``), from fc1's output; linear_qkv's and
    linear_fc1's, the normed inputs (``2h``), from the norms' inputs — under sequence parallelism the
    all-gathered input is rebuilt from the norm's shard and gathered again, so none of it is kept either.
    The frozen base linears keep no input (their weight only). Measured with scripts/count_saved_bytes.py
    (tests/models/test_saved_activations.py counts the same on CPU).

    Megatron's local ops (``fused_ops`` False: torch's RMSNorm keeps fp32 copies of its input, the unfused
    SwiGLU its two halves): nothing is rebuilt — the normed inputs and the SwiGLU output are kept."""
    a = s.arch
    h, f = a.hidden_size, a.ffn_hidden_size
    seq = h / s.tp if s.sequence_parallel else h  # tensors outside the TP regions
    if s.fused_ops:
        kept = 0.0 if s.rebuilt_inputs else 2 * seq + f / s.tp  # (the code before the rebuild)
        return 2 * seq + (attention_elems(s) + 2 * f) / s.tp + kept
    # norm inputs and their fp32 copies, the normed inputs; fc1's output, its two halves, the SwiGLU output
    return 8 * seq + (attention_elems(s) + 2 * f + 2 * f + f) / s.tp


def lora_elems(s: MemorySetup) -> float:
    """LoRA's saved elements per token per layer: S = drop(X)·Aᵀ of each targeted linear (width = projections
    x the largest rank: one row's adapter decides). The same for the reference kernels on a GPU: their torch
    path (ops.reference.multi_lora_delta_torch) saves X and S like the fused one and regenerates the dropout
    mask in backward; it keeps no dropped input (counting one over-predicted its H100 run at 7,680 tokens by
    13.5 GiB: 68.3 predicted, 54.8 measured: docs/results/e2e-8b-auto-tuned-h100.json)."""
    if not s.adapters:
        return 0.0
    r = max(a.r for a in s.adapters)
    targets = resolve_target_modules([t for a in s.adapters for t in a.targets])  # (their union)
    return float(lora_s_width(r, targets, shared_a=not any(a.independent_a for a in s.adapters)))


def _loss_chunk_tokens(vocab: int) -> int:
    return max(64, LOGITS_CHUNK_BYTES // (4 * vocab) // 64 * 64)


def stage_weights(s: MemorySetup, stage: int) -> float:
    """Frozen bytes of one stage: its decoder layers, the embedding (first), the final norm and the output
    layer (last; shared with the embedding when tied on a one-stage model)."""
    a, b = s.arch, s.dtype_bytes
    first, last = stage == 0, stage == s.pp - 1
    emb = a.vocab_size * a.hidden_size / s.tp * b
    weights = s.layers(stage) * base_bytes_per_layer(s) + (emb if first else 0.0)
    # fp8 base, leading layers in dtype
    if first and s.bf16_base_layers and s.base_bytes_per_param is not None:
        kept = min(s.bf16_base_layers, s.layers(0))
        full = replace(s, base_bytes_per_param=None, row_scale_bytes=0)
        weights += kept * (base_bytes_per_layer(full) - base_bytes_per_layer(s))
    if last and not (first and a.tie_word_embeddings):
        weights += emb
    return weights + ((a.hidden_size * b) if last else 0.0)


def stage_memory(s: MemorySetup, stage: int, capacity: int, recompute_layers: int = 0,
                 coeffs: Coefficients | None = None, n_in_flight: float | None = None,
                 grads_before_backward: bool = True) -> StageMemory:
    """Predicted peak of ``stage`` with microbatches of ``capacity`` tokens and the first ``recompute_layers``
    decoder layers of the stage recomputed: the largest of three moments of the last microbatch in flight —
    the start of its backward (every saved activation), the backward of its recomputed layers (their
    checkpoints, one recomputed layer, the gradients) and an optimizer step. ``grads_before_backward``: the
    adapters' gradients already exist when a backward starts (microbatches of a global batch accumulate them;
    the calibration measured them held at a lone microbatch's peak too, and predicts its points with True).
    ``n_in_flight``: instead of the schedule's count."""
    c = coeffs or Coefficients()
    a, b = s.arch, s.dtype_bytes
    L, last = s.layers(stage), stage == s.pp - 1
    n_rc = min(max(0, recompute_layers), L)
    h_rank = a.hidden_size / s.tp if s.sequence_parallel else a.hidden_size
    lora_layer = [lora_params_per_layer(a, ad, s.tp) for ad in s.adapters]
    grads = L * sum(lora_layer) * 4
    lora = L * sum(lora_layer) * LORA_STATE_BYTES
    ab_layer = sum(lora_layer) * b  # bf16 A_cat/B_cat saved per layer that keeps its activations
    layer_act = (saved_elems(s) + lora_elems(s)) * b * c.act_scale  # per token
    ckpt_act = h_rank * b * c.act_scale
    extra = (0.0 if last else h_rank * b) + (3 * h_rank * b if last else 0.0)  # stage output / loss tensors
    per_mb = capacity * ((L - n_rc) * layer_act + n_rc * ckpt_act + extra) + ab_layer * (L - n_rc)
    work = capacity * c.workspace * (2 * a.ffn_hidden_size / s.tp + 2 * a.hidden_size) * b
    loss_chunk = min(capacity, _loss_chunk_tokens(a.vocab_size)) * a.vocab_size / s.tp * 4 if last else 0.0
    job_max = max(lora_layer, default=0.0) * L
    opt = c.opt_copies * 4 * job_max + (2 * 4 * job_max if s.dp > 1 else 0.0)
    n_fl = in_flight(s.pp, stage, s.virtual_stages) if n_in_flight is None else n_in_flight
    others = max(0.0, n_fl - 1) * per_mb
    moments = [others + per_mb + max(work, loss_chunk) + (grads if grads_before_backward else 0.0),
               others + grads + opt]
    if n_rc:
        moments.append(others + capacity * (n_rc * ckpt_act + layer_act) + ab_layer + work + grads)
    peak = stage_weights(s, stage) + lora - grads + c.constant_bytes + max(moments)
    return StageMemory(stage, L, n_rc, capacity, n_fl, stage_weights(s, stage), lora, per_mb,
                       max(work, loss_chunk), opt, c.constant_bytes, peak=peak,
                       need=peak * (1 + c.margin_frac) + c.margin_bytes
                       + (c.multi_gpu_margin_bytes if s.tp * s.pp * s.dp > 1 else 0.0),
                       parts={"activations": n_fl * per_mb, "per_token_per_layer": layer_act})


def plan_memory(s: MemorySetup, capacity: int, recompute_layers: int | Sequence[int] = 0,
                coeffs: Coefficients | None = None) -> list[StageMemory]:
    """Every stage's :class:`StageMemory`; ``recompute_layers`` one count for every stage or one per stage."""
    rc = [recompute_layers] * s.pp if isinstance(recompute_layers, int) else list(recompute_layers)
    return [stage_memory(s, k, capacity, rc[k], coeffs) for k in range(s.pp)]

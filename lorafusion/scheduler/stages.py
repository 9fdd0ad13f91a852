"""Stage splits: how much of a microbatch's work each (virtual) pipeline stage does, and a loss-aware split.

A pipeline of S ranks with V model chunks each has ``S·V`` virtual stages in layer order (virtual stage
``k = c·S + r`` is chunk c of rank r). Virtual stage k holds ``split[k]`` decoder layers; the last one also
computes the output layer (``vocab × hidden``, frozen: forward and the input gradient) and the loss, which
this module counts as ``loss_layers`` decoder-layer equivalents of work. The first one's embedding lookup is
``embedding`` layers (the stage cost model's ``first_rank``: measured slightly below 0).

``loss_layers`` a priori is the FLOP ratio of the output layer to a decoder layer (:func:`flop_loss_layers`,
1.23 for LLaMA-3.1-70B); the 128k-vocabulary softmax and cross entropy are memory-bound work the FLOP count
misses, so :func:`loss_layers` is that ratio times the factor fitted to the per-rank busy time of the
pipeline runs on GPUs (:mod:`.stagecost`, scripts/fit_stage_costs.py: 2.47 layers for the 70B).

:func:`auto_split` places layers one at a time on the least-loaded rank (its least-loaded virtual stage; on
a tie the later rank, which holds fewer microbatches' activations), which for unit-size layers minimises the
busiest rank's work; :func:`stage_costs` turns a split into the
simulator's per-virtual-stage (forward, backward) shares of the whole-model forward time.
"""

from __future__ import annotations

from collections.abc import Sequence

from lorafusion.core.arch import ModelArch

from .costmodel import CostModel
from .spec import PlanError
from .stagecost import layer_precisions, load_stage_costs
# forward FLOPs per second per GPU at which the simulator (backward = 2x forward) reproduces the busy time of
# that run (4x H200, bf16): 8.3e14; a frozen base's backward is nearer 1x, i.e. about 5.6e14 FLOP/s of GEMMs
SIM_FLOPS_PER_S = 8.3e14
CALIBRATION = ("cost model fitted on the 70B PP=4 run on 4x H200: simulated 0.125 vs measured 0.119, "
               "per-stage rms error 0.015; docs/results/pipeline-interleaved-sim.json")


def decoder_layer_params(arch: ModelArch) -> int:
    """Weights of the linears of one decoder layer (qkv, proj, fc1 with the gate, fc2)."""
    h, kv = arch.hidden_size, arch.kv_channels
    qkv = h * kv * (arch.num_attention_heads + 2 * arch.num_query_groups)
    return qkv + kv * arch.num_attention_heads * h + 3 * h * arch.ffn_hidden_size


def flop_loss_layers(arch: ModelArch) -> float:
    """Output layer over one decoder layer, by GEMM FLOPs per token (both frozen: same ratio backward)."""
    return arch.vocab_size * arch.hidden_size / decoder_layer_params(arch)


def loss_layers(arch: ModelArch) -> float:
    """Output layer + loss in decoder-layer equivalents: the FLOP ratio times the fitted factor."""
    return load_stage_costs().loss_factor(arch) * flop_loss_layers(arch)


def embedding_layers() -> float:
    """The first rank's work beyond its decoder layers (the embedding lookup), in bf16 layers: fitted."""
    return load_stage_costs().first_rank


def split_weights(arch: ModelArch, bf16_leading: int | None = None) -> tuple[float, float]:
    """(output layer + loss, the first rank's extra work) in units of one of the base's decoder layers, for
    :func:`auto_split`: with an FP8 base (``bf16_leading``: its leading layers kept in bf16) the bf16 loss
    weighs more FP8 layers, and the leading bf16 layers' extra cost counts on the first rank."""
    costs = load_stage_costs()
    f = 1.0 if bf16_leading is None else costs.fp8_layer
    return loss_layers(arch) / f, (costs.first_rank + (bf16_leading or 0) * (1.0 - f)) / f


def even_split(num_layers: int, num_stages: int, virtual_stages: int = 1) -> list[int]:
    n = num_stages * virtual_stages
    if num_layers % n:
        raise PlanError(f"{num_layers} layers do not split evenly over pp={num_stages} x virtual_stages="
                        f"{virtual_stages} = {n} stages; give parallelism.stage_layers or 'auto'")
    return [num_layers // n] * n


def check_split(split: Sequence[int], num_layers: int, num_stages: int, virtual_stages: int = 1) -> list[int]:
    n = num_stages * virtual_stages
    split = [int(x) for x in split]
    if len(split) != n or sum(split) != num_layers or min(split) < 1:
        per = ("pipeline stage" if virtual_stages == 1
               else f"virtual stage (pp x virtual_stages = {n}, in layer order)")
        raise PlanError(f"parallelism.stage_layers: expected one count >= 1 per {per}, {n} in all, summing "
                        f"to num_layers={num_layers}, got {split}")
    return split


def auto_split(num_layers: int, num_stages: int, virtual_stages: int = 1, loss: float = 0.0,
               embedding: float = 0.0) -> list[int]:
    """Layers per virtual stage (layer order) balancing each rank's work, the loss counted on the last one."""
    S, V = num_stages, virtual_stages
    n = S * V
    if num_layers < n:
        raise PlanError(f"{num_layers} layers cannot fill pp={S} x virtual_stages={V} = {n} stages")
    extra = [0.0] * n
    extra[0] += embedding
    extra[-1] += loss
    split = [1] * n
    for _ in range(num_layers - n):
        rank_load = [sum(split[k] + extra[k] for k in range(r, n, S)) for r in range(S)]
        # ties: a later rank (fewer microbatches in flight)
        r = min(range(S), key=lambda i: (rank_load[i], -i))
        k = min(range(r, n, S), key=lambda i: (split[i] + extra[i], i))
        split[k] += 1
    return split


def stage_costs(split: Sequence[int], loss: float = 0.0, backward_ratio: float = 2.0,
                embedding: float = 0.0) -> list[tuple[float, float]]:
    """Per virtual stage: (forward, backward) time as a fraction of the whole model's forward time."""
    work = [float(x) for x in split]
    work[0] += embedding
    work[-1] += loss
    total = sum(work)
    return [(w / total, backward_ratio * w / total) for w in work]


def recompute_stage_costs(split: Sequence[int], loss: float, num_stages: int, per_chunk: Sequence[int],
                          backward_ratio: float = 2.0, bf16_leading: int | None = None,
                          embedding: float = 0.0) -> list[tuple[float, float]]:
    """:func:`stage_costs` with each virtual stage's recomputed layers (rank r's count per model chunk,
    ``per_chunk[r]``, at most the stage's layers; Megatron counts recompute per chunk) added to its backward,
    each at the stage cost model's ``recompute`` of its layer's forward + backward; an FP8 base's layers
    (``bf16_leading``: its leading bf16 layers) at its ``fp8_layer``; ``embedding`` on the first stage."""
    costs = load_stage_costs()
    prec = layer_precisions(split, bf16_leading)
    work = [bf + costs.fp8_layer * fp for bf, fp in prec]
    total = sum(work) + loss + embedding
    out = []
    for i, (f, b) in enumerate(stage_costs(work, loss, backward_ratio, embedding)):
        rc = min(per_chunk[i % num_stages], split[i])
        rc_bf = min(rc, prec[i][0])
        extra = costs.recompute * (rc_bf + costs.fp8_layer * (rc - rc_bf))
        out.append((f, b + (1 + backward_ratio) * extra / total))
    return out


def rank_loads(split: Sequence[int], num_stages: int, loss: float = 0.0) -> list[float]:
    """Each rank's work in layer equivalents (its virtual stages summed)."""
    work = [float(x) for x in split]
    work[-1] += loss
    return [sum(work[k] for k in range(r, len(work), num_stages)) for r in range(num_stages)]


def flop_cost_model(arch: ModelArch, loss: float | None = None, tp: int = 1,
                    flops_per_s: float = SIM_FLOPS_PER_S) -> CostModel:
    """Whole-model forward seconds of a microbatch from FLOPs: linears and output/loss per token, causal
    attention per sample² (QKᵀ and AV, half of each), on ``tp`` GPUs at ``flops_per_s`` each."""
    loss = loss_layers(arch) if loss is None else loss
    per_s = flops_per_s * tp
    b = 2.0 * decoder_layer_params(arch) * (arch.num_layers + loss) / per_s
    c = 2.0 * arch.hidden_size * arch.num_layers / per_s
    return CostModel(a=0.0, b=b, c=c, gamma=0.0)


def resolve_split(stage_layers, num_layers: int, num_stages: int, virtual_stages: int = 1,
                  loss: float = 0.0, embedding: float = 0.0) -> list[int]:
    """``parallelism.stage_layers`` as counts per virtual stage: None → even (Megatron's default),
    "auto" → :func:`auto_split`, a list → checked."""
    if stage_layers is None:
        return even_split(num_layers, num_stages, virtual_stages)
    if stage_layers == "auto":
        return auto_split(num_layers, num_stages, virtual_stages, loss, embedding)
    return check_split(stage_layers, num_layers, num_stages, virtual_stages)

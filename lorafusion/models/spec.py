"""``ModelArch`` (:mod:`lorafusion.core.arch`) → Megatron ``TransformerConfig`` (our subclass,
:mod:`.config`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorafusion.core.arch import ModelArch
from lorafusion.core.errors import ConfigError
from lorafusion.models.config import LoRAFusionConfig


# the settings every model of ours shares: LLaMA/Qwen2 blocks (RMSNorm, SwiGLU, no linear biases but qkv's),
# no dropout in the frozen base (LoRA dropout is per adapter), no fusions of Apex/TE, weights initialised by
# us (models.provider.init_random_weights or HF import), packed variable-length microbatches, per-token loss
_FIXED = dict(
    normalization="RMSNorm",
    gated_linear_unit=True,
    activation_func=torch.nn.functional.silu,
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    use_cpu_initialization=True,
    perform_initialization=False,
    deallocate_pipeline_outputs=False,
    variable_seq_lengths=True,
    calculate_per_token_loss=True,
    moe_token_dispatcher_type="alltoall",
)


def _recompute(recompute: bool, recompute_layers: int | None, stage_max: int, virtual_stages: int) -> dict:
    """Megatron's recompute settings: none, every layer, or the first ``recompute_layers`` of each stage."""
    if recompute_layers is not None and not recompute:
        raise ConfigError(f"model.recompute_layers: {recompute_layers} needs model.recompute: true")
    if recompute and recompute_layers is not None:
        if recompute_layers > stage_max:
            raise ConfigError(f"model.recompute_layers: {recompute_layers} is more than the "
                              f"{stage_max} decoder layers of a pipeline stage"
                              f"{'' if virtual_stages == 1 else ' (model chunk)'}")
        return dict(recompute_granularity="full", recompute_method="block",
                    recompute_num_layers=recompute_layers)
    if recompute:
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return {}


def transformer_config(arch: ModelArch, params_dtype: torch.dtype = torch.float32, *, tp: int = 1,
                       pp: int = 1, recompute: bool = False, recompute_layers: int | None = None,
                       sequence_parallel: bool = False, stage_layers: Sequence[int] | None = None,
                       virtual_stages: int = 1, **overrides):
    """The Megatron ``TransformerConfig`` for ``arch`` (no dropout in the frozen base; LoRA dropout is
    per adapter). ``recompute``: full activation recomputation of every decoder layer, or with
    ``recompute_layers`` of the first N of each pipeline stage (each model chunk with ``virtual_stages``).
    ``sequence_parallel`` needs tp > 1. ``virtual_stages`` V > 1: Megatron's interleaved 1F1B
    (``virtual_pipeline_model_parallel_size``); ``stage_layers`` then counts per virtual stage (pp·V, layer
    order)."""
    if arch.num_query_groups % tp:
        raise ConfigError(f"parallelism.tp: {tp} must divide num_query_groups={arch.num_query_groups}")
    split, stage_max = _split(arch.num_layers, pp, virtual_stages, stage_layers)
    if sequence_parallel and tp == 1:
        raise ConfigError("parallelism.sequence_parallel: needs tp > 1")
    kw = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        ffn_hidden_size=arch.ffn_hidden_size,
        kv_channels=arch.kv_channels,
        layernorm_epsilon=arch.norm_eps,
        add_qkv_bias=arch.qkv_bias,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        autocast_dtype=params_dtype,
        cuda_graph_scope=[],  # megatron's default "full" warns "full scope is deprecated"; [] is the same
        **_FIXED,
        **_recompute(recompute, recompute_layers, stage_max, virtual_stages),
    )
    kw.update(split)
    kw.update(overrides)
    return LoRAFusionConfig(arch=arch, **kw)


def _split(num_layers: int, pp: int, virtual_stages: int,
           stage_layers: Sequence[int] | None) -> tuple[dict, int]:
    """Megatron's split arguments for ``stage_layers`` (per virtual stage, layer order) and the largest count:
    even → Megatron's default; V = 1 with equal middle stages → first/last-stage counts; otherwise
    ``pipeline_model_parallel_layout`` (embedding on the first virtual stage, loss on the last)."""
    V = virtual_stages
    n = pp * V
    # interleaved: each direction's p2p on its own (batched, a PP=2 ring sends activations and gradients
    # between the same two ranks in one batch, where they can cross), finished before compute goes on, not
    # overlapped: a receive left in flight spins on the GPU while the host launches compute, and a kernel
    # launched for the first time may wait for the whole device (CUDA's lazy loading) — for that receive,
    # whose peer sends only after this rank's next p2p call: a deadlock (apply_host_synchronous_p2p)
    split: dict = {} if V == 1 else {"virtual_pipeline_model_parallel_size": V, "overlap_p2p_comm": False,
                                     "batch_p2p_comm": False}
    if stage_layers is None:
        if num_layers % n:
            what = f"pp: {pp}" if V == 1 else f"virtual_stages: pp x virtual_stages = {n}"
            raise ConfigError(f"parallelism.{what} must divide num_layers={num_layers} (or give "
                              f"parallelism.stage_layers)")
        return split, num_layers // n
    stage_layers = [int(x) for x in stage_layers]
    if len(stage_layers) != n or sum(stage_layers) != num_layers or min(stage_layers) < 1:
        per = "" if V == 1 else " (one per virtual stage, pp x virtual_stages, in layer order)"
        raise ConfigError(f"parallelism.stage_layers: expected {n} counts >= 1{per} summing to num_layers="
                          f"{num_layers}, got {stage_layers}")
    if len(set(stage_layers)) == 1:  # Megatron's default split
        return split, stage_layers[0]
    if V == 1 and len(set(stage_layers[1:-1])) <= 1:
        split.update(num_layers_in_first_pipeline_stage=stage_layers[0],
                     num_layers_in_last_pipeline_stage=stage_layers[-1])
    else:
        layout = [["decoder"] * k for k in stage_layers]
        layout[0].insert(0, "embedding")
        layout[-1].append("loss")
        split["pipeline_model_parallel_layout"] = layout
        split.pop("virtual_pipeline_model_parallel_size", None)  # the layout implies it
    return split, max(stage_layers)


__all__ = ["transformer_config"]

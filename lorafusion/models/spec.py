"""``ModelArch`` (:mod:`lorafusion.core.arch`) → Megatron ``TransformerConfig``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorafusion.core.arch import ModelArch
from lorafusion.core.errors import ConfigError


def transformer_config(arch: ModelArch, params_dtype: torch.dtype = torch.float32, *, tp: int = 1, pp: int = 1,
                       recompute: bool = False, recompute_layers: int | None = None, sequence_parallel: bool = False,
                       stage_layers: Sequence[int] | None = None, **overrides):
    """The Megatron ``TransformerConfig`` for ``arch`` (no dropout in the frozen base; LoRA dropout is
    per adapter). ``recompute``: full activation recomputation of every decoder layer, or with
    ``recompute_layers`` of the first N of each pipeline stage. ``sequence_parallel`` needs tp > 1."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if arch.num_query_groups % tp:
        raise ConfigError(f"parallelism.tp: {tp} must divide num_query_groups={arch.num_query_groups}")
    split = {}
    if stage_layers is not None:
        stage_layers = list(stage_layers)
        if len(stage_layers) != pp or sum(stage_layers) != arch.num_layers or min(stage_layers) < 1:
            raise ConfigError(f"parallelism.stage_layers: expected {pp} counts >= 1 summing to num_layers="
                              f"{arch.num_layers}, got {stage_layers}")
        if len(set(stage_layers)) > 1:  # (an even list is Megatron's default split)
            split = dict(num_layers_in_first_pipeline_stage=stage_layers[0],
                         num_layers_in_last_pipeline_stage=stage_layers[-1])
    elif arch.num_layers % pp:
        raise ConfigError(f"parallelism.pp: {pp} must divide num_layers={arch.num_layers}")
    stage_max = max(stage_layers) if stage_layers is not None else arch.num_layers // pp
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
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        autocast_dtype=params_dtype,
        deallocate_pipeline_outputs=False,
        variable_seq_lengths=True,
        calculate_per_token_loss=True,
        moe_token_dispatcher_type="alltoall",
        cuda_graph_scope=[],  # megatron's default "full" warns "full scope is deprecated"; [] is the same
    )
    if recompute_layers is not None and not recompute:
        raise ConfigError(f"model.recompute_layers: {recompute_layers} needs model.recompute: true")
    if recompute and recompute_layers is not None:
        if recompute_layers > stage_max:
            raise ConfigError(f"model.recompute_layers: {recompute_layers} is more than the "
                              f"{stage_max} decoder layers of a pipeline stage")
        kw.update(recompute_granularity="full", recompute_method="block", recompute_num_layers=recompute_layers)
    elif recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    kw.update(split)
    kw.update(overrides)
    return TransformerConfig(**kw)


__all__ = ["transformer_config"]

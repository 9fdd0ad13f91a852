"""Model provider: ``ModelArch`` → Megatron-core ``GPTModel`` whose parallel linears carry LoRA adapters.

Built with the layer spec of :mod:`lorafusion.models.layer_spec` (Megatron's local spec with LoRA-capable
linears and :class:`PackedDotProductAttention` for packed sequences, cu_seqlens). Transformer Engine
layers fuse the input norm into linear_qkv and hide the normalised input LoRA needs, so they are not
used yet (``transformer_impl="te"`` is an explicit error).

``build_model(fused_ops=...)`` picks the ops around the LoRA layers (see :mod:`lorafusion.models.fused`):
``"off"`` is Megatron's stock local spec (torch RMSNorm, unfused SwiGLU and thd RoPE, full logits +
vocab-parallel cross-entropy); ``"torch"`` / ``"triton"`` use the fused ops (RMSNorm in params dtype,
SwiGLU saving only fc1's output, sync-free packed RoPE, per-token linear cross-entropy without logits at
TP == 1) in that implementation. The default is ``"triton"`` on a CUDA device and ``"off"`` elsewhere.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel

from megatron_patches import apply_packed_rope_patch, apply_recompute_state_hook

from lorafusion.core.precision import BASE_PRECISIONS
from lorafusion.core.seeds import mix_seed, name_key
from lorafusion.layers.fp8_base import base_tensor_like, is_fp8, write_base_tensor
from lorafusion.layers.lora_linear import LoRAContext, capture_routing, restore_routing
from lorafusion.layers.sharding import param_split, tp_rank
from lorafusion.models.fused import resolve_fused_ops
from lorafusion.models.fused.model import FusedLossGPTModel, fused_config_overrides
from lorafusion.models.fused.rope import packed_rope
from lorafusion.models.layer_spec import lora_block_spec
from lorafusion.models.spec import ModelArch, transformer_config


def build_model(arch: ModelArch, *, params_dtype: torch.dtype = torch.float32,
                pre_process: bool | None = None, post_process: bool | None = None, recompute: bool = False,
                recompute_layers: int | None = None, device: str | torch.device | None = None,
                transformer_impl: str = "local", seed: int = 1234, fused_ops: str | None = None,
                sequence_parallel: bool = False, stage_layers: list[int] | None = None,
                base_precision: str = "bf16", lora_impl: str | None = None, timers=None,
                **config_overrides) -> GPTModel | ModelChunks:
    """Build this pipeline stage's ``GPTModel`` (requires ``parallel_state`` to be initialised).

    Base weights are frozen and drawn by :func:`init_random_weights` (HF weights: :mod:`.hf_import`).
    ``fused_ops``: "off", "torch" or "triton" (module docstring; None: "triton" on CUDA, else "off"), recorded
    as ``model.config.fused_ops``. ``sequence_parallel`` (tp > 1): Megatron's sequence parallelism; the norms
    are then our RMSNorm ("torch": ``F.rms_norm``) even with "off", since Megatron's ``WrappedTorchNorm``
    refuses SP. ``base_precision``: "fp8" builds the decoder linears with an FP8 base
    (:mod:`..layers.fp8_base`). ``lora_impl``: the LoRA compute of the model's :class:`LoRAContext`
    ("triton" | "torch" | None: automatic).
    ``timers``: the object Megatron's schedules time their stages through (``config.timers``), or None.
    Everything is given to the modules as they are built (the layer spec's params, the config); nothing is
    set on the model afterwards.

    With Megatron's virtual pipeline (``parallel_state`` initialised with V model chunks per rank) this rank's
    V chunks come back as :class:`ModelChunks` (one LoRA context, one config); ``stage_layers`` then counts
    per virtual stage.
    """
    if base_precision not in BASE_PRECISIONS:
        raise ValueError(f"model.base_precision: expected one of {BASE_PRECISIONS}, got {base_precision!r}")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    mode = resolve_fused_ops(fused_ops, device)
    impl = None if mode == "off" else mode
    overrides = {**(fused_config_overrides(impl) if impl else {}), "fused_ops": mode,
                 "base_precision": base_precision, "timers": timers, **config_overrides}
    V = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    cfg = transformer_config(arch, params_dtype, tp=tp, pp=pp, recompute=recompute,
                             recompute_layers=recompute_layers, sequence_parallel=sequence_parallel,
                             stage_layers=stage_layers, virtual_stages=V, **overrides)
    if impl is not None:
        apply_packed_rope_patch(packed_rope)  # its dispatcher reads cfg.packed_rope_impl
    if recompute:  # the recompute re-runs a block with the LoRA routing of *its* microbatch
        apply_recompute_state_hook(capture_routing, restore_routing)
    ctx = LoRAContext(impl=lora_impl)  # one context (routing, adapters) for all chunks
    build = dict(transformer_impl=transformer_impl, mode=mode, sequence_parallel=sequence_parallel,
                 device=device, seed=seed, recompute=recompute)
    if V > 1:
        return ModelChunks([_build_chunk(arch, cfg, ctx, **build, vp_stage=c) for c in range(V)])
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    return _build_chunk(arch, cfg, ctx, **build, pre_process=pre_process, post_process=post_process)


class ModelChunks(torch.nn.ModuleList):
    """This pipeline rank's model chunks (interleaved 1F1B), in layer order; ``config`` is theirs (shared)."""

    @property
    def config(self):
        return self[0].config


def _build_chunk(arch, cfg, ctx, *, transformer_impl, mode, sequence_parallel, device, seed, recompute,
                 pre_process=None, post_process=None, vp_stage=None) -> GPTModel:
    """One model chunk (the whole stage without virtual pipeline) on ``cfg``: frozen, initialised,
    LoRA-ready."""
    if vp_stage is not None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    block = lora_block_spec(cfg, ctx, transformer_impl=transformer_impl, fused_ops=mode,
                            sequence_parallel=sequence_parallel, vp_stage=vp_stage)
    model = FusedLossGPTModel(
        config=cfg, transformer_layer_spec=block, vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=arch.tie_word_embeddings, position_embedding_type="rope",
        rotary_base=arch.rope_theta, parallel_output=True, fused_loss=None if mode == "off" else mode,
        lora_context=ctx, rope_inv_freq=arch.inv_freq(),  # HF's frequencies (llama3 scaling, any parameters)
        embedding_requires_grad=recompute,
        **({} if vp_stage is None else {"vp_stage": vp_stage}),
    )
    for layer in model.decoder.layers:  # the spec's numbering is Megatron's (its offset for this stage)
        attn, mlp = layer.self_attention, layer.mlp
        if any(m.layer_number != layer.layer_number
               for m in (attn.linear_qkv, attn.linear_proj, mlp.linear_fc1, mlp.linear_fc2)):
            raise RuntimeError(f"internal: decoder layer {layer.layer_number} was built with LoRA linears of "
                               f"another layer number")
    for p in model.parameters():
        p.requires_grad_(False)
    if device is not None:
        model.to(device)
    init_random_weights(model, seed)
    return model


def _global_params(model: torch.nn.Module):
    """(layout-independent name, owning module, attribute, its TP split) for every frozen base tensor: every
    parameter but the adapters', and the weights an FP8 linear holds in FP8; decoder layers by global layer
    number, the tied output layer under the embedding's name; the split is the owning module's
    (:func:`lorafusion.layers.sharding.param_split`)."""
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    modules = dict(model.named_modules())
    names = [name for name, _ in model.named_parameters() if "lora_" not in name]
    names += [f"{name}.weight" for name, mod in modules.items() if is_fp8(mod)]
    for name in names:
        owner, _, attr = name.rpartition(".")
        key = name
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            key = f"layers.{model.decoder.layers[int(local)].layer_number}.{rest}"
        elif name == "output_layer.weight" and tied:
            key = "embedding.word_embeddings.weight"
        yield key, modules[owner], attr, param_split(modules[owner], attr)


def init_random_weights(model: torch.nn.Module, seed: int, std: float | None = None) -> None:
    """Deterministic random base weights (norm weights 1, biases 0; normal with ``std``, by default
    1/√hidden_size, which for LLaMA-8B-sized models is ≈0.016 and keeps tiny models' logits from being
    flat). Each tensor is drawn whole from a generator seeded by (seed, its layout-independent name) and
    then cut to this rank's TP shard by its module's split, so every TP/PP layout holds the same model."""
    tp, rank = tp_rank()
    if std is None:
        std = model.config.hidden_size ** -0.5
    with torch.no_grad():
        for key, mod, attr, split in _global_params(model):
            p = base_tensor_like(mod, attr)
            if key.endswith("layernorm.weight") or key.endswith("layer_norm_weight"):
                p.fill_(1.0)
                continue
            if key.endswith("bias"):
                p.zero_()
                continue
            # drawn on the parameter's device (a CUDA generator differs from the CPU one, but is the same
            # on every rank, which is what TP/PP consistency needs)
            gen = torch.Generator(device=p.device).manual_seed(mix_seed(seed, name_key(key)))
            full = torch.randn(split.full_shape(tuple(p.shape), tp), generator=gen, device=p.device,
                               dtype=torch.float32) * std
            write_base_tensor(mod, attr, split.shard(full, tp, rank))

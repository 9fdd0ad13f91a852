"""Megatron wiring of the fused ops (the layer spec's variants are in :mod:`lorafusion.models.layer_spec`) and
the ``GPTModel`` our provider builds, whose loss is the fused linear cross-entropy and which takes at
construction what it is wired with (the LoRA context, RoPE frequencies).

- Norms: ``input_layernorm``, ``pre_mlp_layernorm`` and the block's ``final_layernorm`` become
  :class:`~lorafusion.models.fused.rms_norm.RMSNorm` (weight in params dtype; same state-dict names).
- SwiGLU: ``MLPSubmodules.activation_func`` = :class:`~lorafusion.models.fused.swiglu.SwiGLU`, which
  Megatron's MLP applies to the whole fc1 output when ``config.use_te_activation_func`` is set (despite its
  name the flag only selects "call the activation module on the fc1 output").
- RoPE: ``config.packed_rope_impl`` plus ``megatron_patches.apply_packed_rope_patch``.
- Loss: :class:`FusedLossGPTModel` returns the per-token loss [b, s] from
  :func:`~lorafusion.models.fused.linear_cross_entropy.linear_cross_entropy` exactly where
  ``GPTModel`` returned ``compute_language_model_loss(labels, logits)`` — only with TP == 1 (otherwise
  Megatron's vocab-parallel path) and only when labels are given (``labels=None`` returns logits as before).
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from lorafusion.models.fused import check_impl
from lorafusion.models.fused.linear_cross_entropy import linear_cross_entropy


def fused_config_overrides(impl: str) -> dict:
    """Config fields the fused ops need (:class:`lorafusion.models.config.LoRAFusionConfig`)."""
    check_impl(impl)
    return {"use_te_activation_func": True, "bias_activation_fusion": False, "packed_rope_impl": impl}


class FusedLossGPTModel(GPTModel):
    """``GPTModel`` whose training loss (labels given, TP == 1, no MTP, not inference) is the fused
    per-token linear cross-entropy of implementation ``fused_loss`` ("torch" / "triton"); ``None`` keeps
    Megatron's loss."""

    def __init__(self, *args, fused_loss: str | None = None, lora_context=None,
                 rope_inv_freq: torch.Tensor | None = None, embedding_requires_grad: bool = False, **kwargs):
        """``GPTModel``'s arguments, plus ``fused_loss`` (above); ``lora_context``: the
        :class:`~lorafusion.layers.lora_linear.LoRAContext` its layer spec gave every LoRA linear (adapters,
        routing; under virtual pipeline one for all chunks), kept as ``self.lora_context``;
        ``rope_inv_freq``: RoPE frequencies to use instead of the ones Megatron computes from
        ``rotary_base`` (HF's, for any rope scaling: ``ModelArch.inv_freq``); ``embedding_requires_grad``
        (full activation recomputation): the frozen embedding's output requires grad while grad is enabled,
        since Megatron's reentrant checkpoint runs a block's backward only when one of its inputs requires
        grad, and on the first stage none would: its adapters would silently get no gradient."""
        super().__init__(*args, **kwargs)
        self.fused_loss = None if fused_loss is None else check_impl(fused_loss)
        self.lora_context = lora_context
        if rope_inv_freq is not None:
            # on the device Megatron's own are (a GPU): Megatron would copy a host tensor there at the first
            # forward, a blocking copy inside the pipeline schedule
            self.rotary_pos_emb.inv_freq = rope_inv_freq.to(self.rotary_pos_emb.inv_freq.device)
        if embedding_requires_grad and self.pre_process:
            self.embedding.register_forward_hook(_output_requires_grad)

    def _fused_loss_applies(self, labels, mtp_in_postprocess, inference_context) -> bool:
        return (self.fused_loss is not None and labels is not None and self.post_process
                and not mtp_in_postprocess and self.config.mtp_num_layers is None
                and inference_context is None and self.config.tensor_model_parallel_size == 1
                and not self.config.sequence_parallel)

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, mtp_in_postprocess=None,
                     inference_context=None, **kwargs):
        if not self._fused_loss_applies(labels, mtp_in_postprocess, inference_context):
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args,
                                        mtp_in_postprocess=mtp_in_postprocess,
                                        inference_context=inference_context, **kwargs)
        if self.share_embeddings_and_output_weights:
            weight = self.shared_embedding_or_output_weight()
        else:
            weight = self.output_layer.weight
        # hidden [s, b, h], labels [b, s] → loss [b, s] (compute_language_model_loss's layout)
        loss = linear_cross_entropy(hidden_states, weight, labels.transpose(0, 1), impl=self.fused_loss)
        return loss.transpose(0, 1).contiguous()


def _output_requires_grad(_module, _inputs, output):
    return output.requires_grad_(True) if torch.is_grad_enabled() and not output.requires_grad else output


__all__ = ["FusedLossGPTModel", "fused_config_overrides"]

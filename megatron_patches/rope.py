"""Packed (thd) RoPE without host syncs, for models that ask for it (megatron-core 0.16).

Megatron's ``apply_rotary_pos_emb`` with ``cu_seqlens`` runs ``_apply_rotary_pos_emb_thd``, which calls
``.tolist()`` on ``cu_seqlens`` (a device→host sync) for every q and k of every layer and splits the
microbatch per sample. :func:`apply_packed_rope_patch` replaces the name
``megatron.core.transformer.attention.apply_rotary_pos_emb`` (the one ``Attention.forward`` calls) with a
dispatcher: when the model's ``TransformerConfig`` has ``packed_rope_impl`` "torch" or "triton" (a field of
the config the model was built with) and the call is a packed, non-interleaved,
full-rotary-dim call without context parallelism or mscale, it runs the ``packed_rope`` it was given
(``lorafusion.models.fused.rope.packed_rope``: handed in, so this shim imports nothing of lorafusion); every
other call goes to Megatron's own function unchanged. Explicit (nothing is patched on import) and idempotent.
"""

from __future__ import annotations

_ORIGINAL = None


def packed_rope_patch_applied() -> bool:
    return _ORIGINAL is not None


def apply_packed_rope_patch(packed_rope) -> None:
    """``packed_rope(t, freqs, cu_seqlens, impl=...)``: the packed RoPE the dispatcher runs (the first
    call's)."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        return
    from megatron.core.transformer import attention

    original = attention.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        # stands in for megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb inside
        # megatron.core.transformer.attention
        impl = getattr(config, "packed_rope_impl", None)
        if (impl is None or cu_seqlens is None or mscale != 1.0 or config.rotary_interleaved
                or config.multi_latent_attention or config.apply_rope_fusion
                or config.context_parallel_size != 1
                or t.dim() != 3 or freqs.shape[-1] != t.shape[-1]):
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        return packed_rope(t, freqs, cu_seqlens, impl=impl)

    apply_rotary_pos_emb.__wrapped__ = original
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    _ORIGINAL = original


def rope_positions_patch_applied() -> bool:
    from megatron.core.transformer import attention

    return getattr(attention.apply_rotary_pos_emb, "_positions_for", None) is not None


def apply_rope_positions_patch(positions_for) -> None:
    """RoPE at explicit per-token positions for packed (thd) decoding with a KV cache.

    Megatron's packed RoPE restarts positions at every ``cu_seqlens`` boundary, which is right for training
    (each sample starts at 0) but not for a decoding step whose rows continue cached sequences.
    ``positions_for(config)`` says, for the model whose ``TransformerConfig`` a call carries, the position of
    each packed row of the forward now running (a [t] long tensor; ``lorafusion.inference.kv_cache`` hands in
    its cache's planned positions) or None (training, and any model not decoding). With positions, a packed
    call rotates row ``i`` by ``freqs[positions[i]]`` with Megatron's own math (what its thd path does per
    sample: the bshd rotation on gathered freqs); with None every call goes to the function it wraps,
    unchanged. Idempotent for the same ``positions_for``; re-wraps when something else was installed over it
    since (e.g. :func:`apply_packed_rope_patch` by a later model build), so call it right before decoding."""
    from megatron.core.transformer import attention

    current = attention.apply_rotary_pos_emb
    if getattr(current, "_positions_for", None) is positions_for:
        return

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        positions = positions_for(config)
        if positions is None or cu_seqlens is None or t.dim() != 3:
            return current(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        # (Megatron's RotaryEmbedding moves its inv_freq to the current CUDA device on its first call, also
        # for a model on the CPU: the rows' freqs follow t; a no-op when both are on the GPU, so capture is
        # unaffected)
        f = freqs[positions.to(freqs.device)].to(t.device)
        return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), f, rotary_interleaved=config.rotary_interleaved,
                                          multi_latent_attention=config.multi_latent_attention,
                                          mscale=mscale).squeeze(1)

    apply_rotary_pos_emb.__wrapped__ = current
    apply_rotary_pos_emb._positions_for = positions_for
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb

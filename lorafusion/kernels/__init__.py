"""Triton kernels (no Megatron, no autograd): FusedLoRA / FusedMultiLoRA, in-kernel dropout, tuned configs.

Autograd and dispatch live in :mod:`lorafusion.ops.fused` and :mod:`lorafusion.ops`.
"""

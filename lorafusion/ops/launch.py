"""Triton launches without ``JITFunction.run``'s per-call work, for the Triton kernels defined above the
kernels package (the models' fused RMSNorm and RoPE): :class:`lorafusion.kernels.launch.Launcher`, offered
here because models reach kernels only through ops."""

from lorafusion.kernels.launch import Launcher

__all__ = ["Launcher"]

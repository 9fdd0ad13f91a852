"""Fused-op tests run everywhere: without CUDA, Triton's interpreter executes the kernels on the CPU.

TRITON_INTERPRET must be set before any triton.jit-decorated code (lorafusion's kernels, liger_kernel) is
imported; lorafusion.models.fused imports triton and liger_kernel lazily, inside the Triton paths.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

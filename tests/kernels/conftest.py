"""Kernel tests run everywhere: without CUDA, Triton's interpreter executes the kernels on the CPU.

TRITON_INTERPRET must be set before lorafusion.kernels (or triton.jit-decorated code) is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

"""Shared helpers of the fused-op tests (not a test module)."""

from __future__ import annotations

import pytest
import torch

# relative (Frobenius) error allowed against a float64 reference, by input dtype
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

# dtypes the Triton paths are checked in here: the interpreter's fp32/fp16; bf16 only on a GPU
CPU_DTYPES = [torch.float32, torch.float16]
IMPLS = ["torch", "triton"]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def saved_bytes(fn, *args, exclude=()) -> int:
    """Bytes of the tensors autograd saves while running ``fn(*args)`` (distinct storages, leaving out
    ``exclude``, e.g. frozen parameters)."""
    seen, total = {t.untyped_storage().data_ptr() for t in exclude}, [0]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return total[0], out

"""Shared helpers of the kernel tests (not a test module)."""

from __future__ import annotations

import random

import torch

from lorafusion.ops.reference import multi_lora_delta_reference


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def random_routing(m: int, n_slots: int, rng: random.Random, gaps: bool = True):
    """Random contiguous segments over m rows: any lengths, repeated slots, optional uncovered rows."""
    from lorafusion.core.routing import Routing

    segs, pos = [], 0
    while pos < m:
        if gaps and rng.random() < 0.2:
            pos += rng.randint(1, 5)
            continue
        length = min(m - pos, rng.randint(1, max(1, m // 3)))
        segs.append((rng.randrange(n_slots), pos, length))
        pos += length
    segs = [s for s in segs if s[1] < m]
    if not segs:
        segs = [(0, 0, m)]
    return Routing(segments=tuple(segs), num_rows=m)


def make_adapters(k, n, ranks, dtype, device, requires_grad=True, scale_b=1.0):
    A = [(torch.randn(r, k, dtype=dtype, device=device) / k**0.5).requires_grad_(requires_grad)
         for r in ranks]
    B = [(torch.randn(n, r, dtype=dtype, device=device) * scale_b).requires_grad_(requires_grad)
         for r in ranks]
    return A, B


def run_linear(fn, x, W, bias, A, B, sc, ps, seeds, routing, g):
    """Forward + backward; returns (y, grads of x, bias, A..., B...)."""
    leaves = [x, bias, *A, *B]
    for t in leaves:
        if t is not None:
            t.grad = None
    y = fn(x, W, bias, A, B, sc, ps, seeds, routing)
    y.backward(g)
    return y.detach(), [None if t is None or t.grad is None else t.grad.detach().clone() for t in leaves]


def reference_linear(x, W, bias, A, B, sc, ps, seeds, routing):
    return (torch.nn.functional.linear(x, W, bias)
            + multi_lora_delta_reference(x, A, B, sc, ps, seeds, routing))

"""In-kernel Philox dropout: the same mask as the torch reference, the right keep rate, forward ==
backward."""

import math

import pytest
import torch

from lorafusion.kernels.dropout import keep_mask_triton
from lorafusion.core.routing import Routing
from lorafusion.core.seeds import mix_seed
from lorafusion.ops.dropout import keep_mask
from lorafusion.ops.fused import multi_lora_delta_fused

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("seed", [0, 12345, mix_seed(7, 3, 1), 2**40 + 7])
def test_mask_matches_reference(seed):
    ids = torch.tensor([0, 5, 3, 100_000, 2**31 // 7, 77_777_777, 2**33 + 1], dtype=torch.int64, device=DEV)
    for k_offset, k_total in [(0, None), (13, 97)]:
        a = keep_mask_triton(seed, ids, 37, 0.3, k_offset, k_total)
        b = keep_mask(seed, ids, 37, 0.3, k_offset, k_total)
        assert torch.equal(a, b)


def test_keep_rate_within_3_sigma():
    p = 0.3
    ids = torch.arange(64, dtype=torch.int64, device=DEV)
    keep = keep_mask_triton(mix_seed(42), ids, 512, p)
    n = keep.numel()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.float().mean().item() - (1 - p)) < 3 * sigma


def test_same_mask_forward_and_backward():
    """With A = B = I and X = 1, the forward output is keep/(1-p) and dX (for dOut = 1) is keep/(1-p) too."""
    m, k, p, seed = 21, 32, 0.4, mix_seed(5)
    row_ids = torch.arange(1000, 1000 + m, dtype=torch.int64, device=DEV)
    routing = Routing(segments=((0, 0, m),), num_rows=m, row_ids=row_ids)
    x = torch.ones(m, k, device=DEV, requires_grad=True)
    eye = torch.eye(k, device=DEV)
    A, B = eye.clone().requires_grad_(True), eye.clone().requires_grad_(True)
    out = multi_lora_delta_fused(x, [A], [B], [1.0], [p], [seed], routing, k_offset=8, k_total=96)
    out.backward(torch.ones_like(out))
    ref = keep_mask(seed, row_ids, k, p, 8, 96)
    assert torch.equal(out.detach() != 0, ref)
    assert torch.equal(x.grad != 0, ref)
    torch.testing.assert_close(out.detach()[ref], torch.full_like(out.detach()[ref], 1 / (1 - p)))

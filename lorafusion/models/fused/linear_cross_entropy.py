"""Fused output projection + per-token cross-entropy that never keeps the logits.

Token t's loss L_t depends only on its hidden row h_t, so the forward pass computes, chunk by chunk of
tokens, ``logits_c = h_c · Wᵀ`` (in the hidden dtype), the cross-entropy and its gradient with respect to
the logits *in place* (``softmax − onehot``), and then ``G_c = dlogits_c · W = dL_t/dh_t``. Only ``G``
([tokens, hidden], the size of the hidden states) is kept; backward returns ``grad_out[:, None] * G``,
exact for any per-token ``grad_out`` (the trainer weights each adapter's tokens differently), with no
recompute. Peak extra memory is one chunk of logits (``chunk_tokens × vocab``), bounded by
``LOGITS_CHUNK_BYTES`` of fp32.

The output weight is frozen (no dW is computed; a weight that requires grad is an error) and may be the
tied embedding. Labels equal to ``ignore_index`` give loss 0 and gradient 0.

``impl="triton"`` runs Liger-Kernel's ``liger_cross_entropy_kernel`` (reduction="none", gradient in place)
on each chunk; ``impl="torch"`` the same steps in torch. :func:`linear_cross_entropy_reference` is the
plain autograd formula (materialises all logits; tests and float64 ground truth).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafusion.models.fused import check_impl

# one chunk's logits stay under this many bytes when held in fp32 (≈2,090 tokens at a 128,256 vocab)
LOGITS_CHUNK_BYTES = 1 << 30


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss of ``hidden [..., H]`` under ``weight [V, H]`` (logits in fp32, or fp64 for fp64)."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    if logits.dtype != torch.float64:
        logits = logits.float()
    loss = F.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index, reduction="none")
    return loss.view(labels.shape)


def default_chunk_tokens(vocab: int, budget_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Tokens per chunk: fp32 logits of one chunk fit in ``budget_bytes`` (a multiple of 64 when ≥ 64)."""
    n = max(1, budget_bytes // (4 * vocab))
    return n // 64 * 64 if n >= 64 else n


def _ce_chunk_torch(logits: torch.Tensor, labels: torch.Tensor, loss_out: torch.Tensor, ignore_index: int,
                    with_grad: bool) -> None:
    """Per-token CE of one chunk into ``loss_out``; with ``with_grad`` the logits are overwritten by
    d(loss_t)/d(logits_t) (zero rows for ignored labels)."""
    # the chunk's logits are ours: work in place when they already are fp32/fp64
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, safe[:, None]).squeeze(1)
    loss_out.copy_(torch.where(valid, lse - picked, torch.zeros_like(lse)))
    if with_grad:
        x.sub_(lse[:, None]).exp_()  # softmax
        x.scatter_add_(1, safe[:, None], torch.full_like(picked[:, None], -1.0))
        x.mul_(valid[:, None].to(x.dtype))
        if x is not logits:
            logits.copy_(x)


def _ce_chunk_triton(logits: torch.Tensor, labels: torch.Tensor, loss_out: torch.Tensor, ignore_index: int,
                     with_grad: bool) -> None:
    """As :func:`_ce_chunk_torch`, by Liger-Kernel's cross-entropy kernel (one program per token; fp32
    inside; the gradient is stored in the logits' dtype). No host synchronisation."""
    import triton
    from liger_kernel.ops.cross_entropy import MAX_FUSED_SIZE, liger_cross_entropy_kernel

    n, v = logits.shape
    if n == 0:
        return
    liger_cross_entropy_kernel[(n,)](
        X_ptr=logits, X_stride=logits.stride(-2), Y_ptr=labels, Y_stride=labels.stride(-1),
        weight_ptr=None, loss_ptr=loss_out, z_loss_ptr=None, loss_stride=loss_out.stride(-1),
        token_accuracy_ptr=None, token_accuracy_stride=0, predicted_tokens_ptr=None,
        predicted_tokens_stride=0,
        n_cols=v, n_non_ignore=1, sum_non_ignore_weight=1, weight_sum=0.0, ignore_index=ignore_index,
        lse_square_scale=0.0, label_smoothing=0.0, reduction="none", softcap=None,
        RETURN_Z_LOSS=False, RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False,
        BLOCK_SIZE=min(MAX_FUSED_SIZE, triton.next_power_of_2(v)), HAS_WEIGHT=False, HAS_SOFTCAPPING=False,
        HAS_GRADIENTS=with_grad, num_warps=32,
    )


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_tokens, impl):
        n = hidden.shape[0]
        ce = _ce_chunk_triton if impl == "triton" else _ce_chunk_torch
        loss = torch.zeros(n, dtype=torch.float32 if hidden.dtype != torch.float64 else torch.float64,
                           device=hidden.device)
        with_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        for s in range(0, n, chunk_tokens):
            e = min(n, s + chunk_tokens)
            logits = hidden[s:e] @ weight.t()
            ce(logits, labels[s:e], loss[s:e], ignore_index, with_grad)
            if with_grad:
                torch.mm(logits, weight, out=grad_hidden[s:e])
            del logits
        ctx.save_for_backward(grad_hidden)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (g,) = ctx.saved_tensors
        scale = grad_loss.to(torch.float32 if g.dtype != torch.float64 else torch.float64)[:, None]
        # one kernel: the product in scale's dtype, rounded to g's on store (what ``(g * scale).to(g.dtype)``
        # computes, without its fp32 [tokens, hidden] temporary and the second kernel that casts it)
        return torch.mul(g, scale, out=torch.empty_like(g)), None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         ignore_index: int = -100, impl: str = "triton",
                         chunk_tokens: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy of ``hidden [..., H] · weight [V, H]ᵀ`` against ``labels [...]``.

    Returns the loss with the shape of ``labels`` in fp32 (fp64 for fp64 input). Differentiable with
    respect to ``hidden`` only.
    """
    check_impl(impl)
    if weight.requires_grad:
        raise ValueError("linear_cross_entropy: the output weight must be frozen (requires_grad=False); "
                         "no weight gradient is computed")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight "
                         f"{tuple(weight.shape)} do not match (expected hidden [..., H], weight [V, H])")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"linear_cross_entropy: labels {tuple(labels.shape)} must have hidden's leading "
                         f"shape {tuple(hidden.shape[:-1])}")
    if weight.dtype != hidden.dtype:
        weight = weight.to(hidden.dtype)
    h2 = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    lab = labels.reshape(-1).to(torch.int64).contiguous()
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    loss = _LinearCrossEntropy.apply(h2, weight.contiguous(), lab, int(ignore_index), int(chunk), impl)
    return loss.view(labels.shape)


__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "default_chunk_tokens",
           "LOGITS_CHUNK_BYTES"]

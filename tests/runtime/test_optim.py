"""The adapter optimizer's step: torch's AdamW (its fused kernel, with the clipping and the non-finite skip
around it), its state lists kept across steps and rebuilt after a state load."""

import copy

import pytest
import torch


def _opt(params, **kw):
    from lorafusion.runtime.optim import AdapterOptimizer

    args = dict(lr=0.05, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-8, schedule="cosine", warmup_steps=2,
                total_steps=8, min_lr_ratio=0.1, max_grad_norm=0.5)
    return AdapterOptimizer(params, **{**args, **kw})


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((4, 3), (5,), (2, 6))]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def test_fused_step_equals_torch_adamw_with_clipping_and_schedule(megatron_single):
    """Six steps (warmup, cosine): weights and moments equal torch.optim.AdamW (foreach) given the same
    clipped gradients and learning rates; the step counts are AdamW's."""
    ours, ref = _params(), _params()
    opt = _opt(ours)
    assert opt.fused
    ref_opt = torch.optim.AdamW(ref, lr=0.05, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-8, foreach=True)
    for step in range(6):
        grads = _grads(step, ours)
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        norm, lr = opt.step()
        want = torch.stack([g.norm() for g in grads]).norm()
        assert norm == pytest.approx(float(want), rel=1e-6)
        coef = min(1.0, 0.5 / (float(want) + 1e-6))
        for p, g in zip(ref, grads):
            p.grad = g * coef
        for group in ref_opt.param_groups:
            group["lr"] = lr
        ref_opt.step()
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.opt.state[p][k], ref_opt.state[q][k], rtol=1e-6, atol=1e-9)
            assert float(opt.opt.state[p]["step"]) == float(ref_opt.state[q]["step"]) == step + 1
        assert all(p.grad is None for p in ours)


def test_state_lists_are_kept_and_rebuilt_after_a_load(megatron_single):
    """The fused step's lists of moments are built once; a state load (a checkpoint) replaces the moments and
    the next step uses the loaded ones: it equals an optimizer that never stopped."""
    a, b = _params(), _params()
    opt_a, opt_b = _opt(a), _opt(b)
    for step in range(2):
        for p, g in zip(a, _grads(step, a)):
            p.grad = g
        opt_a.step()
    lists = opt_a._lists
    assert lists is not None and lists[0][0] is opt_a.opt.state[a[0]]["exp_avg"]
    for step in range(2):  # b steps on other gradients, then takes a's weights and state
        for p, g in zip(b, _grads(50 + step, b)):
            p.grad = g
        opt_b.step()
    stale = opt_b._lists
    with torch.no_grad():
        for p, q in zip(b, a):
            p.copy_(q)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # (as a checkpoint read back)
    for p, g in zip(a, _grads(7, a)):
        p.grad = g
    for p, g in zip(b, _grads(7, b)):
        p.grad = g
    opt_a.step()
    opt_b.step()
    assert opt_a._lists is lists  # kept across steps
    assert opt_b._lists is not stale and opt_b._lists[0][0] is opt_b.opt.state[b[0]]["exp_avg"]
    for p, q in zip(a, b):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)


def test_a_step_where_some_parameter_has_no_gradient_leaves_it_alone(megatron_single):
    """AdamW's semantics: a parameter without a gradient does not step (nor gets moments)."""
    ps = _params()
    opt = _opt(ps, max_grad_norm=None)
    before = ps[1].detach().clone()
    ps[0].grad, ps[2].grad = torch.ones(4, 3), torch.ones(2, 6)
    opt.step()
    assert torch.equal(ps[1].detach(), before) and "exp_avg" not in opt.opt.state.get(ps[1], {})
    assert not torch.equal(ps[0].detach(), _params()[0].detach())

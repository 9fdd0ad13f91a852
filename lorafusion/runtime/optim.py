"""One optimizer per adapter job: AdamW over its (fp32) LoRA parameters on this rank, its own learning-rate
schedule (warmup + cosine / linear / constant), weight decay and gradient-norm clipping.

Gradients are reduced over data-parallel ranks (sum: each microbatch's loss is already divided by the
job's token count over the whole global batch), the ones the TP linears leave partial over the TP ranks
summed over TP first (:func:`lorafusion.ops.comm.sum_partial_grads`), and the clipping norm is taken over the
full adapter (TP shards and PP stages together), so a step equals the step of the job trained alone.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from lorafusion.ops.comm import sum_partial_grads


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0):
    """Multiplier of the peak lr after ``step`` optimizer steps (LambdaLR convention)."""

    def f(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        if schedule == "linear":
            decay = 1.0 - progress
        elif schedule == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            raise ValueError(f"optimizer.schedule: expected cosine, linear or constant, got {schedule!r}")
        return min_lr_ratio + (1.0 - min_lr_ratio) * decay

    return f


def _is_tp_sharded(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def norm_params(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters this rank counts in the full adapter's gradient norm: TP-sharded ones on every rank
    (each holds a distinct part), TP-replicated ones on TP rank 0 only."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return [p for p in params if _is_tp_sharded(p) or tp_rank == 0]


def local_grad_sq(params: list[torch.nn.Parameter], counted: list[torch.nn.Parameter] | None = None
                  ) -> torch.Tensor:
    """This rank's share of the squared gradient norm of the full adapter (``counted``: the parameters of
    :func:`norm_params`, computed here unless given), as one fp32 device scalar (multi-tensor kernels: a few
    launches for all of an adapter's parameters, no host synchronisation)."""
    dev = params[0].device if params else torch.device("cpu")
    counted = norm_params(params) if counted is None else counted
    grads = [g if g.dtype == torch.float32 else g.float() for p in counted if (g := p.grad) is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=dev)
    norms = torch._foreach_norm(grads)
    return torch.stack(norms).square().sum()


def _model_parallel_group():
    if not dist.is_initialized():
        return None
    group = parallel_state.get_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


def _fusable(params: list[torch.nn.Parameter]) -> bool:
    """Whether torch's fused AdamW kernel takes these parameters (floating, on CPU or CUDA)."""
    return bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)


class AdapterOptimizer:
    """AdamW of one job. With fused AdamW (parameters on CPU or CUDA) a step is a handful of multi-tensor
    kernels: the clipping scale, one fused AdamW over every parameter with the non-finite flag as its
    ``found_inf`` (a non-finite step changes no weight or moment, decided on the device), the step counts;
    the lists of state tensors it takes are kept from step to step (rebuilt after a state load)."""

    def __init__(self, params: list[torch.nn.Parameter], *, lr: float, weight_decay: float, betas, eps: float,
                 schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float,
                 max_grad_norm: float | None):
        self.params = params
        self.fused = _fusable(params)
        self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps,
                                     fused=self.fused or None)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_lambda(schedule, warmup_steps, total_steps, min_lr_ratio))
        self.max_grad_norm = max_grad_norm
        self._sq = self._work = None
        self._counted = None  # norm_params(params), once (the TP rank of a job's parameters never changes)
        self._lists = None  # (exp_avgs, exp_avg_sqs, steps) of the fused step, in params' order
        self.paused = False  # a diverged job: its steps still take part in the collectives but change nothing

    @classmethod
    def from_config(cls, params, cfg, total_steps: int) -> "AdapterOptimizer":
        return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas, eps=cfg.eps,
                   schedule=cfg.schedule, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
                   min_lr_ratio=cfg.min_lr_ratio, max_grad_norm=cfg.max_grad_norm)

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    def reduce_dp(self) -> None:
        """Sum gradients over the data-parallel group (one flat buffer)."""
        if not dist.is_initialized() or parallel_state.get_data_parallel_world_size() == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
        for p, g in zip(self.params, flat.split([p.numel() for p in self.params]), strict=True):
            p.grad = g.view_as(p)

    def reduce_tp(self) -> None:
        """Sum over the TP ranks the gradients left partial there (one flat buffer; none without them)."""
        if dist.is_initialized() and parallel_state.get_tensor_model_parallel_world_size() > 1:
            sum_partial_grads(self.params, parallel_state.get_tensor_model_parallel_group())

    def begin_step(self) -> None:
        """First half of a step, called on each stage as soon as its backward of the job's global batch is
        done: sum the partial gradients over TP, reduce gradients over DP, then start (asynchronously) the
        sum of the squared norm over the model-parallel group (TP × PP), so pipeline stages never wait for
        each other here."""
        self.reduce_tp()
        self.reduce_dp()
        if self._counted is None:
            self._counted = norm_params(self.params)
        self._sq = local_grad_sq(self.params, self._counted)
        group = _model_parallel_group()
        self._work = dist.all_reduce(self._sq, group=group, async_op=True) if group is not None else None

    def end_step(self) -> tuple[torch.Tensor, float]:
        """Second half, called before this stage's next forward of the job: clip by the full-adapter norm,
        step, advance the schedule, zero grads. Returns (grad norm before clipping as a device scalar —
        read it when the chunk is done, so the host never waits on the GPU here —, lr used)."""
        if self._work is not None:
            self._work.wait()
        norm = self._sq.sqrt()
        self._work = self._sq = None
        lr = self.lr
        if self.paused:
            self.opt.zero_grad(set_to_none=True)
            return norm, lr
        grads = [p.grad for p in self.params]
        whole = all(g is not None for g in grads)
        grads = grads if whole else [g for g in grads if g is not None]
        if self.max_grad_norm is not None and self.max_grad_norm > 0 and grads:
            torch._foreach_mul_(grads, (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0))
        # A non-finite norm (NaN/inf gradients; a non-finite loss back-propagates into them) skips the update:
        # the weights and Adam moments keep their values, decided on the device (no host synchronisation).
        ok = torch.isfinite(norm)
        if self.fused and whole:
            self._fused_step(grads, (~ok).float())
        else:
            before = self._flat_state()
            self.opt.step()
            self._keep_unless(ok, before)
        self.sched.step()  # the skipped batch is consumed: the schedule (and Adam's step count) moves on
        self.opt.zero_grad(set_to_none=True)
        return norm, lr

    def _state_lists(self):
        """(exp_avgs, exp_avg_sqs, steps) of every parameter, created as fused AdamW creates them; kept while
        the optimizer's state holds the same tensors (a load replaces them)."""
        lists, state = self._lists, self.opt.state
        if lists is not None and state.get(self.params[0], {}).get("exp_avg") is lists[0][0]:
            return lists
        for p in self.params:
            st = state[p]
            if "step" not in st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        self._lists = tuple([state[p][k] for p in self.params] for k in ("exp_avg", "exp_avg_sq", "step"))
        return self._lists

    def _fused_step(self, grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
        """torch.optim.AdamW(fused=True)'s step on every parameter (all have gradients), with ``found_inf``
        (a device float, 1 = skip: the kernel then changes nothing); the step counts move on either way."""
        exp_avgs, exp_avg_sqs, steps = self._state_lists()
        group = self.opt.param_groups[0]
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1)
        with torch.no_grad():
            torch._fused_adamw_(self.params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=group["lr"],
                                beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                                eps=group["eps"], amsgrad=False, maximize=False, grad_scale=None,
                                found_inf=found_inf)
        self.opt._opt_called = True  # (what AdamW.step marks for the schedule's order check)

    def _state_tensors(self) -> list[list[torch.Tensor]]:
        """[params, exp_avg, exp_avg_sq] of the parameters that will step (moments absent before step 1)."""
        ps = [p for p in self.params if p.grad is not None]
        out = [ps]
        for key in ("exp_avg", "exp_avg_sq"):
            out.append([self.opt.state[p][key] for p in ps if key in self.opt.state.get(p, {})])
        return out

    def _flat_state(self) -> list[torch.Tensor | None]:
        return [torch.cat([t.detach().reshape(-1) for t in ts]) if ts else None
                for ts in self._state_tensors()]

    def _keep_unless(self, ok: torch.Tensor, before: list[torch.Tensor | None]) -> None:
        """Where ``ok`` is false (a device bool), put back the state captured in ``before`` (moments that did
        not exist yet go back to zero). A few kernels per state kind: one cat, one where, one multi-copy. (The
        path of parameters that fused AdamW does not take, or of a step where some have no gradient.)"""
        for ts, old in zip(self._state_tensors(), before):
            if not ts:
                continue
            new = torch.cat([t.detach().reshape(-1) for t in ts])
            kept = torch.where(ok, new, old if old is not None else torch.zeros_like(new))
            pieces = kept.split([t.numel() for t in ts])
            with torch.no_grad():
                torch._foreach_copy_([t.detach() for t in ts], [x.view_as(t) for x, t in zip(pieces, ts)])

    def step(self) -> tuple[float, float]:
        self.begin_step()
        norm, lr = self.end_step()
        return float(norm), lr

    def state_dict(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        self._lists = None
        self.sched.load_state_dict(state["scheduler"])
        # the next step's lr from this schedule (a resume that changed max_steps: the new one from its first
        # step), not the one the checkpoint's schedule had set; for an unchanged schedule the same value
        for group, base, f in zip(self.opt.param_groups, self.sched.base_lrs,
                                  self.sched.lr_lambdas, strict=True):
            group["lr"] = base * f(self.sched.last_epoch)

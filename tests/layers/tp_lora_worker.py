"""Two ranks (RANK/WORLD_SIZE env, gloo): every LoRA linear of a small model at TP=2 — its LoRA term on the
base's collectives (the TP path, in line and overlapped; the FP8 base's), partial factor gradients summed
once — against the same linear with the LoRA term on Megatron's path (its own all-reduce of S / dS, full
gradients: lorafusion.layers.lora_linear's ``_sequence_parallel_delta`` / ``_lora_delta``), with and without
sequence parallelism: outputs, input gradients and every adapter gradient. ``python tp_lora_worker.py
WORKDIR``; rank 0 writes WORKDIR/ok.json (the cases checked) when all hold."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _params(mod):
    return [*mod.lora_A.values(), *mod.lora_B.values()]


def _run(mod, x, g, new: bool, largs):
    """(output, input grad, adapter grads) of ``mod`` on ``x`` with upstream gradient ``g``: its forward
    (``new``), else the base alone plus the LoRA term on Megatron's path."""
    from megatron.core import parallel_state

    from lorafusion.ops.comm import sum_partial_grads

    x = x.clone().requires_grad_()
    for p in _params(mod):
        p.grad = None
    if new:
        y, _ = mod(x)
    else:
        base, _ = mod._base_forward(x)
        sp = mod.sequence_parallel
        y = base + (mod._sequence_parallel_delta(x, largs) if sp else mod._lora_delta(x, largs))
    (y.float() * g).sum().backward()
    if new:
        sum_partial_grads(_params(mod), parallel_state.get_tensor_model_parallel_group())
    return y.detach().float(), x.grad.float(), [p.grad.clone() for p in _params(mod)]


def _close(got, want, tol, what):
    scale = want.abs().max().clamp_min(1e-6)
    err = float((got - want).abs().max() / scale)
    assert err <= tol, (what, err)


def main(workdir: Path) -> None:
    torch.set_num_threads(1)
    from lorafusion.core.arch import preset
    from lorafusion.core.lora import LoRASpec
    from lorafusion.data import pack_microbatch, pad_to_multiple
    from lorafusion.dist import destroy_distributed, init_distributed
    from lorafusion.layers import add_adapter, lora_batch, lora_modules
    from lorafusion.layers.fp8_base import is_fp8
    from lorafusion.layers.tp_overlap import tp_path
    from model_utils import randomize_b

    init_distributed(2, 1)
    rank = dist.get_rank()
    arch = preset("tiny-llama", num_layers=1)
    samples = [("a", list(range(9))), ("b", list(range(11))), ("a", list(range(6)))]
    b = pad_to_multiple(pack_microbatch(samples, row_ids=[0, 1, 2]), 2)
    checked = []
    for precision, sp, nano in (("bf16", True, 0), ("bf16", True, 2), ("bf16", False, 0), ("bf16", False, 2),
                                ("fp8", True, 0), ("fp8", False, 0)):
        dtype = torch.float32 if precision == "bf16" else torch.bfloat16
        tol = 1e-5 if precision == "bf16" else 3e-2
        from lorafusion.models.provider import build_model

        model = build_model(arch, params_dtype=dtype, seed=3, base_precision=precision, fp8_bf16_layers=0,
                            sequence_parallel=sp, tp_overlap=nano)
        add_adapter(model, "a", LoRASpec(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=("all-linear",)),
                    seed=0)
        add_adapter(model, "b", LoRASpec(r=8, lora_alpha=8, lora_dropout=0.2,
                                         target_modules=("q_proj", "v_proj", "o_proj", "down_proj")), seed=1)
        randomize_b(model, seed=5, scale=1.0)
        model.train()
        # each rank its own shards of X and dY; a replicated one (a column linear's input, a row linear's dY,
        # without SP) the same on both
        own, same = torch.Generator().manual_seed(100 + rank), torch.Generator().manual_seed(99)
        with lora_batch(model, b.routing, b.adapters, [21, 22]):
            for key, mod in lora_modules(model):
                assert is_fp8(mod) == (precision == "fp8")
                assert (tp_path(mod) is not None) == (precision == "bf16")
                rows = b.num_tokens // (2 if sp and mod.s_comm_mode == "column" else 1)
                width = mod.input_size // (2 if mod.s_comm_mode == "row" else 1)
                replicated = not sp and mod.s_comm_mode == "column"
                x = torch.randn(rows, 1, width, generator=same if replicated else own).to(dtype)
                largs = mod._lora_args(x)
                out_rows = b.num_tokens // (2 if sp and mod.s_comm_mode == "row" else 1)
                out_width = mod.output_size // (2 if mod.s_comm_mode == "column" else 1)
                replicated = not sp and mod.s_comm_mode == "row"
                g = torch.randn(out_rows, 1, out_width, generator=same if replicated else own)
                new, old = _run(mod, x, g, True, largs), _run(mod, x, g, False, largs)
                for what, got, want in (("y", new[0], old[0]), ("dx", new[1], old[1]),
                                        *((f"d{i}", a, w) for i, (a, w) in enumerate(zip(new[2], old[2])))):
                    _close(got.float(), want.float(), tol, (precision, sp, nano, key, what))
                checked.append([precision, sp, nano, key])
    if rank == 0:
        (workdir / "ok.json").write_text(json.dumps(checked))
    destroy_distributed()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    main(Path(sys.argv[1]))

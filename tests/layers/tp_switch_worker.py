"""Two ranks (RANK/WORLD_SIZE env, gloo): a small model at TP=2 with sequence parallelism whose
``config.tp_overlap`` is switched between microbatches (on, off, on, off, ... as scripts/bench_tp_overlap.py
switches it between chunks). Every collective either rank issues is recorded (its function, the shape
of its first tensor, whether it was issued without waiting). ``python tp_switch_worker.py WORKDIR``:
WORKDIR/base holds the HF checkpoint; each rank writes WORKDIR/rank{R}.json: the collectives of each
microbatch, its loss, and how many linears ran overlapped in it."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

CALLS: list = []
NAMES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "broadcast",
         "_all_gather_base", "_reduce_scatter_base", "send", "recv", "isend", "irecv")


def record_collectives() -> None:
    """Wrap torch.distributed's collectives before Megatron imports them (it keeps references)."""
    for name in NAMES:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            CALLS.append([_name, list(first.shape) if first is not None else None,
                          bool(kwargs.get("async_op", False))])
            return _fn(*args, **kwargs)

        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)


def main(workdir: Path) -> None:
    record_collectives()
    torch.set_num_threads(1)
    from lorafusion.core.lora import LoRASpec
    from lorafusion.data import pack_microbatch, pad_to_multiple
    from lorafusion.dist import destroy_distributed, init_distributed
    from lorafusion.layers import add_adapter, lora_batch
    from lorafusion.models.hf_import import build_model_from_hf
    from lorafusion.ops.tp_overlap import OVERLAPPED

    init_distributed(2, 1)
    model = build_model_from_hf(workdir / "base", sequence_parallel=True, tp_overlap=2, fused_ops="torch")
    for i, r in enumerate((4, 8)):  # (a1 without dropout: the LoRA term keeps its input X itself)
        add_adapter(model, f"a{i}", LoRASpec(r=r, lora_alpha=2 * r, lora_dropout=0.1 if i == 0 else 0.0,
                                             target_modules=("all-linear",)), seed=i)
    model.train()
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(4):
        samples = [(f"a{i % 2}", torch.randint(0, 128, (5 + 3 * i + step,), generator=g).tolist())
                   for i in range(3)]
        b = pad_to_multiple(pack_microbatch(samples, row_ids=[3 * step + i for i in range(3)]), 2)
        model.config.tp_overlap = 2 if step % 2 == 0 else 0  # the benchmark's switch
        CALLS.clear()
        before = OVERLAPPED[0]
        with lora_batch(model, b.routing, b.adapters, [11, 12]):
            loss = model(b.tokens, b.position_ids, attention_mask=None, labels=b.labels,
                         packed_seq_params=b.packed_seq_params())
        total = loss.float().sum()
        total.backward()
        out.append({"overlap": model.config.tp_overlap, "collectives": list(CALLS), "loss": total.item(),
                    "overlapped": OVERLAPPED[0] - before})
    from megatron.core import parallel_state

    from lorafusion.layers import lora_modules
    from lorafusion.ops.comm import sum_partial_grads

    geometry = sorted({tuple(m._tp()) for _, m in lora_modules(model)})  # (tp, rank) cached at construction
    CALLS.clear()  # the step's sum of the gradients left partial over TP (the optimizer's, once per step)
    summed = sum_partial_grads(list(model.parameters()), parallel_state.get_tensor_model_parallel_group())
    step = {"summed": summed, "collectives": list(CALLS)}
    # the same microbatch through an FP8 base (every decoder linear; its own GEMM and Megatron's collectives)
    fp8 = build_model_from_hf(workdir / "base", sequence_parallel=True, fused_ops="torch",
                              base_precision="fp8", params_dtype=torch.bfloat16, fp8_bf16_layers=0)
    for i, r in enumerate((4, 8)):
        add_adapter(fp8, f"a{i}", LoRASpec(r=r, lora_alpha=2 * r, target_modules=("all-linear",)), seed=i)
    fp8.train()
    CALLS.clear()
    with lora_batch(fp8, b.routing, b.adapters, [11, 12]):
        fp8(b.tokens, b.position_ids, attention_mask=None, labels=b.labels,
            packed_seq_params=b.packed_seq_params()).float().sum().backward()
    (workdir / f"rank{dist.get_rank()}.json").write_text(json.dumps({
        "microbatches": out, "tp_geometry": geometry, "step": step, "fp8": list(CALLS)}))
    destroy_distributed()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    main(Path(sys.argv[1]))

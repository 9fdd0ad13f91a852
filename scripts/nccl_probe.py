"""How fast two (or more) GPUs of this machine exchange data through NCCL: all-gather and reduce-scatter of
16 MiB per rank (the size of a tensor-parallel collective of the 8B shape at 4,096 tokens), CUDA events,
warm-up, the median of 20. Prints one JSON line per collective (GB/s of bus bandwidth, as nccl-tests
counts it).

    torchrun --nproc_per_node 2 scripts/nccl_probe.py     # scripts/device/nccl_probe.sh: with the topology
"""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    n = 16 * 2**20 // 2  # bf16 elements per rank
    shard = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    full = torch.empty(n * world, device="cuda", dtype=torch.bfloat16)
    ops = {"all_gather": lambda: dist.all_gather_into_tensor(full, shard),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full)}
    for name, op in ops.items():
        for _ in range(5):
            op()
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            op()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        t = statistics.median(times)
        busbw = n * 2 * world * (world - 1) / world / t / 1e9
        if rank == 0:
            print(json.dumps({"collective": name, "ranks": world, "bytes_per_rank": n * 2, "median_s": t,
                              "bus_GB_per_s": round(busbw, 1), "device": torch.cuda.get_device_name()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

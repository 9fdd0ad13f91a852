"""Two ranks (RANK/WORLD_SIZE env): the overlapped TP linears of lorafusion.ops.tp_overlap against the unsplit
math on the full tensors, forward and backward, each pattern (column / row, with and without sequence
parallelism). ``python tp_overlap_worker.py OUT_DIR [gloo|nccl]``: gloo on the CPU in float32, or NCCL on
GPU ``RANK`` in bfloat16 at a transformer's shapes (the async collectives on NCCL's stream, the GEMMs on the
compute stream; tensors freed and reused while collectives are in flight). Rank 0 writes OUT_DIR/ok.txt when
all hold."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: Path, backend: str) -> None:
    from lorafusion.ops.tp_overlap import column_linear_overlapped, row_linear_overlapped

    gpu = backend == "nccl"
    if gpu:
        torch.cuda.set_device(int(__import__("os").environ["RANK"]))
    dist.init_process_group(backend)
    torch.set_num_threads(1)
    r, tp, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    dev, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    # CPU: 37 rows a rank (nano-batches of 12, 13 and 12 rows); GPU: 2047 rows a rank at a model's widths
    S, K, N = (4094, 1024, 2048) if gpu else (74, 12, 10)
    X, W = torch.randn(S, 1, K, generator=g), torch.randn(N, K, generator=g) / K ** 0.5
    G, H = torch.randn(S, 1, N, generator=g), torch.randn(S, 1, K, generator=g)
    X, W, G, H = (t.to(dev, dtype) for t in (X, W, G, H))
    m, n_loc, k_loc = S // tp, N // tp, K // tp
    rows, outs = slice(r * m, (r + 1) * m), slice(r * n_loc, (r + 1) * n_loc)
    ins = slice(r * k_loc, (r + 1) * k_loc)

    def close(got, want, scale=None):
        """CPU: float32 equality to float tolerance. GPU (bf16): the GEMMs of a nano-batch may sum in another
        order and a sum of terms rounds by their size, not by the result's: each element within 2% of
        ``scale`` (the sum of the absolute terms that make it up; default: |want|) plus 0.02."""
        if not gpu:
            torch.testing.assert_close(got.float(), want.float())
            return
        err = (got.float() - want.float()).abs()
        bad = err > 2e-2 * (want.float().abs() if scale is None else scale.float()) + 2e-2
        assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements off, largest error {err.max():.3g}"

    # a term partial over the ranks riding on the base's collectives: rank q's share (q+1)·T, sum (tp+1)tp/2·T
    share, total = r + 1, tp * (tp + 1) / 2
    for nano in (0, 1, 2, 3):  # (0: the collectives in line, nothing split)
        for sp in (False, True):
            # column-parallel: W split by output rows; the kept input's gradient is partial
            x = (X[rows] if sp else X).clone().requires_grad_()
            y, full = column_linear_overlapped(x, W[outs], group, nano, sequence_parallel=sp, keep_input=True)
            close(y, X @ W[outs].t())
            close(full, X)
            loss = (y * G[..., outs]).sum() + (full * H).sum() * share
            loss.backward()
            want, scale = (G @ W) + total * H, (G @ W).abs() + total * H.abs()
            close(x.grad, want[rows] if sp else want, scale[rows] if sp else scale)
            # only the kept input reaches the loss: its partial gradients alone, summed
            x = (X[rows] if sp else X).clone().requires_grad_()
            _, full = column_linear_overlapped(x, W[outs], group, nano, sequence_parallel=sp, keep_input=True)
            ((full * H).sum() * share).backward()
            close(x.grad, total * (H[rows] if sp else H))
            # row-parallel: W split by input columns
            x = X[..., ins].clone().requires_grad_()
            y = row_linear_overlapped(x, W[:, ins], group, nano, sequence_parallel=sp)
            close(y, (X @ W.t())[rows] if sp else X @ W.t())
            (y * (G[rows] if sp else G)).sum().backward()
            close(x.grad, G @ W[:, ins])
            # a full-sequence partial term added before the reduction; its gradient: the whole dY, everywhere
            x = X[..., ins].clone().requires_grad_()
            delta = (0.5 * share * H[..., :N]).clone().requires_grad_()
            y = row_linear_overlapped(x, W[:, ins], group, nano, sequence_parallel=sp, delta=delta)
            base, extra = X @ W.t(), 0.5 * total * H[..., :N]
            want, scale = base + extra, base.abs() + extra.abs()
            close(y, want[rows] if sp else want, scale[rows] if sp else scale)
            (y * (G[rows] if sp else G)).sum().backward()
            close(x.grad, G @ W[:, ins])
            close(delta.grad, G)
    if gpu:
        torch.cuda.synchronize()
    if r == 0:
        (out / "ok.txt").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "gloo")

"""Process-group and Megatron ``parallel_state`` set-up for torchrun, Slurm or a single process."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(tp: int = 1, pp: int = 1, *, seed: int = 1234, backend: str | None = None,
                     virtual_stages: int | str = 1) -> dict:
    """Initialise torch.distributed (env:// from torchrun/Slurm, or a 1-process group) and Megatron's
    parallel state with ``tp``×``pp`` (dp = world / (tp·pp)), ``virtual_stages`` model chunks per pipeline
    rank (interleaved 1F1B when > 1; "auto": one until :func:`set_virtual_stages` gives the count the run
    plan chose — the process groups do not depend on it). On a machine without CUDA the megatron CPU shims
    are applied and gloo is used."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    global _virtual_pending
    _virtual_pending = virtual_stages == "auto"
    if _virtual_pending:
        virtual_stages = 1

    cuda = torch.cuda.is_available()
    if not cuda:
        from megatron_patches import apply_cpu_patches

        apply_cpu_patches()
    from megatron_patches import (apply_host_synchronous_p2p, apply_local_p2p_shapes,
                                  apply_stream_local_p2p_sync, create_pipeline_shape_groups,
                                  shape_check_enabled)

    # no device-wide synchronise in the pipeline p2p, its shapes taken from the plan (never exchanged), and
    # interleaved 1F1B's unbatched p2p done before compute goes on (see megatron_patches/p2p.py)
    apply_stream_local_p2p_sync()
    apply_local_p2p_shapes()
    apply_host_synchronous_p2p()
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = backend or ("nccl" if cuda else "gloo")
        if "RANK" in os.environ:  # torchrun / Slurm: env:// rendezvous
            dist.init_process_group(backend)
        else:  # a single process; nothing is put into os.environ, so child processes start clean
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"parallelism: tp*pp = {tp}*{pp} does not divide the world size {world}")
    if parallel_state.model_parallel_is_initialized():
        layout = (parallel_state.get_tensor_model_parallel_world_size(),
                  parallel_state.get_pipeline_model_parallel_world_size(),
                  parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1)
        if layout == (tp, pp, virtual_stages):
            # the same layout in the same process group (runs one after another in one process): keep its
            # groups. destroy_model_parallel only forgets them; their gloo threads would stay, two per group,
            # ~20 groups per layout (a test session of in-process runs reached 1,600 idle threads and doubled
            # its time)
            model_parallel_cuda_manual_seed(seed)
            return {"rank": dist.get_rank(), "world": world, "tp": tp, "pp": pp, "dp": world // (tp * pp)}
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual_stages if virtual_stages > 1 else None)
    if shape_check_enabled():  # collective: a gloo group per pipeline, for the shapes' debug cross-check
        create_pipeline_shape_groups()
    model_parallel_cuda_manual_seed(seed)
    return {"rank": dist.get_rank(), "world": world, "tp": tp, "pp": pp, "dp": world // (tp * pp)}


_virtual_pending = False  # virtual_stages: auto, not yet set (warm_communicators warms both p2p kinds)


def init_distributed_for(parallelism, *, seed: int = 1234) -> dict:
    """:func:`init_distributed` for a run config's ``parallelism`` section (its ``tp``, ``pp`` and
    ``virtual_stages``; "auto": one until the run plan's count is set with :func:`set_virtual_stages`)."""
    p = parallelism
    return init_distributed(p.tp, p.pp, seed=seed, virtual_stages=p.virtual_stages)


def set_virtual_stages(virtual_stages: int) -> None:
    """Megatron's virtual pipeline size (model chunks per rank) after the run plan chose it
    (``virtual_stages: auto``): only the count and this rank's chunk index change, never a process group."""
    from megatron.core import parallel_state as ps

    global _virtual_pending
    _virtual_pending = False
    if virtual_stages > 1 and ps.get_pipeline_model_parallel_world_size() < 2:
        raise ValueError(f"virtual_stages {virtual_stages} needs a pipeline (pp > 1)")
    ps.set_virtual_pipeline_model_parallel_world_size(virtual_stages if virtual_stages > 1 else None)
    ps.set_virtual_pipeline_model_parallel_rank(0 if virtual_stages > 1 else None)


def multi_process() -> bool:
    """Whether torch.distributed runs more than one process (what every collective of ours first asks)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_rank0() -> bool:
    """Whether this process is global rank 0 (a single process is)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def min_over_ranks(value: float, device="cuda") -> float:
    """The smallest ``value`` of all ranks (an all-reduce on ``device`` when multi-process; else
    ``value``)."""
    if not multi_process():
        return value
    t = torch.tensor([float(value)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.item()


def warm_communicators() -> None:
    """Create, on a GPU, the NCCL communicators a training step uses (the model-parallel, data-parallel,
    tensor- and pipeline-parallel groups' all-reduces and the pipeline's p2p with its neighbours: batched
    under 1F1B, each tensor on its own round the ring under interleaved 1F1B), so that their buffers —
    allocated outside torch's allocator, on a communicator's first use — are already taken when the free GPU
    memory is read for the memory plan. Collective over all ranks; nothing without CUDA or with one
    process."""
    if not (multi_process() and torch.cuda.is_available()):
        return
    from megatron.core import parallel_state as ps

    x = torch.zeros(1, device="cuda")
    groups = [None]
    if ps.model_parallel_is_initialized():
        groups += [ps.get_model_parallel_group(), ps.get_data_parallel_group(),
                   ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()]
    for g in groups:
        if dist.get_world_size(g) > 1:
            dist.all_reduce(x, group=g)
    if not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1:
        torch.cuda.synchronize()
        return
    if (ps.get_virtual_pipeline_model_parallel_world_size() or 1) > 1 or _virtual_pending:
        warm_interleaved_p2p("cuda")  # (virtual_stages still to be chosen: both kinds of p2p)
        torch.cuda.synchronize()
        if not _virtual_pending:
            return
    g = ps.get_pipeline_model_parallel_group()
    first = ps.is_pipeline_first_stage(ignore_virtual=True)
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    out, inn = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    ops = []
    if not last:  # forward activations go to the next stage, gradients come back from it
        ops += [dist.P2POp(dist.isend, out, ps.get_pipeline_model_parallel_next_rank(), g),
                dist.P2POp(dist.irecv, inn.clone(), ps.get_pipeline_model_parallel_next_rank(), g)]
    if not first:
        ops += [dist.P2POp(dist.irecv, inn, ps.get_pipeline_model_parallel_prev_rank(), g),
                dist.P2POp(dist.isend, out.clone(), ps.get_pipeline_model_parallel_prev_rank(), g)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    torch.cuda.synchronize()


def warm_interleaved_p2p(device) -> tuple[int, int]:
    """One exchange each way round the pipeline ring through Megatron's own unbatched p2p (``_p2p_ops``, what
    interleaved 1F1B's unbatched p2p sends with: each tensor on its own, on the groups and in the
    order it uses), so the communicators NCCL makes for it on first use — the host waiting there until the
    peer makes it too, the buffers outside torch's allocator — exist before training, on every rank at once.
    Collective over the pipeline group; returns the global ranks heard from: (previous, next)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.p2p_communication import _p2p_ops

    ring = dict(group=ps.get_pipeline_model_parallel_group(),
                prev_pipeline_rank=ps.get_pipeline_model_parallel_prev_rank(),
                next_pipeline_rank=ps.get_pipeline_model_parallel_next_rank())
    me = torch.full((1,), float(dist.get_rank()), device=device)
    got = []
    for forward in (True, False):  # activations to the next rank, then gradients to the previous one
        buf = torch.full((1,), -1.0, device=device)
        reqs = _p2p_ops(tensor_send_prev=None if forward else me, tensor_recv_prev=buf if forward else None,
                        tensor_send_next=me if forward else None, tensor_recv_next=None if forward else buf,
                        **ring)
        for req in reqs.values():
            req.wait()
        got.append(buf)
    return int(got[0].item()), int(got[1].item())


def share_from_rank0(value, group=None):
    """``value`` as global rank 0 has it, on every rank of ``group`` (collective; a single process:
    ``value``)."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    from megatron_patches import forget_pipeline_shape_groups

    forget_pipeline_shape_groups()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

"""``python p2p_shapes_worker.py MODE OUT`` on two gloo processes (RANK, WORLD_SIZE, MASTER_ADDR/PORT env):
Megatron's ``P2PCommunicator._communicate_shapes`` between the two ranks of a PP=2 ring (prev = next = the
peer), this rank's CALLS in turn; writes ``OUT.RANK``: ``{"got": [[recv_prev_shape, recv_next_shape], ...]}``
and ``"error"`` (text) if a call raised.

MODE "check": megatron_patches' local shapes (a source holding what the peer sends) cross-checked over the
gloo group of create_pipeline_shape_groups (LORAFUSION_P2P_SHAPE_CHECK=1); the communicator's own group is a
dummy that fails on any use, and torch.cuda.synchronize / current_device, batched p2p and any p2p outside the
shape group fail the run. MODE "nogroup": the same without the group (an error is expected). MODE "wrong":
as "check", with the first activation shape each rank expects one token short (an error is expected).
MODE "megatron": Megatron's own exchange with the world (gloo) as the pipeline group.
MODE "ring" (any world size): lorafusion.dist.init_distributed at PP = world x 2 virtual stages with the
cross-check on, then warm_interleaved_p2p and one cross-checked shape exchange each way round the ring through
a P2PCommunicator of Megatron's pipeline group; writes ``{"heard": [prev, next], "got": [recv_prev_shape,
recv_next_shape]}``."""

import contextlib
import datetime
import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

# per rank, its calls in order: (activation shape sent to the next rank or None, gradient shape sent to the
# previous rank or None, recv_prev, recv_next)
CALLS = [
    [  # rank 0
        ((5, 1, 8), (7, 1, 8), True, True),  # an activation's and a gradient's shape to one peer, both back
        ((17, 1, 8), None, False, True),     # send forward + receive backward ...
        (None, (23, 1, 8), True, False),
        ((31, 1, 8), None, True, False),     # one direction, several calls in a row: first in, first out
        ((41, 1, 8), None, True, False),
        (None, (47, 1, 8), False, True),
        (None, None, True, True),            # both received in one call, sent in two, the gradient's first
    ],
    [  # rank 1
        ((11, 1, 8), (13, 1, 8), True, True),
        (None, (19, 1, 8), True, False),     # ... against send backward + receive forward
        ((29, 1, 8), None, False, True),
        ((37, 1, 8), None, True, False),
        ((43, 1, 8), None, True, False),
        (None, (53, 1, 8), False, True),
        (None, (59, 1, 8), False, False),
        ((61, 1, 8), None, False, False),
    ],
]

class _NoGroup:
    def __getattr__(self, name):
        raise AssertionError(f"the data pipeline group was used for shapes ({name})")


def _fail(what):
    def f(*args, **kwargs):
        raise AssertionError(f"{what} used for the shape exchange")
    return f


def _guard(shape_group):
    torch.cuda.synchronize = _fail("torch.cuda.synchronize")
    torch.cuda.current_device = _fail("torch.cuda.current_device")
    dist.batch_isend_irecv = _fail("batch_isend_irecv")
    for name in ("isend", "irecv"):
        real = getattr(dist, name)

        def checked(tensor, *args, _real=real, _name=name, **kwargs):
            group = kwargs.get("group")
            if group is not shape_group or dist.get_backend(group) != "gloo" or tensor.device.type != "cpu":
                raise AssertionError(f"{_name} outside the gloo shape group")
            return _real(tensor, *args, **kwargs)
        setattr(dist, name, checked)


def ring(out: str) -> None:
    """Rank r sends (r + 1, 1, 8) forward and (r + 11, 1, 8) backward."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from lorafusion.dist import destroy_distributed, init_distributed, warm_interleaved_p2p

    from megatron_patches import local_p2p_shapes

    world = int(os.environ["WORLD_SIZE"])
    init_distributed(1, world, virtual_stages=2)
    rank = dist.get_rank()
    heard = warm_interleaved_p2p("cpu")
    config = SimpleNamespace(use_ring_exchange_p2p=False, virtual_pipeline_model_parallel_size=2)
    comm = P2PCommunicator(ps.get_pipeline_model_parallel_group(), config)
    prev, nxt = (rank - 1) % world, (rank + 1) % world
    source = {"send_next": [((rank + 1, 1, 8), "a")], "send_prev": [((rank + 11, 1, 8), "g")],
              "recv_prev": [((prev + 1, 1, 8), "a")], "recv_next": [((nxt + 11, 1, 8), "g")]}
    with local_p2p_shapes(source):
        got = comm._communicate_shapes(torch.empty(rank + 1, 1, 8), torch.empty(rank + 11, 1, 8), True, True)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"heard": list(heard), "got": list(got)}, f)
    destroy_distributed()


def local_source(rank: int, wrong: bool = False) -> dict:
    """This rank's shape source for CALLS: what it sends, and what its peer sends it, in order."""
    own, peer = CALLS[rank], CALLS[1 - rank]
    recv_prev = [tuple(a) for a, _, _, _ in peer if a is not None][:sum(c[2] for c in own)]
    recv_next = [tuple(g) for _, g, _, _ in peer if g is not None][:sum(c[3] for c in own)]
    if wrong:
        recv_prev[0] = (recv_prev[0][0] - 1,) + recv_prev[0][1:]
    return {"send_next": [(a, "a") for a, _, _, _ in own if a is not None],
            "send_prev": [(g, "g") for _, g, _, _ in own if g is not None],
            "recv_prev": [(a, "a") for a in recv_prev], "recv_next": [(g, "g") for g in recv_next]}


def main(mode: str, out: str) -> None:
    os.environ["LORAFUSION_P2P_SHAPE_CHECK"] = "1"
    if mode == "ring":
        return ring(out)
    from megatron_patches import (apply_cpu_patches, apply_local_p2p_shapes, create_pipeline_shape_groups,
                                  local_p2p_shapes)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    apply_cpu_patches()
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    comm = P2PCommunicator.__new__(P2PCommunicator)
    comm.config = SimpleNamespace(use_ring_exchange_p2p=False)
    comm.prev_rank = comm.next_rank = 1 - rank
    comm.virtual_pipeline_model_parallel_size = 2
    if mode == "megatron":
        comm.pp_group = dist.group.WORLD
    else:
        apply_local_p2p_shapes()
        if mode != "nogroup":
            create_pipeline_shape_groups([[0, 1]])
        from megatron_patches import pipeline_shape_group

        comm.pp_group = _NoGroup()
        _guard(pipeline_shape_group())
    got = []
    try:
        with (local_p2p_shapes(local_source(rank, wrong=mode == "wrong")) if mode != "megatron"
              else contextlib.nullcontext()):
            for act, grad, recv_prev, recv_next in CALLS[rank]:
                got.append(comm._communicate_shapes(None if act is None else torch.empty(act),
                                                    None if grad is None else torch.empty(grad),
                                                    recv_prev, recv_next))
        result = {"got": got}
    except Exception as e:  # noqa: BLE001 - the test reads it
        result = {"error": f"{type(e).__name__}: {e}", "got": got}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main(sys.argv[1], sys.argv[2])

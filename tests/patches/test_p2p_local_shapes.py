"""The pipeline p2p's shapes from the schedule's local source (megatron_patches.local_p2p_shapes), in one
process without any process group: Megatron's ``_communicate_shapes`` answers from the source, nothing is
exchanged; a tensor sent whose shape differs from the plan's, a source read past its end, one left unread, and
a p2p call outside any source are each a clear error (on NCCL a receive of the wrong size would hang or read
garbage). The orders the runtime derives pair every rank's sends with its neighbours' receives."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lorafusion.scheduler import p2p_order, stage_order


@pytest.fixture
def comm():
    from megatron_patches import apply_cpu_patches, apply_local_p2p_shapes

    apply_cpu_patches()
    apply_local_p2p_shapes()
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    c = P2PCommunicator.__new__(P2PCommunicator)
    c.config = SimpleNamespace(use_ring_exchange_p2p=False)
    c.prev_rank = c.next_rank = 1
    return c


SOURCE = {"recv_prev": [((7, 1, 8), "mb 0"), ((3, 1, 8), "mb 1")], "recv_next": [((5, 1, 8), "mb 0")],
          "send_next": [((4, 1, 8), "mb 0")], "send_prev": []}


def test_shapes_come_from_the_source_without_any_exchange(comm, monkeypatch):
    from megatron_patches import local_p2p_shapes

    def no_p2p(*a, **k):
        raise AssertionError("a p2p call during the shape look-up")
    for name in ("isend", "irecv", "batch_isend_irecv", "send", "recv"):
        monkeypatch.setattr(dist, name, no_p2p)
    assert not dist.is_initialized() or dist.get_world_size() == 1
    with local_p2p_shapes(SOURCE) as source:
        assert comm._communicate_shapes(torch.empty(4, 1, 8), None, True, True) == ([7, 1, 8], [5, 1, 8])
        assert comm._communicate_shapes(None, None, True, False) == ([3, 1, 8], [0, 0, 0])
    assert all(source.used[ch] == len(q) for ch, q in source.queues.items())


def test_a_tensor_sent_with_another_shape_than_the_plans_is_an_error(comm):
    from megatron_patches import local_p2p_shapes

    with pytest.raises(RuntimeError, match=r"send_next of mb 0 is \(5, 1, 8\), the plan gives \(4, 1, 8\)"):
        with local_p2p_shapes(SOURCE):
            comm._communicate_shapes(torch.empty(5, 1, 8), None, True, True)


def test_a_source_read_past_its_end_or_left_unread_is_an_error(comm):
    from megatron_patches import local_p2p_shapes

    with pytest.raises(RuntimeError, match="issued recv_next tensor 2, the shape source holds 1"):
        with local_p2p_shapes(SOURCE):
            comm._communicate_shapes(torch.empty(4, 1, 8), None, True, True)
            comm._communicate_shapes(None, None, True, True)
    with pytest.raises(RuntimeError, match=r"shapes never used \{'recv_prev': 1\}"):
        with local_p2p_shapes(SOURCE):
            comm._communicate_shapes(torch.empty(4, 1, 8), None, True, True)


def test_a_p2p_call_outside_a_source_is_an_error(comm):
    with pytest.raises(RuntimeError, match="outside megatron_patches.local_p2p_shapes"):
        comm._communicate_shapes(None, None, True, False)


@pytest.mark.parametrize("S,V,m", [(2, 1, 5), (4, 1, 3), (2, 2, 4), (4, 2, 8), (3, 3, 6), (2, 2, 6)])
@pytest.mark.parametrize("forward_only", [False, True])
def test_each_ranks_sends_pair_with_its_neighbours_receives(S, V, m, forward_only):
    """Round the ring, rank r's activations sent go in order to rank r+1's activation receives (the ring's
    last rank to rank 0's next model chunk) and its gradients sent to rank r-1's gradient receives,
    microbatch by microbatch; every forward of the schedule but the first virtual stage's receives one, every
    backward but the last virtual stage's."""
    orders = [p2p_order(S, r, m, V, forward_only=forward_only) for r in range(S)]
    for r in range(S):
        nxt = orders[(r + 1) % S]
        assert [u for u, _ in orders[r]["send_next"]] == [u for u, _ in nxt["recv_prev"]]
        assert [c + (r == S - 1) for _, c in orders[r]["send_next"]] == [c for _, c in nxt["recv_prev"]]
        assert [u for u, _ in nxt["send_prev"]] == [u for u, _ in orders[r]["recv_next"]]
        ops = stage_order(S, r, m, V)
        fwd = [(u, c) for k, u, c in ops if k == "F" and not (r == 0 and c == 0)]
        bwd = [(u, c) for k, u, c in ops if k == "B" and not (r == S - 1 and c == V - 1)]
        assert orders[r]["recv_prev"] == fwd
        assert orders[r]["recv_next"] == ([] if forward_only else bwd)
    assert p2p_order(1, 0, m, 1) == {"recv_prev": [], "send_next": [], "recv_next": [], "send_prev": []}

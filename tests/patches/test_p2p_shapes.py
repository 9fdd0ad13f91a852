"""The pipeline's p2p shapes (megatron_patches/p2p.py). Local: taken from the schedule's shape source with
no process group at all, each tensor sent checked against it, a source read past its end or left unread an
error. The debug cross-check (LORAFUSION_P2P_SHAPE_CHECK) on two gloo processes of a PP=2 ring, where the
previous and the next rank are one peer: each shape reaches its side (an activation's shape is received as
recv_prev, a gradient's as recv_next, also when both cross in one call), first in first out per direction,
and equals the local source's; the exchange runs on the host over the gloo pipeline group alone (the data
group, torch.cuda.synchronize and batched p2p fail if used); without the group it is an error that says what
to call; a local shape that differs from the peer's is an error. Megatron's own exchange pairs the crossing
shapes wrongly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime_utils import load_file_module

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("p2p_shapes_worker.py")


def _calls() -> list:
    return load_file_module(WORKER, "p2p_shapes_worker").CALLS


def _expected(rank: int) -> list:
    """Per call of ``rank``: the peer's activation shapes in the order it sent them, one per recv_prev; its
    gradient shapes likewise, one per recv_next; [0, 0, 0] for one not received."""
    peer = _calls()[1 - rank]
    acts = iter([list(a) for a, _, _, _ in peer if a is not None])
    grads = iter([list(g) for _, g, _, _ in peer if g is not None])
    return [[next(acts) if recv_prev else [0, 0, 0], next(grads) if recv_next else [0, 0, 0]]
            for _, _, recv_prev, recv_next in _calls()[rank]]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(mode: str, tmp: Path, world: int = 2) -> list[dict]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), mode, str(tmp / mode)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((tmp / f"{mode}.{rank}").read_text()) for rank in range(world)]


@pytest.mark.slow
def test_shapes_reach_their_side_over_the_gloo_pipeline_group_alone(tmp_path):
    results = _run("check", tmp_path)
    for rank, r in enumerate(results):
        assert "error" not in r, (rank, r)
        assert r["got"] == _expected(rank), rank


@pytest.mark.slow
def test_without_the_gloo_group_the_exchange_says_what_to_call(tmp_path):
    for r in _run("nogroup", tmp_path):
        assert r["got"] == [] and "create_pipeline_shape_groups" in r["error"], r


@pytest.mark.slow
def test_the_cross_check_catches_a_local_shape_the_peer_did_not_send(tmp_path):
    for rank, r in enumerate(_run("wrong", tmp_path)):
        assert r["got"] == [] and "the local source gives" in r["error"], (rank, r)
        assert str(_expected(rank)[0][0]) in r["error"], (rank, r)


@pytest.mark.slow
def test_megatrons_own_exchange_pairs_crossing_shapes_wrongly(tmp_path):
    """What the tags prevent: Megatron's one batch per call pairs a PP=2 peer's shapes by program order, so
    the activation's and the gradient's shape sent in one call arrive swapped."""
    results = _run("megatron", tmp_path)
    for rank, r in enumerate(results):
        first, want = r["got"][0] if r["got"] else None, _expected(rank)[0]
        assert first == want[::-1] and first != want, (rank, first, want)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_the_run_set_up_warms_the_ring_and_exchanges_shapes_round_it(tmp_path, world):
    """As a run sets the pipeline up (lorafusion.dist.init_distributed: the gloo groups made from Megatron's
    parallel state) at PP = world x 2 virtual stages: the warm-up of interleaved 1F1B's unbatched p2p hears
    from both neighbours of the ring, and a shape exchange through Megatron's own communicator gets the
    previous rank's activation shape and the next rank's gradient shape."""
    for rank, r in enumerate(_run("ring", tmp_path, world)):
        prev, nxt = (rank - 1) % world, (rank + 1) % world
        assert r["heard"] == [prev, nxt], (rank, r)
        assert r["got"] == [[prev + 1, 1, 8], [nxt + 11, 1, 8]], (rank, r)

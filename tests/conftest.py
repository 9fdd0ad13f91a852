import os
import sys

# before torch starts OpenMP: threads waiting for work sleep instead of spinning, which on cores shared with
# other processes burnt 10-25x the CPU of the work itself (lorafusion.cli sets the same for the processes it
# starts)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
# Threads: under `-n N` the N workers, and the processes they start, share the cores. More threads than cores
# make torch's threads wait for each other at every op of these tiny models (2 cores, 2 workers of 2 threads:
# an in-process training test ran 5-8x slower than alone, all of it CPU time). So each worker gets its share,
# and so do the processes it starts unless they set their own.
_THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
torch.set_num_threads(_THREADS)
# Without CUDA, Triton's interpreter runs the kernels on the CPU. TRITON_INTERPRET must be set before any
# triton.jit-decorated code is imported, and tests outside tests/kernels (checkpoint/, export/, inference/,
# ... sort before it and are collected first) import modules that import the kernels: so it is set here, once.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def megatron_single():
    """Megatron parallel state for one process (TP=1, PP=1), set up once per test session."""
    from megatron.core import parallel_state

    from lorafusion.dist import init_distributed

    if not parallel_state.model_parallel_is_initialized() or \
            parallel_state.get_tensor_model_parallel_world_size() != 1:
        init_distributed(1, 1)
    yield


def pytest_configure(config):
    """Under ``-n`` (pytest-xdist, --dist load) each test goes to whichever worker is free: --maxschedchunk 1
    unless given. By default each worker first takes a block of an eighth of the list, and the slow tests,
    which come first, all went to one worker (``make test`` on 2 cores: the other one idled for ~2 minutes at
    the end)."""
    if getattr(config.option, "maxschedchunk", 0) is None:  # xdist installed, option not given
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config, items):
    """Slow (multi-process) tests first, in file order: under ``-n 2`` both workers start on the long runs
    and end on the many short tests, instead of one worker finishing a long run alone at the end."""
    # stable: order kept within each part
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

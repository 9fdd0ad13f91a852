import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def megatron_single():
    """Megatron parallel state for one process (TP=1, PP=1), set up once per test session."""
    from megatron.core import parallel_state

    from lorafusion.runtime.dist import init_distributed

    if not parallel_state.model_parallel_is_initialized() or \
            parallel_state.get_tensor_model_parallel_world_size() != 1:
        init_distributed(1, 1)
    yield


def pytest_configure(config):
    """Under ``-n`` (pytest-xdist, --dist load) each test goes to whichever worker is free: --maxschedchunk 1
    unless given. By default each worker first takes a block of an eighth of the list, and the slow tests, which
    come first, all went to one worker (``make test`` on 2 cores: the other one idled for ~2 minutes at the end)."""
    if getattr(config.option, "maxschedchunk", 0) is None:  # xdist installed, option not given
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config, items):
    """Slow (multi-process) tests first, in file order: under ``-n 2`` both workers start on the long runs
    and end on the many short tests, instead of one worker finishing a long run alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: order kept within each part

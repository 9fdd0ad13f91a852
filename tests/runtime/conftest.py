"""Shared by the runtime tests: one trained three-job run (session-scoped: several files compare to it)."""

import pytest

from runtime_utils import three_job_dicts, train_inprocess, write_run


@pytest.fixture(scope="session")
def three_jobs(tmp_path_factory, megatron_single):
    tmp = tmp_path_factory.mktemp("rt")
    jobs = three_job_dicts(tmp)
    summary, out = train_inprocess(write_run(tmp, jobs, out="together"))
    return tmp, jobs, summary, out

"""On a GPU, a training chunk's microbatches (forward, loss, backward and the jobs' optimizer steps inside the
schedule) never make the host wait for the GPU: torch's sync debug mode reports every synchronising call (a
copy from pageable memory, ``.item()``, ``.tolist()``, a blocking ``nonzero``...) while Megatron's schedule
runs. A sync there stops the host from enqueueing ahead, so a microbatch whose host work outlasts its GPU work
(a small one) costs its host time. The chunk's one read of losses and norms (after the schedule) is allowed,
and so is the first chunk (first-use work: Megatron moves RoPE's frequencies to the GPU, the LoRA layers build
their block indices); the chunks after it are watched. (Torch's notice that the mode is a prototype that does
not detect every synchronising operation is not a sync; on one H200, 2026-11-25, it was the only warning of
the chunks watched.)"""

import warnings

import pytest
import torch

from tests.runtime_utils import three_job_dicts, train_inprocess, write_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("recompute", [False, True])
def test_schedule_has_no_host_sync(tmp_path, monkeypatch, recompute):
    from lorafusion.runtime import pipeline

    seen: list[str] = []
    real = pipeline.run_schedule
    calls = []

    def watched(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            return real(*args, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                real(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        seen.extend(f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                    if "called a synchronizing" in str(w.message))

    monkeypatch.setattr(pipeline, "run_schedule", watched)
    run = write_run(tmp_path, three_job_dicts(tmp_path), capacity=160, recompute=recompute)
    summary, _ = train_inprocess(run, ["model.dtype=bfloat16"])
    # a run that stopped or lost its jobs after one chunk watches nothing: say how it ended
    ended = (summary.get("status"), summary.get("stopped_by"),
             {j: str(v.get("status")) for j, v in summary["jobs"].items()})
    assert len(calls) >= 2, f"the schedule ran {len(calls)} time(s); the run ended as {ended}"
    assert not seen, "\n".join(seen[:20])

"""The process environment every training process of lorafusion runs with — ``lorafusion train`` and the
benchmarks that time what it runs — set in one place, before CUDA or OpenMP start. A user's own setting
wins."""

from __future__ import annotations

import os

__all__ = ["PROCESS_ENV", "set_process_env"]

PROCESS_ENV = {
    # Packed microbatches change size every step: expandable segments keep the CUDA caching allocator from
    # fragmenting (8B, 16k-token microbatches on one H200: 97.9 instead of 101.6 GiB reserved at the same
    # 92.5 GiB allocated)
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    # OpenMP threads waiting for work spin by default: on cores busy with other processes the demo model's
    # fwd+bwd of a 960-token microbatch burnt 2.6-5.1 s of CPU instead of 0.16-0.20 s sleeping (PASSIVE)
    "OMP_WAIT_POLICY": "PASSIVE",
}


def set_process_env() -> dict[str, str]:
    """Set each of :data:`PROCESS_ENV` unless already set; returns the values in force."""
    for key, value in PROCESS_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in PROCESS_ENV}

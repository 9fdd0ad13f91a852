"""Explicit, versioned shims that let megatron-core 0.16.x run on CPU with gloo.

Megatron-core assumes CUDA in a handful of places (``torch.cuda.current_device()``, its CUDA RNG
tracker, ``device="cuda"`` buffers in the schedules and p2p). :func:`apply_cpu_patches` replaces exactly
those, once, and only when CUDA is absent; on a GPU it does nothing. :func:`apply_recompute_state_hook`
(LoRA routing under activation recomputation), :func:`apply_packed_rope_patch` (sync-free packed RoPE
for models built with fused ops), :func:`apply_rope_positions_patch` (RoPE at explicit positions while
decoding with a KV cache), :func:`apply_stream_local_p2p_sync` (no device-wide synchronise in the
pipeline p2p while a gradient-norm all-reduce is pending) and :func:`apply_local_p2p_shapes` (the pipeline's
p2p shapes from the schedule's :func:`local_p2p_shapes` source, never exchanged; with
``LORAFUSION_P2P_SHAPE_CHECK=1`` cross-checked over a gloo group of the pipeline ranks, made by
:func:`create_pipeline_shape_groups`) and
:func:`apply_host_synchronous_p2p` (interleaved 1F1B's p2p done on the GPU before the host goes on) work on
CPU and GPU; :func:`after_each_backward`
(a callback after each pipeline backward step) and :func:`megatron_patches.trace.traced_schedule` (a record
of each rank's schedule position, only with ``LORAFUSION_PIPELINE_TRACE`` set) hold only inside their
``with``. Nothing is patched on import.
"""

from megatron_patches.cpu import apply_cpu_patches, cpu_patches_applied
from megatron_patches.p2p import (
    apply_host_synchronous_p2p,
    apply_local_p2p_shapes,
    apply_stream_local_p2p_sync,
    create_pipeline_shape_groups,
    forget_pipeline_shape_groups,
    host_synchronous_p2p_applied,
    local_p2p_shapes,
    local_p2p_shapes_applied,
    pipeline_shape_group,
    shape_check_enabled,
    stream_local_p2p_sync_applied,
)
from megatron_patches.recompute import apply_recompute_state_hook
from megatron_patches.schedule import after_each_backward
from megatron_patches.rope import (
    apply_packed_rope_patch,
    apply_rope_positions_patch,
    packed_rope_patch_applied,
    rope_positions_patch_applied,
)

__all__ = ["after_each_backward", "apply_cpu_patches", "cpu_patches_applied", "apply_stream_local_p2p_sync",
           "stream_local_p2p_sync_applied", "apply_local_p2p_shapes", "local_p2p_shapes_applied",
           "local_p2p_shapes", "shape_check_enabled",
           "apply_host_synchronous_p2p", "host_synchronous_p2p_applied",
           "create_pipeline_shape_groups", "forget_pipeline_shape_groups", "pipeline_shape_group",
           "apply_recompute_state_hook", "apply_packed_rope_patch",
           "packed_rope_patch_applied",
           "apply_rope_positions_patch", "rope_positions_patch_applied"]

"""Explicit, versioned shims that let megatron-core run on CPU (gloo). Apply with apply_cpu_patches()."""

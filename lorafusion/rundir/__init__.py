"""A run's output directory, torch-free: its layout, atomic writes, the one-run lock, requests (submit /
cancel), the status reader and adapter lookup — all that ``lorafusion submit``, ``cancel``, ``status`` and
export's lookup need beside a busy run (they must start quickly, so nothing here imports torch or
Megatron)."""

"""Data: packing planned microbatches into tensors (dataset loading arrives with the runtime issue)."""

from lorafusion.data.packing import PackedBatch, pack_microbatch

__all__ = ["PackedBatch", "pack_microbatch"]

"""Per-microbatch adapter routing: which contiguous rows of a packed batch belong to which adapter."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Routing:
    """Contiguous row segments of one packed batch.

    ``segments`` holds ``(slot, start, length)`` triples over the rows of the input flattened to 2-D
    (Megatron's ``[s, b, h]`` flattens to ``s*b`` rows). ``slot`` indexes the adapter lists passed to the
    op. Rows covered by no segment get no LoRA term. Segments are sorted by start and never overlap;
    several segments may use the same slot.

    ``row_ids`` (optional, int64, one per row) are packing-independent ids used to key dropout masks, so
    a token's mask does not depend on where the scheduler placed its sample. Defaults to the row index.
    """

    segments: tuple[tuple[int, int, int], ...]
    num_rows: int
    row_ids: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        segs = tuple((int(a), int(s), int(n)) for a, s, n in self.segments)
        object.__setattr__(self, "segments", segs)
        end = 0
        for slot, start, length in segs:
            if slot < 0 or length <= 0 or start < end:
                raise ValueError(
                    f"Routing.segments: expected sorted, non-overlapping (slot>=0, start, length>0) "
                    f"triples, got {segs}"
                )
            end = start + length
        if end > self.num_rows:
            raise ValueError(f"Routing.segments: segment ends at row {end} but the batch has {self.num_rows} rows")
        if self.row_ids is not None and self.row_ids.numel() != self.num_rows:
            raise ValueError(f"Routing.row_ids: expected {self.num_rows} ids, got {self.row_ids.numel()}")

    @classmethod
    def single(cls, num_rows: int, slot: int = 0) -> "Routing":
        """All rows go to one adapter slot."""
        return cls(segments=((slot, 0, num_rows),), num_rows=num_rows)

    @classmethod
    def from_lengths(cls, slots: list[int], lengths: list[int], row_ids: torch.Tensor | None = None) -> "Routing":
        """Back-to-back segments: slot ``slots[i]`` gets the next ``lengths[i]`` rows."""
        segs, start = [], 0
        for slot, n in zip(slots, lengths, strict=True):
            if n > 0:
                segs.append((slot, start, n))
            start += n
        return cls(segments=tuple(segs), num_rows=start, row_ids=row_ids)

    def ids(self, device: torch.device) -> torch.Tensor:
        """Row ids on ``device`` (cached per device)."""
        key = ("row_ids", str(device))
        if key not in self._cache:
            ids = self.row_ids if self.row_ids is not None else torch.arange(self.num_rows, dtype=torch.int64)
            self._cache[key] = ids.to(device=device, dtype=torch.int64)
        return self._cache[key]

    def cached(self, key, build):
        """Memoise device-side tables (kernels build their offset tables once per microbatch)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

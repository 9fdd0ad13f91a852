"""Per-microbatch adapter routing: which contiguous rows of a packed batch belong to which adapter.

Pure data (no torch): the kernels build and cache their device tables from it
(:mod:`lorafusion.ops.tables`), keyed by the routing object's identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class Routing:
    """Contiguous row segments of one packed batch.

    ``segments`` holds ``(slot, start, length)`` triples over the rows of the input flattened to 2-D
    (Megatron's ``[s, b, h]`` flattens to ``s*b`` rows). ``slot`` indexes the adapter lists passed to the
    op. Rows covered by no segment get no LoRA term. Segments are sorted by start and never overlap;
    several segments may use the same slot.

    ``row_ids`` (optional, one integer per row: a numpy int64 array, a sequence, or any 1-D array-like)
    are packing-independent ids used to key dropout masks, so a token's mask does not depend on where the
    scheduler placed its sample. Defaults to the row index.

    Equality is identity: a routing is one microbatch's, and caches are keyed by the object.
    """

    segments: tuple[tuple[int, int, int], ...]
    num_rows: int
    row_ids: Sequence[int] | None = None

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
            raise ValueError(
                f"Routing.segments: segment ends at row {end} but the batch has {self.num_rows} rows")
        if self.row_ids is not None and len(self.row_ids) != self.num_rows:
            raise ValueError(f"Routing.row_ids: expected {self.num_rows} ids, got {len(self.row_ids)}")

    @classmethod
    def single(cls, num_rows: int, slot: int = 0) -> "Routing":
        """All rows go to one adapter slot."""
        return cls(segments=((slot, 0, num_rows),), num_rows=num_rows)

    @classmethod
    def from_lengths(cls, slots: Sequence[int], lengths: Sequence[int], row_ids=None) -> "Routing":
        """Back-to-back segments: slot ``slots[i]`` gets the next ``lengths[i]`` rows."""
        segs, start = [], 0
        for slot, n in zip(slots, lengths, strict=True):
            if n > 0:
                segs.append((slot, start, n))
            start += n
        return cls(segments=tuple(segs), num_rows=start, row_ids=row_ids)

    def restrict(self, slot_map: dict[int, int]) -> "Routing | None":
        """The routing over the same rows keeping only segments whose slot is in ``slot_map``, renumbered
        by it (None when no segment is left)."""
        segs = tuple((slot_map[s], st, n) for s, st, n in self.segments if s in slot_map)
        return Routing(segments=segs, num_rows=self.num_rows, row_ids=self.row_ids) if segs else None

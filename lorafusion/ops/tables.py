"""Device tables of the FusedMultiLoRA kernels, built on the host once and reused (no Triton here).

Per microbatch (one :class:`~lorafusion.core.routing.Routing`, shared by every layer of the microbatch):
- ``row_ids`` int64 [m]: the dropout row id of every row.
- ``segs`` [n_segs, 3] (slot, start, end) and ``mb`` [m_blocks, 2] (first, last+1 segment index touching
  each BM row block of the GEMM): a row block that spans several segments loops over them.
- ``chunks`` [n_chunks, 3] (slot, start, length): every segment cut into pieces of at most ``size`` rows,
  plus rows outside every segment as slot -1 (they produce zeros). For the reduction kernels the chunks
  are sorted by slot so that each slot's partials are one contiguous range, summed in a fixed order.

Per adapter set (ranks, scalings, dropout rates — the same for every layer and microbatch of a run):
s, 1/(1-p), r, the rank offset and the dropout threshold of each slot. Per call only the Philox seeds
change; callers that know every layer's seeds ahead (the LoRA layers do, per microbatch) hand them in as
one device tensor, so a call copies nothing to the device.

A :class:`TableCache` holds all of this for one model (the LoRA layers' context owns one); the routing
tables are keyed weakly by the routing object, so they go when the microbatch goes.
"""

from __future__ import annotations

import struct
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lorafusion.core.seeds import keep_threshold


def rank_block(r_max: int) -> int:
    """Padded rank block of the kernels' ``tl.dot``: a power of two, at least 16 (``SlotTables.rb``)."""
    return max(16, 1 << max(0, (int(r_max) - 1).bit_length()))


def rank_classes(ranks: Sequence[int], slots) -> list[tuple[int, int, tuple[int, ...]]]:
    """The launches of a call's row-chunk kernels: one per rank block among ``slots`` (those with rows), as
    (rank block, the largest rank in it, its slots), smallest block first. Chunks of a slot of rank r run
    at ``rank_block(r)``, not at the call's largest block: work follows each adapter's own rank in a batch
    of mixed ranks. No slot: one launch at the block of the largest rank (it writes the zeros)."""
    by_rb: dict[int, list[int]] = {}
    for a in sorted(slots):
        by_rb.setdefault(rank_block(ranks[a]), []).append(a)
    if not by_rb:
        return [(rank_block(max(ranks)), max(ranks), ())]
    return [(rb, max(ranks[a] for a in by_rb[rb]), tuple(by_rb[rb])) for rb in sorted(by_rb)]


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """Host → device without stalling the host on the stream: pinned staging + non-blocking copy on CUDA
    (``device`` None: ``host`` as it is)."""
    if device is None:
        return host
    dev = torch.device(device)
    if dev.type == "cuda":
        return host.pin_memory().to(dev, non_blocking=True)
    return host.to(dev)


@dataclass
class SlotTables:
    seed: torch.Tensor  # int64 [S]
    thr: torch.Tensor  # int32 [S] keep iff u16 >= thr (lorafusion.core.seeds.keep_threshold)
    scale: torch.Tensor  # fp32 [S]
    inv_keep: torch.Tensor  # fp32 [S] 1/(1-p)
    r: torch.Tensor  # int32 [S]
    roff: torch.Tensor  # int32 [S]
    ranks: tuple[int, ...]
    r_max: int
    rb: int
    dropout: bool


def seed_tensor(seeds: Sequence[int] | Sequence[Sequence[int]], device) -> torch.Tensor:
    """Seeds (one list, or one list per layer) as one int64 device tensor (one copy)."""
    flat = seeds
    if seeds and not isinstance(seeds[0], int):
        flat = [s for row in seeds for s in row]
    raw = struct.pack(f"<{len(flat)}Q", *(int(s) & 0xFFFFFFFFFFFFFFFF for s in flat))
    t = to_device(torch.frombuffer(bytearray(raw), dtype=torch.int64), device)
    return t if not seeds or isinstance(seeds[0], int) else t.view(len(seeds), -1)


def _static_tables(ranks, scaling, dropout_p, device):
    n = len(ranks)
    roffs, acc = [], 0
    for r in ranks:
        roffs.append(acc)
        acc += int(r)
    ints = [int(r) for r in ranks] + roffs + [keep_threshold(p) for p in dropout_p] + [0] * (n % 2)
    raw = (struct.pack(f"<{2 * n}f", *(float(s) for s in scaling),
                       *(1.0 / (1.0 - float(p)) for p in dropout_p))
           + struct.pack(f"<{len(ints)}i", *ints))
    buf = to_device(torch.frombuffer(bytearray(raw), dtype=torch.int32), device)
    fl = buf[: 2 * n].view(torch.float32)
    it = buf[2 * n:]
    return dict(thr=it[2 * n:3 * n], scale=fl[:n], inv_keep=fl[n:2 * n], r=it[:n], roff=it[n:2 * n])


def _segments(routing):
    return [(slot, start, start + length) for slot, start, length in routing.segments]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TableCache:
    """Kernel tables for one model: per routing (weak keys) and per adapter set (bounded LRU)."""

    def __init__(self, max_adapter_sets: int = 256, one_block: bool = False):
        """``one_block``: every slot at the call's largest rank block, in one launch per kernel (how the
        kernels ran before launches per rank block; benchmarks compare against it)."""
        self.one_block = one_block
        self._routing: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._static: OrderedDict = OrderedDict()
        self._max = max_adapter_sets

    def _memo(self, routing, key, build):
        d = self._routing.get(routing)
        if d is None:
            d = self._routing[routing] = {}
        if key not in d:
            d[key] = build()
        return d[key]

    # -- per adapter set ---------------------------------------------------------------------------------
    def slot_tables(self, ranks: Sequence[int], scaling: Sequence[float], dropout_p: Sequence[float],
                    seeds: Sequence[int] | torch.Tensor, device) -> SlotTables:
        """Tables of one call. ``seeds``: Python ints (copied now) or an int64 tensor already on
        ``device``."""
        ranks = tuple(int(r) for r in ranks)
        key = (str(device), ranks, scaling if type(scaling) is tuple else tuple(float(s) for s in scaling),
               dropout_p if type(dropout_p) is tuple else tuple(float(p) for p in dropout_p))
        static = self._static.get(key)
        if static is None:
            if len(self._static) >= self._max:
                self._static.popitem(last=False)
            static = self._static[key] = _static_tables(ranks, scaling, dropout_p, device)
        else:
            self._static.move_to_end(key)
        seed = seeds if isinstance(seeds, torch.Tensor) else seed_tensor(list(seeds), device)
        r_max = max(ranks)
        return SlotTables(seed=seed, ranks=ranks, r_max=r_max, rb=rank_block(r_max),
                          dropout=any(p > 0.0 for p in key[3]), **static)

    # -- per routing -------------------------------------------------------------------------------------
    def row_ids(self, routing, device) -> torch.Tensor:
        """The routing's dropout row ids on ``device`` (int64; the row index when it has none)."""
        def build():
            ids = routing.row_ids
            host = (torch.arange(routing.num_rows, dtype=torch.int64) if ids is None
                    else torch.as_tensor(ids, dtype=torch.int64))
            return to_device(host, device) if host.device.type == "cpu" else host.to(device)

        return self._memo(routing, ("row_ids", str(device)), build)

    def gemm_tables(self, routing, bm: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(segs, mb) for row blocks of ``bm`` rows."""

        def build():
            segs = _segments(routing)
            mb, lo = [], 0
            for b in range(_cdiv(routing.num_rows, bm)):
                r0, r1 = b * bm, (b + 1) * bm
                while lo < len(segs) and segs[lo][2] <= r0:
                    lo += 1
                hi = lo
                while hi < len(segs) and segs[hi][1] < r1:
                    hi += 1
                mb += [lo, hi]
            flat = [v for s in segs for v in s] or [0, 0, 0]
            t = to_device(torch.tensor(flat + mb, dtype=torch.int32), device)
            return t[: len(flat)], t[len(flat):]

        return self._memo(routing, ("gemm", bm, str(device)), build)

    def chunk_table(self, routing, size: int, device, by_slot: bool = False):
        """(chunks tensor, n_chunks, slot_ranges) — slot_ranges: {slot: (first, last+1)} when ``by_slot``."""

        def build():
            pieces, pos = [], 0
            for slot, start, length in routing.segments:
                for s in range(pos, start, size):
                    pieces.append((-1, s, min(size, start - s)))
                for s in range(start, start + length, size):
                    pieces.append((slot, s, min(size, start + length - s)))
                pos = start + length
            for s in range(pos, routing.num_rows, size):
                pieces.append((-1, s, min(size, routing.num_rows - s)))
            ranges = {}
            if by_slot:
                pieces.sort(key=lambda c: (c[0] < 0, c[0], c[1]))
                for i, (slot, _, _) in enumerate(pieces):
                    if slot >= 0:
                        lo, _ = ranges.get(slot, (i, i))
                        ranges[slot] = (lo, i + 1)
            flat = [v for c in pieces for v in c] or [-1, 0, 0]
            return to_device(torch.tensor(flat, dtype=torch.int32), device), max(1, len(pieces)), ranges

        return self._memo(routing, ("chunks", size, by_slot, str(device)), build)

    def classes(self, routing, ranks: Sequence[int]) -> list[tuple[int, int, tuple[int, ...]]]:
        """:func:`rank_classes` of the slots with rows in ``routing``."""
        ranks = tuple(int(r) for r in ranks)
        if self.one_block:
            return [(rank_block(max(ranks)), max(ranks), tuple(range(len(ranks))))]
        return self._memo(routing, ("rank classes", ranks), lambda: rank_classes(
            ranks, {slot for slot, _, length in routing.segments if length > 0}))

    def class_chunks(self, routing, size: int, device, ranks: Sequence[int], by_slot: bool = False):
        """:meth:`chunk_table` split by :func:`rank_classes`: [(rank block, largest rank, chunks, n_chunks,
        slot ranges)], one per launch. Rows outside every segment (slot -1) go with the first (smallest)
        class, so a kernel that writes every row still does. One class: :meth:`chunk_table` as it is."""
        ranks = tuple(int(r) for r in ranks)

        def build():
            classes = self.classes(routing, ranks)
            if len(classes) == 1:
                (rb, rmax, _), = classes
                return [(rb, rmax, *self.chunk_table(routing, size, device, by_slot))]
            whole = self.chunk_table(routing, size, None if device is None else "cpu", by_slot)[0]
            rows = whole.view(-1, 3).tolist()
            out = []
            for i, (rb, rmax, slots) in enumerate(classes):
                mine = [c for c in rows if c[0] in slots or (i == 0 and c[0] < 0)]
                ranges = {}
                for j, (slot, _, _) in enumerate(mine):
                    if by_slot and slot >= 0:
                        ranges[slot] = (ranges.get(slot, (j, j))[0], j + 1)
                flat = [v for c in mine for v in c]
                out.append((rb, rmax, to_device(torch.tensor(flat, dtype=torch.int32), device), len(mine),
                            ranges))
            return out

        return self._memo(routing, ("classes", size, by_slot, ranks, str(device)), build)

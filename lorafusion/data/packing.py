"""A planned microbatch → one packed token tensor (no padding between samples).

Positions restart per sample, ``cu_seqlens`` bound the samples for attention, labels are the next token
within the same sample (the last token of a sample, and prompt tokens when masked, carry no loss), and
adapter routing gives one contiguous segment per run of same-adapter samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lorafusion.core.routing import Routing


@dataclass
class PackedBatch:
    tokens: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T]
    labels: torch.Tensor  # [1, T] next token (0 where masked)
    loss_mask: torch.Tensor  # [1, T] float, 1 where the label counts
    cu_seqlens: torch.Tensor  # [n_samples + 1] int32
    max_seqlen: int
    routing: Routing
    adapters: tuple[str, ...]  # routing slot → adapter name
    sample_adapter: tuple[str, ...]  # adapter of each sample, in order
    # cu_seqlens as host ints once the tensors live on a GPU (``to``): the per-sample attention slices by them
    # without reading the device (a host read inside a pipeline schedule can deadlock it; see ``to``)
    host_cu_seqlens: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    def host_bounds(self) -> tuple[int, ...] | None:
        """``cu_seqlens`` as host ints without reading a device (None: only the device has them)."""
        if self.host_cu_seqlens is not None:
            return self.host_cu_seqlens
        return tuple(self.cu_seqlens.tolist()) if self.cu_seqlens.device.type == "cpu" else None

    def packed_seq_params(self):
        """Megatron's ``PackedSeqParams`` (thd) of this batch, carrying ``host_cu_seqlens`` as well (the host
        copy of ``cu_seqlens`` that ``lorafusion.models.attention`` reads instead of the device's)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens,
                                 cu_seqlens_kv=self.cu_seqlens, max_seqlen_q=self.max_seqlen,
                                 max_seqlen_kv=self.max_seqlen)
        params.host_cu_seqlens = self.host_bounds()
        return params

    def to(self, device) -> "PackedBatch":
        """The tensors on ``device``; to a GPU through pinned memory without blocking the host (the host
        keeps enqueueing work while the copy waits its turn on the stream), the sample bounds kept on the
        host too. Inside interleaved 1F1B on NCCL a host read of a device tensor can wait for a pending
        pipeline receive whose peer sends only after this rank's next p2p call: a deadlock."""
        dev = torch.device(device)

        def move(t):
            if dev.type == "cuda" and t.device.type == "cpu":
                return t.pin_memory().to(dev, non_blocking=True)
            return t.to(dev)

        return PackedBatch(move(self.tokens), move(self.position_ids), move(self.labels),
                           move(self.loss_mask), move(self.cu_seqlens), self.max_seqlen, self.routing,
                           self.adapters, self.sample_adapter, self.host_bounds())

    def adapter_token_mask(self, name: str) -> torch.Tensor:
        """[1, T] bool: tokens belonging to adapter ``name``."""
        mask = torch.zeros(self.num_tokens, dtype=torch.bool)
        for slot, start, length in self.routing.segments:
            if self.adapters[slot] == name:
                mask[start:start + length] = True
        return mask[None].to(self.tokens.device)


def pack_microbatch(samples: Sequence[tuple[str, Sequence[int]]], prompt_lengths: Sequence[int] | None = None,
                    row_ids: Sequence[int] | None = None) -> PackedBatch:
    """Pack ``samples`` = [(adapter name, token ids), ...] in the given order (same-adapter samples
    should be adjacent; each adjacent run becomes one routing segment).

    ``prompt_lengths[i]`` tokens at the start of sample i carry no loss. ``row_ids[i]``, if given, is a
    packing-independent id of sample i; token t of it gets dropout row id ``row_ids[i] * 2**20 + t``.
    """
    if not samples:
        raise ValueError("pack_microbatch: no samples")
    toks, pos, labels, lmask, cu, ids = [], [], [], [], [0], []
    adapters: list[str] = []
    slots, lengths = [], []
    for i, (name, seq) in enumerate(samples):
        seq = list(seq)
        n = len(seq)
        if n < 1:
            raise ValueError(f"pack_microbatch: sample {i} of adapter {name!r} is empty")
        p = 0 if prompt_lengths is None else int(prompt_lengths[i])
        toks.extend(seq)
        pos.extend(range(n))
        labels.extend(seq[1:] + [0])
        # label of position t is token t+1: it counts when t+1 is a response token
        lmask.extend(
            [1.0 if (t + 1 >= max(p, 1) and t + 1 < n) else 0.0 for t in range(n)])  # loss_token_count
        cu.append(cu[-1] + n)
        base = i if row_ids is None else int(row_ids[i])
        ids.append(np.arange(base << 20, (base << 20) + n, dtype=np.int64))
        if name not in adapters:
            adapters.append(name)
        slot = adapters.index(name)
        if slots and slots[-1] == slot:
            lengths[-1] += n
        else:
            slots.append(slot)
            lengths.append(n)
    return PackedBatch(
        tokens=torch.tensor(toks, dtype=torch.int64)[None],
        position_ids=torch.tensor(pos, dtype=torch.int64)[None],
        labels=torch.tensor(labels, dtype=torch.int64)[None],
        loss_mask=torch.tensor(lmask, dtype=torch.float32)[None],
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(cu[i + 1] - cu[i] for i in range(len(cu) - 1)),
        routing=Routing.from_lengths(slots, lengths, row_ids=np.concatenate(ids)),
        adapters=tuple(adapters),
        sample_adapter=tuple(name for name, _ in samples),
    )


def pad_to_multiple(batch: PackedBatch, multiple: int, token: int = 0) -> PackedBatch:
    """``batch`` with its token count rounded up to a multiple of ``multiple`` (sequence parallelism splits
    the sequence over the TP ranks). The padding rows come last and belong to no adapter (no routing
    segment, so no LoRA term and no dropout), carry no loss, and form their own ``cu_seqlens`` segment
    (positions from 0), so no sample attends to them. The real rows are unchanged."""
    n = batch.num_tokens
    pad = -n % int(multiple)
    if pad == 0:
        return batch

    def cat(t, value):
        return torch.cat([t, torch.full((1, pad), value, dtype=t.dtype, device=t.device)], dim=1)

    r = batch.routing
    ids = None
    if r.row_ids is not None:
        ids = np.concatenate([np.asarray(r.row_ids, dtype=np.int64), np.full(pad, -1, dtype=np.int64)])
    cu = torch.cat([batch.cu_seqlens, batch.cu_seqlens.new_tensor([n + pad])])
    positions = torch.cat([batch.position_ids, torch.arange(pad, dtype=batch.position_ids.dtype,
                                                             device=batch.position_ids.device)[None]], dim=1)
    return PackedBatch(cat(batch.tokens, int(token)), positions, cat(batch.labels, 0),
                       cat(batch.loss_mask, 0.0), cu, max(batch.max_seqlen, pad),
                       Routing(segments=r.segments, num_rows=n + pad, row_ids=ids),
                       batch.adapters, batch.sample_adapter)


def loss_token_count(num_tokens: int, prompt_len: int) -> int:
    """Number of positions of one packed sample whose label counts (see :func:`pack_microbatch`)."""
    return max(0, num_tokens - max(int(prompt_len), 1))


def noop_microbatch(token: int = 0) -> PackedBatch:
    """A one-token microbatch with no adapter and no loss: a deliberate bubble that keeps every pipeline
    stage and data-parallel rank on the same microbatch count."""
    b = pack_microbatch([("", [int(token)])])
    return PackedBatch(b.tokens, b.position_ids, b.labels, torch.zeros_like(b.loss_mask), b.cu_seqlens, 1,
                       Routing(segments=(), num_rows=1), (), ())

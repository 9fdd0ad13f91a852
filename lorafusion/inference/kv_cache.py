"""A key/value cache for decoding packed sequences through :class:`PackedDotProductAttention`.

Each sequence being decoded owns a slot: per attention layer, keys and values live in
``[num_slots, max_len, groups, head_dim]`` buffers (this rank's heads, allocated on first use with the
activations' dtype and device). One forward serves every sequence at once, packed as in training (thd):

- **prefill**: the prompts of some slots, back to back (``cu_seqlens``); attention is the packed varlen
  attention of training, and every row's key/value is written to ``(its slot, its position)``;
- **decode**: one new row per unfinished slot; its key/value is written at the slot's current length, then
  each row attends to its own slot's cached keys (one batched SDPA over ``[slots, max cached length]``
  with a length mask; no cross-sequence attention).

RoPE: Megatron's packed RoPE restarts positions at each ``cu_seqlens`` boundary, so a decode row would be
rotated as position 0. Inside :func:`decoding` the rows are rotated at their true positions instead
(``megatron_patches.apply_rope_positions_patch``, handed :func:`rope_positions`, which asks the cache the
model is decoding through for its planned rows' positions: :attr:`KVCache.positions`).

The per-forward state of decoding lives in the cache (its plan); the model's config is never written.
Training never sees any of this: the attention checks one attribute (``kv_cache``, None outside
:func:`decoding`) and the RoPE patch finds no cache for a model that is not decoding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from megatron_patches import apply_rope_positions_patch

from lorafusion.models.attention import PackedDotProductAttention, expand_kv, varlen_attention
from lorafusion.ops.tables import to_device  # pinned + non-blocking: no stream sync per copy

_DECODING: dict[int, KVCache] = {}  # id(config) of a model decoding now (inside decoding()) -> its cache


def rope_positions(config) -> torch.Tensor | None:
    """The positions of the rows the next forward of the model with ``config`` runs, when that model is
    decoding (inside :func:`decoding`); None otherwise (what the RoPE patch is handed)."""
    cache = _DECODING.get(id(config))
    return None if cache is None else cache.positions


class KVCache:
    """Per-slot keys/values of every attention layer (see the module docstring). ``lengths[slot]`` is the
    number of tokens of that slot already cached; :meth:`prefill` or :meth:`decode` plans the next forward,
    :meth:`advance` commits it once the forward (every layer) has run."""

    def __init__(self, num_slots: int, max_len: int, device=None):
        self.num_slots, self.max_len = int(num_slots), int(max_len)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.lengths = [0] * self.num_slots
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._plan = None

    @property
    def positions(self) -> torch.Tensor | None:
        """The planned rows' positions on the device (None when no forward is planned)."""
        return None if self._plan is None else self._plan["positions"]

    # -- planning (host side, once per forward) --------------------------------------------------------
    def prefill(self, slots: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        """Plan a forward of ``lengths[i]`` prompt rows for each empty slot ``slots[i]``, packed in that
        order; returns the rows' positions."""
        if any(self.lengths[s] for s in slots):
            raise ValueError("KVCache.prefill: a slot already holds tokens (prefill starts empty slots)")
        if any(n > self.max_len for n in lengths):
            raise ValueError(f"KVCache.prefill: a prompt exceeds the cache length {self.max_len}")
        rows_slot = torch.cat([torch.full((n,), s, dtype=torch.long)
                               for s, n in zip(slots, lengths, strict=True)])
        positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])
        cu = torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()], dtype=torch.int32)
        self._set_plan("prefill", list(slots), list(lengths), rows_slot, positions, cu=cu,
                       max_seqlen=max(lengths))
        return positions

    def decode(self, slots: Sequence[int]) -> torch.Tensor:
        """Plan a forward of one new row per slot in ``slots`` (in that order); returns their positions."""
        positions = torch.tensor([self.lengths[s] for s in slots], dtype=torch.long)
        if int(positions.max()) >= self.max_len:
            raise ValueError(f"KVCache.decode: a slot is full ({self.max_len} tokens)")
        self._set_plan("decode", list(slots), [1] * len(slots), torch.tensor(list(slots), dtype=torch.long),
                       positions, kv_len=int(positions.max()) + 1)
        return positions

    def static(self, positions: torch.Tensor) -> None:
        """Plan every forward from now on (until another plan) as one row per slot, slot ``i``'s row at
        ``positions[i]``: a device buffer the caller updates in place between forwards
        (:mod:`lorafusion.inference.static_decode`). Attention covers the whole ``max_len`` with a key mask
        built on the device, so no shape or tensor of the forward changes and it can be captured in a CUDA
        graph. ``lengths`` is not kept (the caller knows them); :meth:`advance` is not called."""
        self._plan = {"kind": "static", "positions": positions,
                      "keys_at": torch.arange(self.max_len, device=positions.device)}

    def _set_plan(self, kind, slots, counts, rows_slot, positions, **extra) -> None:
        dev = self.device
        plan = {"kind": kind, "slots": slots, "counts": counts, "rows_slot": to_device(rows_slot, dev),
                "positions": to_device(positions, dev), **extra}
        if kind == "decode":
            plan["slots_t"] = plan["rows_slot"]
            plan["key_mask"] = (torch.arange(extra["kv_len"], device=dev)[None, :]
                                <= plan["positions"][:, None])[:, None, None, :]
        if "cu" in plan:
            plan["cu"] = to_device(plan["cu"], dev)
        self._plan = plan

    def advance(self) -> None:
        """The planned forward has run: its rows now belong to their slots' cached prefixes."""
        for s, n in zip(self._plan["slots"], self._plan["counts"], strict=True):
            self.lengths[s] += n
        self._plan = None

    # -- the attention (called by every layer's core attention) ----------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [t, h, d], k/v [t, g, d] of the planned rows → [t, h, d]."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("KVCache: a forward ran inside decoding() without prefill()/decode() planned")
        if layer not in self.keys:
            shape = (self.num_slots, self.max_len, k.shape[1], k.shape[2])
            self.keys[layer] = k.new_zeros(shape)
            self.values[layer] = v.new_zeros(shape)
        ck, cv = self.keys[layer], self.values[layer]
        if plan["kind"] == "static":
            return self._attend_static(ck, cv, q, k, v, scale)
        ck[plan["rows_slot"], plan["positions"]] = k
        cv[plan["rows_slot"], plan["positions"]] = v
        if plan["kind"] == "prefill":  # nothing cached before: exactly training's packed attention
            return varlen_attention(q, k, v, plan["cu"], plan["max_seqlen"], scale)
        n, h = q.shape[0], q.shape[1]
        kv_len = plan["kv_len"]
        keys = expand_kv(ck[plan["slots_t"], :kv_len], h, 2).transpose(1, 2)  # [n, h, L, d]
        vals = expand_kv(cv[plan["slots_t"], :kv_len], h, 2).transpose(1, 2)
        out = F.scaled_dot_product_attention(q[:, :, None], keys, vals, attn_mask=plan["key_mask"],
                                             scale=scale)
        return out.reshape(n, h, q.shape[2])

    def _attend_static(self, ck, cv, q, k, v, scale: float) -> torch.Tensor:
        """Row ``i`` (slot ``i``) writes its key/value at its position and attends to its slot's keys up to
        it: no host value is read, nothing is allocated from the host. GQA by viewing each group's query
        heads as that group's queries (the heads of one kv group are adjacent, as ``expand_kv`` repeats)."""
        plan = self._plan
        n, h, d = q.shape
        g = k.shape[1]
        pos = plan["positions"]
        at = pos.view(n, 1, 1).expand(n, 1, g * d)
        ck.view(n, self.max_len, g * d).scatter_(1, at, k.reshape(n, 1, g * d))
        cv.view(n, self.max_len, g * d).scatter_(1, at, v.reshape(n, 1, g * d))
        mask = (plan["keys_at"][None, :] <= pos[:, None])[:, None, None, :]  # [n, 1, 1, max_len]
        out = F.scaled_dot_product_attention(q.reshape(n, g, h // g, d), ck.transpose(1, 2),
                                             cv.transpose(1, 2), attn_mask=mask, scale=scale)
        return out.reshape(n, h, d)


def attention_modules(model) -> list[PackedDotProductAttention]:
    return [layer.self_attention.core_attention for layer in model.decoder.layers
            if isinstance(layer.self_attention.core_attention, PackedDotProductAttention)]


@contextlib.contextmanager
def decoding(model, cache: KVCache):
    """Route every packed forward of ``model`` inside the block through ``cache`` (keys/values kept per
    slot, RoPE at the planned positions). Plan each forward with ``cache.prefill``/``cache.decode`` and
    commit it with ``cache.advance``."""
    apply_rope_positions_patch(rope_positions)  # outermost, even over a RoPE patch installed since last time
    mods = attention_modules(model)
    configs = {id(c) for c in [model.config, *(m.config for m in mods)]}
    for m in mods:
        m.kv_cache = cache
    _DECODING.update(dict.fromkeys(configs, cache))
    try:
        yield cache
    finally:
        for m in mods:
            m.kv_cache = None
        for c in configs:
            _DECODING.pop(c, None)


__all__ = ["KVCache", "attention_modules", "decoding", "rope_positions"]

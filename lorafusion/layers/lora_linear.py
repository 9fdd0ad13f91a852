"""Megatron Column/RowParallelLinear carrying any number of LoRA adapters.

Each wrapped linear keeps Megatron's base weight and sharding untouched and adds, for the rows of
adapter ``a`` in the current packed microbatch, ``s_a·dropout_a(X)·A_aᵀ·B_aᵀ`` (DESIGN.md §3):

- column-parallel (linear_qkv, linear_fc1): A [r, in] replicated, B [out/tp, r] sharded like W; dS is
  all-reduced over TP in backward (on :mod:`.tp_overlap`'s path not: dX rides on the base's, dA is partial).
- row-parallel (linear_proj, linear_fc2): A [r, in/tp] sharded like W, B [out, r] replicated; S is
  all-reduced over TP in forward, before B (on :mod:`.tp_overlap`'s path not: Y rides on the base's, dB is
  partial; partial gradients are summed once per step, :mod:`lorafusion.ops.comm`).
- with sequence parallelism the LoRA term follows the base layer's layout: computed on the gathered full
  sequence (column) or on the full sequence and scattered to this rank's shard (row); see
  ``LoRALinear._sequence_parallel_delta``.

Everything a linear is wired with comes at construction, from its layer spec's params
(:func:`lorafusion.models.layer_spec.lora_linear_spec`): its kind (``linear_qkv`` …), its global layer number
and the model's :class:`LoRAContext`; its base precision follows from the config it is built on
(:func:`lorafusion.layers.fp8_base.base_precision_of`). Which rows belong to which adapter comes from that
context (set per microbatch by :func:`lorafusion.layers.inject.lora_batch`). Adapter weights are fp32 (they
are the master weights); compute casts them to the activation dtype.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from megatron.core.utils import get_pg_rank, get_pg_size
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

from lorafusion import ops
from lorafusion.core.lora import LoRASpec
from lorafusion.core.routing import Routing
from lorafusion.core.seeds import mix_seed, name_key
from lorafusion.core.targets import MEGATRON_TARGETS, PEFT_GROUPS
from lorafusion.layers.fp8_base import (
    base_precision_of,
    fp8_base_forward,
    fp8_fused_forward,
    init_fp8_storage,
    is_fp8,
)
from lorafusion.layers.fused_proj import fused_projection_index, ops_b
from lorafusion.layers.sharding import COLUMNS, REPLICATED, ROW_HALVES, ROWS, TPSplit
from lorafusion.layers.tp_overlap import refuse_partial, tp_forward, tp_lora, tp_path
from lorafusion.ops.saved import rebuild_saved
from lorafusion.ops.tp_overlap import gather_rows
from lorafusion.ops.tables import TableCache, seed_tensor


_LIVE_CONTEXTS: weakref.WeakSet = weakref.WeakSet()  # every model's context (for recompute snapshots)

@dataclass(eq=False)
class LoRAContext:
    """Model-wide adapter registry plus the routing of the microbatch being run.

    ``batch_adapters[slot]`` names the adapter of routing slot ``slot``; ``seeds[slot]`` is that
    adapter's dropout seed for this microbatch (each layer mixes in its own key). ``impl`` ("triton" |
    "torch", :mod:`lorafusion.core.impls`) and ``main_gemm`` choose the LoRA compute (None: automatic / the
    kernels' default); ``tables`` keeps the kernels' device tables across the layers and microbatches.

    Per microbatch and set of adapters present in a layer, the first layer that runs builds every
    layer's seeds at once (one host→device copy on CUDA), so a layer call copies nothing.
    """

    specs: dict[str, LoRASpec] = field(default_factory=dict)
    routing: Routing | None = None
    batch_adapters: tuple[str, ...] = ()
    seeds: tuple[int, ...] = ()
    impl: str | None = None
    main_gemm: str | None = None
    tables: TableCache = field(default_factory=TableCache, repr=False)
    layer_keys: dict[str, int] = field(default_factory=dict, repr=False)  # key -> its seed salt
    _local: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        _LIVE_CONTEXTS.add(self)

    def state(self) -> tuple:
        return (self.routing, self.batch_adapters, self.seeds)

    def register_layer(self, key: str) -> None:
        self.layer_keys[key] = name_key(key)

    def set_batch(self, routing: Routing | None, batch_adapters, seeds=None) -> None:
        batch_adapters = tuple(batch_adapters)
        for name in batch_adapters:
            if name not in self.specs:
                raise KeyError(f"routing names adapter {name!r}, which is not on the model "
                               f"(adapters: {sorted(self.specs)})")
        if routing is not None and routing.segments:
            top = max(slot for slot, _, _ in routing.segments)
            if top >= len(batch_adapters):
                raise ValueError(
                    f"routing uses slot {top} but only {len(batch_adapters)} adapters were named")
        self.routing = routing
        self.batch_adapters = batch_adapters
        self.seeds = tuple(seeds) if seeds is not None else tuple(0 for _ in batch_adapters)
        self._local.clear()

    def local_plan(self, present: frozenset[str]):
        """(local routing, local adapter names, local base seeds) restricted to adapters in ``present``."""
        key = present
        if key not in self._local:
            names, remap = [], {}
            for slot, name in enumerate(self.batch_adapters):
                if name in present and name not in remap:
                    remap[slot] = len(names)
                    names.append(name)
            routing = self.routing.restrict(remap)
            if routing is None:
                self._local[key] = None
            else:
                inv = {v: k for k, v in remap.items()}
                self._local[key] = (routing, names, [self.seeds[inv[i]] for i in range(len(names))])
        return self._local[key]

    def local_args(self, present: frozenset[str], training: bool):
        """(local routing, names, scalings, dropout rates — 0 unless ``training``) for the adapters in
        ``present``, or None; once per microbatch, shared by the layers (read-only)."""
        key = ("args", present, training)
        if key not in self._local:
            plan = self.local_plan(present)
            specs = [self.specs[n] for n in plan[1]] if plan is not None else ()
            self._local[key] = plan and (plan[0], tuple(plan[1]), tuple(s.scaling for s in specs),
                                         tuple(s.lora_dropout if training else 0.0 for s in specs))
        return self._local[key]

    def layer_seeds(self, present: frozenset[str], layer_key: str, device) -> tuple[list[int], object]:
        """(this layer's seeds, the same on ``device`` or None off CUDA) for the local plan of ``present``."""
        ck = ("seeds", present, str(device))
        hit = self._local.get(ck)
        if hit is None:
            base = self.local_plan(present)[2]
            keys = list(self.layer_keys)
            rows = [[mix_seed(sd, self.layer_keys[k]) for sd in base] for k in keys]
            dev = seed_tensor(rows, device) if torch.device(device).type == "cuda" else None
            hit = self._local[ck] = {k: (rows[i], None if dev is None else dev[i])
                                     for i, k in enumerate(keys)}
        if layer_key not in hit:  # a layer registered after this microbatch began
            base = self.local_plan(present)[2]
            return [mix_seed(sd, name_key(layer_key)) for sd in base], None
        return hit[layer_key]


def capture_routing() -> dict:
    """The routing state of every live model (for activation recomputation)."""
    return {ctx: ctx.state() for ctx in list(_LIVE_CONTEXTS)}


def restore_routing(state: dict) -> None:
    for ctx, (routing, adapters, seeds) in state.items():
        # routings compare by identity (they may hold row-id arrays), names and seeds by value
        if ctx.routing is not routing or ctx.batch_adapters != adapters or ctx.seeds != seeds:
            ctx.set_batch(routing, adapters, seeds)


def kaiming_uniform_full(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """PEFT's lora_A init (``nn.Linear`` default: kaiming_uniform(a=√5) → U(±1/√fan_in)), drawn for the
    full unsharded shape from a dedicated generator, so every TP layout gets the same values."""
    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).float()


class LoRALinear:
    """A LoRA linear: adapters, routing and forward for the two parallel linears (the first base of
    :class:`LoRAColumnParallelLinear` and :class:`LoRARowParallelLinear`, before the Megatron linear that
    ``super()`` reaches)."""

    s_comm_mode: str = ""  # "column" | "row"

    def __init__(self, *args, lora_kind: str, layer_number: int, lora_context: LoRAContext, **kwargs):
        """Megatron's arguments, plus (from the spec's params) ``lora_kind``: the Megatron name (linear_qkv,
        linear_proj, linear_fc1, linear_fc2); ``layer_number``: the global 1-based decoder layer; and
        ``lora_context``: the model's context, shared by all its LoRA linears."""
        if lora_kind not in MEGATRON_TARGETS:
            raise ValueError(f"lora_kind: expected one of {MEGATRON_TARGETS}, got {lora_kind!r}")
        super().__init__(*args, **kwargs)  # the Megatron parallel linear (next in the MRO)
        # the TP geometry of the group the linear was built on (Megatron's tp_group; fixed for its life)
        self._tp_geometry = (get_pg_size(self.tp_group), get_pg_rank(self.tp_group))
        self.lora_kind = lora_kind
        self.layer_number = layer_number
        self.lora_key = f"{layer_number}.{lora_kind}"  # the layer's name in adapter state and seeds
        self.lora_ctx = lora_context
        lora_context.register_layer(self.lora_key)
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        # fused linears: adapter -> indices (into PEFT_GROUPS[kind]) of its projections, each with its own A/B
        self.lora_proj: dict[str, tuple[int, ...]] = {}
        self._block_index: dict = {}
        self.base_precision = base_precision_of(kwargs["config"], layer_number)
        if self.base_precision == "fp8":
            init_fp8_storage(self)

    # -- geometry ---------------------------------------------------------------------------------------
    def _tp(self) -> tuple[int, int]:
        """(TP world size, TP rank) of the group this linear was built on (cached at construction: its weight
        shards are that group's)."""
        return self._tp_geometry

    def full_in_out(self) -> tuple[int, int]:
        return self.input_size, self.output_size

    # -- adapters ---------------------------------------------------------------------------------------
    def projection_index(self) -> torch.Tensor:
        """The projection of each of this rank's output rows of a fused linear (see
        fused_projection_index)."""
        if "proj" not in self._block_index:
            tp, c = self._tp()[0], self.config
            groups = c.num_query_groups or c.num_attention_heads
            self._block_index["proj"] = fused_projection_index(
                self.lora_kind, self.output_size_per_partition, groups // tp, c.num_attention_heads // groups,
                c.kv_channels)
        return self._block_index["proj"]

    def tp_split(self, tensor: str) -> TPSplit:
        """How ``tensor`` ("weight", "bias", "lora_A", "lora_B", or "lora_B_proj": one projection's B of a
        fused linear) is split across TP ranks (see the subclasses; :mod:`lorafusion.layers.sharding`)."""
        raise NotImplementedError

    def add_lora(self, name: str, spec: LoRASpec, seed: int) -> None:
        if name in self.lora_A:
            raise ValueError(f"adapter name clash: {name!r} is already on {self.lora_key}")
        tp, rank = self._tp()
        fin, fout = self.full_in_out()
        if self.lora_kind in PEFT_GROUPS and len(PEFT_GROUPS[self.lora_kind]) > 1 and not spec.shared_fused_a:
            chosen = tuple(PEFT_GROUPS[self.lora_kind].index(p) for p in spec.projections(self.lora_kind))
            a = torch.cat([kaiming_uniform_full((spec.r, fin), mix_seed(seed, name_key(name), name_key(
                self.lora_key), name_key(PEFT_GROUPS[self.lora_kind][p]))) for p in chosen])
            b = torch.zeros(int(torch.isin(self.projection_index(), torch.tensor(chosen)).sum()), spec.r)
            self.lora_proj[name] = chosen
            split_a, split_b = self.tp_split("lora_A"), self.tp_split("lora_B_proj")
        else:
            split_a, split_b = self.tp_split("lora_A"), self.tp_split("lora_B")
            a_full = kaiming_uniform_full((spec.r, fin),
                                          mix_seed(seed, name_key(name), name_key(self.lora_key)))
            a = split_a.shard(a_full, tp, rank).clone()
            b = torch.zeros(split_b.local_shape((fout, spec.r), tp))
        dev = (self.weight if self.weight is not None else self.weight_fp8).device  # FP8 base: weight is None
        pa, pb = torch.nn.Parameter(a.to(dev)), torch.nn.Parameter(b.to(dev))
        for p, split in ((pa, split_a), (pb, split_b)):
            if split.dim is not None:
                set_tensor_model_parallel_attributes(p, True, split.dim, 1)
        self.lora_A[name] = pa
        self.lora_B[name] = pb

    def remove_lora(self, name: str) -> None:
        del self.lora_A[name]
        del self.lora_B[name]
        self.lora_proj.pop(name, None)

    def _lora_b(self, names) -> list[torch.Tensor]:
        """The adapters' B's as the LoRA ops take them: a fused linear's block B's (:func:`ops_b`)."""
        return ops_b([self.lora_B[n] for n in names], tuple(self.lora_proj.get(n) for n in names),
                     self._block_index, self.projection_index)

    # -- forward ----------------------------------------------------------------------------------------
    def _lora_args(self, x: torch.Tensor):
        """(routing, A list, B list, scalings, dropout ps, seeds, seeds on the device or None) for this
        layer's adapters in the current microbatch, or None when no row of it uses an adapter here."""
        ctx = self.lora_ctx
        if ctx.routing is None or len(self.lora_A) == 0:
            return None
        present = frozenset(self.lora_A.keys())
        if (local := ctx.local_args(present, self.training)) is None:
            return None
        routing, names, scalings, dropouts = local
        seeds, seed_table = ctx.layer_seeds(present, self.lora_key, x.device)
        return (routing, [self.lora_A[n] for n in names], self._lora_b(names), scalings,
                dropouts, seeds, seed_table)

    def _lora_delta(self, x: torch.Tensor, args, partial: bool = False) -> torch.Tensor:
        """The LoRA term; under TP with its collective on S (dS), or, ``partial``, none: this rank's partial
        term (row) / input gradient (column) and replicated factor's gradient (:mod:`lorafusion.ops.comm`)."""
        routing, a, b, scaling, p, seeds, seed_table = args
        tp, rank = self._tp()
        kw = {}
        if tp > 1:
            kw["s_comm"] = None if partial else self.s_comm_mode
            kw["tp_group"] = self.tp_group  # (the group its TP geometry was read from)
            if self.s_comm_mode == "row":
                kw["k_offset"] = rank * x.shape[-1]
                kw["k_total"] = x.shape[-1] * tp
        return ops.multi_lora_delta(x, a, b, scaling, p, seeds, routing, impl=self.lora_ctx.impl,
                                    cache=self.lora_ctx.tables, seed_table=seed_table, **kw)

    def forward(self, input_, *args, **kwargs):
        """Base + LoRA. Without TP and with the fused kernels, one op does both (the low-rank term enters
        the base GEMM); with TP and a frozen bf16 base, :mod:`.tp_overlap` (the base's collectives overlapped
        with ``tp_overlap``, else in line; the LoRA term shares them: one all-gather of a column linear's
        input under SP); otherwise the base layer (Megatron's forward with its TP collectives, or the FP8
        base) plus the LoRA term.

        Of the input, only the LoRA term keeps anything for backward (X for dA: the frozen base saves its
        weight alone — Megatron's ``LinearWithFrozenWeight``, the FP8 base, the TP path's base). When the
        input's producer marked it rebuildable (the SwiGLU output, an RMSNorm output) it is kept as that
        recipe and rebuilt in backward (:func:`lorafusion.ops.saved.rebuild_saved`)."""
        largs = self._lora_args(input_)
        if (nano := tp_path(self, args, kwargs)) is not None:  # TP: base + LoRA share collectives
            with rebuild_saved(input_):
                return tp_forward(self, input_, largs, nano, _saved_as_shard)
        if largs is None:
            return self._base_forward(input_, *args, **kwargs)
        with rebuild_saved(input_):
            return self._lora_forward(input_, largs, *args, **kwargs)

    def _lora_forward(self, input_, largs, *args, **kwargs):
        one_op = (self._tp()[0] == 1 and not args and not kwargs
                  and ops.resolve_impl(input_, self.lora_ctx.impl) == "triton")
        if one_op and is_fp8(self):  # the FP8 base GEMM with the LoRA term added into its output in place
            return fp8_fused_forward(self, input_, largs)
        if is_fp8(self) and self._tp()[0] > 1 and not args and not kwargs:  # LoRA on the base's collectives
            return fp8_base_forward(self, input_, tp_lora(self, input_, largs, _saved_as_shard))
        refuse_partial(self)
        if self.weight is not None and one_op:
            routing, a, b, scaling, p, seeds, seed_table = largs
            bias = None if self.skip_bias_add or self.bias is None else self.bias
            ctx = self.lora_ctx
            y = ops.multi_lora_linear(input_, self.weight, bias, a, b, scaling, p, seeds, routing,
                                      impl="triton", cache=ctx.tables, seed_table=seed_table,
                                      main_gemm=ctx.main_gemm)
            return y, (self.bias if self.skip_bias_add else None)
        out, bias = self._base_forward(input_, *args, **kwargs)
        if self.sequence_parallel:
            return out + self._sequence_parallel_delta(input_, largs), bias
        return out + self._lora_delta(input_, largs), bias

    def _base_forward(self, input_, *args, **kwargs):
        """The frozen base layer alone: Megatron's forward, or the FP8 one when the base is quantized
        (``model.base_precision: fp8``, :mod:`lorafusion.layers.fp8_base`)."""
        if is_fp8(self):
            return fp8_base_forward(self, input_)
        return super().forward(input_, *args, **kwargs)

    def _sequence_parallel_delta(self, input_: torch.Tensor, largs) -> torch.Tensor:
        """The LoRA term under Megatron's sequence parallelism, in the base output's layout.

        The routing (segments, row ids, hence the dropout masks) describes the full sequence, so the LoRA
        math runs on the full sequence exactly as without SP:

        - column-parallel: the input is this rank's sequence shard; all-gather it (as the base does) and
          compute the [s, out/tp] delta. Backward only *splits* the input gradient
          (``tensor_parallel_output_grad=False``): the LoRA branch's dX = D ⊙ (dS·A)/(1-p) is already the
          full, identical gradient on every rank, because dS is all-reduced over TP (``s_comm="column"``)
          and A is replicated. (The base's own path reduce-scatters its partial dX as usual.) A
          reduce-scatter here would count it tp times; the SP equality test catches that.
        - row-parallel: the input is full-sequence (in-dim sharded); S is all-reduced, so the full [s, out]
          delta is identical on every rank; hand back this rank's sequence shard, matching the base's
          reduce-scattered output. Backward all-gathers dY, so dB = s·dYᵀ·S and dS see every row.
        """
        if self.s_comm_mode == "column":
            full = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False)
            with _saved_as_shard(full, input_, self.tp_group, self._tp()[0]):
                return self._lora_delta(full, largs)
        return scatter_to_sequence_parallel_region(self._lora_delta(input_, largs))


def _saved_as_shard(full: torch.Tensor, shard: torch.Tensor, group, tp: int):
    """The saved-tensor hooks of the column-parallel LoRA term under SP: what the LoRA op saves of the
    all-gathered input ``full`` (x, its 2-D view, the CPU reference's segment slices) is kept as this rank's
    ``shard`` — or, when the shard is a norm's output, as the norm's recipe: nothing — and all-gathered again
    in backward, as Megatron's SP linears do with their input (:func:`lorafusion.ops.saved.rebuild_saved`;
    backward runs the same layers in the same order on every TP rank, so the gathers pair up)."""
    return rebuild_saved(shard, full, lambda t: gather_rows(t, group, tp),
                         lambda t: gather_rows(t, group, tp, async_op=True))


class LoRAColumnParallelLinear(LoRALinear, ColumnParallelLinear):
    """Column-parallel: W, its bias and LoRA B split by rows (out-features; linear_fc1's [gate; up] halves
    each split on their own), A replicated; a fused linear's per-projection B by its own rows."""

    s_comm_mode = "column"

    def tp_split(self, tensor: str) -> TPSplit:
        rows = ROW_HALVES if self.lora_kind == "linear_fc1" else ROWS
        return {"weight": rows, "bias": rows, "lora_A": REPLICATED, "lora_B": rows,
                "lora_B_proj": ROWS}[tensor]


class LoRARowParallelLinear(LoRALinear, RowParallelLinear):
    """Row-parallel: W and LoRA A split by columns (in-features), the bias and LoRA B replicated."""

    s_comm_mode = "row"

    def tp_split(self, tensor: str) -> TPSplit:
        return {"weight": COLUMNS, "bias": REPLICATED, "lora_A": COLUMNS, "lora_B": REPLICATED}[tensor]

"""The pipeline stage cost model: each pipeline rank's work per microbatch in decoder-layer units (one bf16
decoder layer's forward + backward = 1), fitted to the per-rank busy time of pipeline runs on GPUs.

    rank work = its decoder layers, each 1 (bf16) or ``fp8_layer`` (an FP8 base's layer)
              + ``recompute`` x each recomputed layer's own cost (recompute repeats that layer's forward)
              + ``first_rank`` on the rank holding the first layer (the embedding lookup: measured below 0)
              + ``loss_layers(arch)`` on the rank holding the last layer (the output layer and the loss,
                bf16 whatever the base's precision)

``loss_layers`` is ``loss_flop_factor`` times the FLOP ratio of the output layer to a decoder layer
(:func:`lorafusion.scheduler.stages.flop_loss_layers`), with the factor fitted per model where its pipeline
runs were measured (``loss_flop_factor_by_preset``, matched by shape) and the default otherwise.

The numbers live in ``stage_costs.json`` beside this module with the records and the command that produced
them (``scripts/fit_stage_costs.py --write``): the split / recompute chooser (:mod:`.sizing`), the virtual
stage simulator (:mod:`.virtual`) and the auto split (:mod:`.stages`) read them from there.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from lorafusion.core.arch import PRESETS, ModelArch

__all__ = ["STAGE_COSTS_FILE", "StageCosts", "bf16_leading", "layer_precisions", "load_stage_costs",
           "rank_work", "stage_work"]

STAGE_COSTS_FILE = Path(__file__).with_name("stage_costs.json")
_SHAPE = ("family", "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
          "ffn_hidden_size")


@dataclass(frozen=True)
class StageCosts:
    """The fitted coefficients (defaults: the planner's constants before the fit)."""

    recompute: float = 0.42  # a recomputed layer's forward over its layer's forward + backward
    loss_flop_factor: float = 2.0  # output layer + loss over its FLOP ratio to a decoder layer
    first_rank: float = 0.0  # the first rank's work beyond its layers (embedding), in layers
    fp8_layer: float = 1.0  # an FP8 base's decoder layer over a bf16 one (forward + backward)
    loss_flop_factor_by_preset: dict = field(default_factory=dict)  # preset name -> factor

    def loss_factor(self, arch: ModelArch) -> float:
        """The loss factor fitted for ``arch``'s shape (a preset with measured runs), else the default."""
        key = tuple(getattr(arch, n) for n in _SHAPE)
        for name, factor in self.loss_flop_factor_by_preset.items():
            p = PRESETS.get(name)
            if p is not None and tuple(getattr(p, n) for n in _SHAPE) == key:
                return float(factor)
        return self.loss_flop_factor


def load_stage_costs(path: str | Path | None = None) -> StageCosts:
    """The committed coefficients (``stage_costs.json`` beside this module), or those of ``path``."""
    return _load(str(path or STAGE_COSTS_FILE))


@functools.lru_cache(maxsize=4)
def _load(path: str) -> StageCosts:
    data = json.loads(Path(path).read_text())["coefficients"]
    names = {f.name for f in fields(StageCosts)}
    return StageCosts(**{k: v for k, v in data.items() if k in names})


def bf16_leading(setup) -> int | None:
    """Of a :class:`~.memory.MemorySetup`: None for a base in the model dtype; for a narrower (FP8) base, the
    number of its leading layers kept in the dtype."""
    narrow = setup.base_bytes_per_param is not None and setup.base_bytes_per_param < setup.dtype_bytes
    return setup.bf16_base_layers if narrow else None


def layer_precisions(split: Sequence[int], bf16_leading: int | None) -> list[tuple[int, int]]:
    """Per virtual stage (layer order): (bf16 layers, FP8 layers). ``bf16_leading``: None for a bf16 base,
    else the FP8 base's leading layers kept in bf16."""
    out, before = [], 0
    for n in split:
        bf = n if bf16_leading is None else max(0, min(n, bf16_leading - before))
        out.append((bf, n - bf))
        before += n
    return out


def stage_work(layers: int, recompute: int, bf16: int, costs: StageCosts, first: bool, last: bool,
               loss: float) -> float:
    """One rank's work: ``layers`` decoder layers of which the first ``bf16`` are bf16 and the rest at the
    base's precision (FP8 where ``bf16 < layers``: pass ``bf16 = layers`` for a bf16 base), the first
    ``recompute`` recomputed; ``first`` / ``last``: it holds the model's first / last layer."""
    rc = min(int(recompute), layers)
    rc_bf, f = min(rc, bf16), costs.fp8_layer
    w = bf16 + f * (layers - bf16) + costs.recompute * (rc_bf + f * (rc - rc_bf))
    return w + (costs.first_rank if first else 0.0) + (loss if last else 0.0)


def rank_work(split: Sequence[int], pp: int, recompute: Sequence[int], loss: float, costs: StageCosts,
              bf16_leading: int | None = None) -> list[float]:
    """Each pipeline rank's work in bf16 decoder-layer units: ``split`` decoder layers per virtual stage
    (layer order; virtual stage k on rank k % pp), ``recompute`` recomputed layers per rank (the first of
    its stages' layers), ``loss`` the output layer and loss in layers; ``bf16_leading`` as in
    :func:`layer_precisions`."""
    prec = layer_precisions(split, bf16_leading)
    n = len(split)
    return [stage_work(sum(split[r::pp]), recompute[r], sum(prec[k][0] for k in range(r, n, pp)), costs,
                       r == 0, r == (n - 1) % pp, loss) for r in range(pp)]

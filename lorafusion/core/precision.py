"""The frozen base's precision (``model.base_precision``): names and the facts the memory model needs, without
torch (the FP8 base itself: :mod:`lorafusion.layers.fp8_base`)."""

from __future__ import annotations

BASE_PRECISIONS = ("bf16", "fp8")

# With an FP8 base, the linears of the model's first decoder layers stay in the model dtype. The LoRA
# gradients are most sensitive to the first layer's rounding: on random 4- to 32-layer bases FP8 in layer 1
# alone moved them as much as FP8 in all the others together (the CPU ablation of commit ec89f2c in
# docs/results/fp8-8b-1gpu.json); keeping it costs about one layer's FP8 saving (≈ 0.5% of an 8B step) and
# 1/num_layers of the halved base bytes.
FP8_BF16_LEADING_LAYERS = 1

"""The frozen base of a run: an HF directory (its weights loaded) or a preset (random weights drawn from the
seed). One place for the YAML's dtype names and for the choice between the two (train, export and
generate)."""

from __future__ import annotations

import torch

from lorafusion.core.arch import ModelArch, preset
from lorafusion.models.hf_import import HFCheckpoint, build_model_from_hf
from lorafusion.models.provider import build_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def base_arch(path: str | None, preset_name: str | None):
    """(arch, the HF checkpoint or None): the HF directory's config when ``path`` is given, else the
    preset's."""
    if path:
        ckpt = HFCheckpoint(path)
        return ckpt.arch, ckpt
    return preset(preset_name), None


def build_base(arch: ModelArch, ckpt=None, *, dtype: str, **kw):
    """This rank's stage of the base in ``dtype`` (a YAML dtype name): ``ckpt``'s weights loaded, or (no
    checkpoint) random weights drawn from ``kw['seed']``. ``kw``: the rest of
    :func:`.provider.build_model`."""
    if ckpt is not None:
        return build_model_from_hf(ckpt, params_dtype=DTYPES[dtype], **kw)
    return build_model(arch, params_dtype=DTYPES[dtype], **kw)

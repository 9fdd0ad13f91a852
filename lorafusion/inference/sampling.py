"""A prompt row being decoded (:class:`Request`), and picking and committing the next token of each decoded
row: shared by the dynamic decode loop (:func:`lorafusion.inference.generate.generate_ids`) and the static one
(:mod:`lorafusion.inference.static_decode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    """One prompt row of ``lorafusion generate``, its encoded prompt and the tokens decoded so far."""

    row: dict  # the input row, kept as is
    job: str | None  # adapter, or None for the base
    prompt_ids: list[int]
    where: str  # "FILE:LINE" of the row
    output_ids: list[int] = field(default_factory=list)


def pick_tokens(logits: torch.Tensor, temperature: float, top_p: float, gens: Sequence) -> list[int]:
    """The next token of each row of ``logits`` [n, V]: the argmax at temperature 0, else a sample of the
    tempered distribution cut to its top-p mass, drawn with that row's generator (``gens[i]``)."""
    if temperature == 0:
        return logits.argmax(-1).tolist()
    shifted = logits.double() - logits.double().amax(-1, keepdim=True)
    probs = torch.softmax(shifted / temperature, dim=-1)  # (in float64: a temperature of 1e-320)
    out = []
    for p, g in zip(probs, gens, strict=True):
        if top_p < 1.0:
            sp, idx = p.sort(descending=True)
            keep = (sp.cumsum(0) - sp) < top_p  # the smallest prefix whose mass reaches top_p (top-1 always)
            p = torch.zeros_like(p).scatter_(0, idx[keep], sp[keep])
        out.append(int(torch.multinomial(p, 1, generator=g)))
    return out


def commit_tokens(reqs: Sequence[Request], live: Sequence[int], picked: Sequence[int], eos_id: int,
                  limit: Sequence[int]) -> list[int]:
    """Append each live row's picked token; the rows still live after it (not at eos, not at their limit)."""
    still = []
    for i, tok in zip(live, picked, strict=True):
        reqs[i].output_ids.append(tok)
        if tok != eos_id and len(reqs[i].output_ids) < limit[i]:
            still.append(i)
    return still


__all__ = ["Request", "commit_tokens", "pick_tokens"]

"""One LoRA adapter's hyper-parameters (PEFT names), validated on construction."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from lorafusion.layers.targets import resolve_target_modules

_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")


@dataclass(frozen=True)
class LoRASpec:
    r: int
    lora_alpha: float
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default=("all-linear",))
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"lora.r: expected an integer > 0, got {self.r!r}")
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, int | float) or not self.lora_alpha > 0:
            raise ValueError(f"lora.lora_alpha: expected a number > 0, got {self.lora_alpha!r}")
        if not isinstance(self.lora_dropout, int | float) or not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora.lora_dropout: expected a number in [0, 1), got {self.lora_dropout!r}")
        object.__setattr__(self, "target_modules", resolve_target_modules(self.target_modules))

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def check_adapter_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"adapter name: expected letters, digits, '_' or '-', got {name!r}")
    return name

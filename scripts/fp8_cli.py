"""``lorafusion`` with the FP8 base's bf16 leading layers set (an experiment knob for the device scripts):

    python scripts/fp8_cli.py N train configs/quickstart.yaml model.base_precision=fp8 ...

runs the CLI with :data:`lorafusion.layers.fp8_base.BF16_LEADING_LAYERS` = N in this process (train, and
generate of the same run, must be given the same N)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    from lorafusion.cli import main
    from lorafusion.layers import fp8_base

    fp8_base.BF16_LEADING_LAYERS = int(sys.argv[1])
    sys.exit(main(sys.argv[2:]))

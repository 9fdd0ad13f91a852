"""Write synthetic prompt/response jsonl datasets with lognormal token lengths for throughput runs.

With the byte tokenizer one character is one token, so lengths are exact. Four datasets: short (median
≈300 tokens), medium (≈800), long (≈1,600) and mixed, each capped at --max-len.

    python scripts/make_bench_data.py --out data/bench --rows 2048
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lorafusion.core.lengths import LENGTH_PROFILES as DISTS  # noqa: E402  (median, sigma) per profile
from lorafusion.core.lengths import profile_lengths  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="data/bench")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz      "))
    for name in DISTS:
        lengths = profile_lengths(name, args.rows, rng, args.max_len)
        with (out / f"{name}.jsonl").open("w") as f:
            for n in lengths:
                p = int(n) // 3
                text = "".join(rng.choice(letters, int(n)))
                f.write(json.dumps({"prompt": text[:p], "response": text[p:]}) + "\n")
        print(f"{out / (name + '.jsonl')}: {args.rows} rows, median {int(np.median(lengths))} tokens")


if __name__ == "__main__":
    main()

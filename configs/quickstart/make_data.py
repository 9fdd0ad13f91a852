"""Regenerate the quickstart demo datasets (deterministic; the outputs are committed).

    python configs/quickstart/make_data.py

Three tiny tasks a LoRA on the tiny byte-level base visibly learns, each sample <= ~40 byte tokens:
  data/reverse.jsonl  prompt/response   "reverse kitab=" -> "batik"
  data/upper.jsonl    chat (messages)   user "kitab" -> assistant "KITAB"
  data/add.jsonl      prompt/response   "37+48=" -> "85"
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROWS = 300
HERE = Path(__file__).resolve().parent
LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))


def words(rng: np.random.Generator, n: int) -> list[str]:
    return ["".join(rng.choice(LETTERS, size=int(rng.integers(3, 8)))) for _ in range(n)]


def write(name: str, rows: list[dict]) -> None:
    path = HERE / "data" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(rows)} rows to {path.relative_to(HERE)}")


def main() -> None:
    rng = np.random.default_rng(20261122)
    write("reverse.jsonl", [{"prompt": f"reverse {w}=", "response": w[::-1]} for w in words(rng, ROWS)])
    write("upper.jsonl", [{"messages": [{"role": "user", "content": w},
                                        {"role": "assistant", "content": w.upper()}]}
                          for w in words(rng, ROWS)])
    pairs = rng.integers(0, 100, size=(ROWS, 2))
    write("add.jsonl", [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in pairs.tolist()])


if __name__ == "__main__":
    main()

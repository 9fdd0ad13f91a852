"""Regenerate the quickstart demo datasets (deterministic; the outputs are committed).

    python configs/quickstart/make_data.py

Three tiny tasks that a LoRA on the tiny *random* byte-level base clearly learns within ~60 steps of 8
samples (each sample <= 40 byte tokens). They are chosen so that most response tokens follow from the
previous token or from one prompt token (a random 4-layer, 64-wide base cannot learn to copy or add whole
words in a minute; reversing/uppercasing/adding words plateaus near the uniform loss):

  data/successor.jsonl  prompt/response  "after k=" -> "lmnop"        (the next five letters)
  data/vowel.jsonl      chat (messages)  user "kitab" -> assistant "consonant"  (how the word ends;
                                         half the words end in a vowel)
  data/count.jsonl      prompt/response  "count 4=" -> "1234"
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROWS = 300
HERE = Path(__file__).resolve().parent
LETTERS = "abcdefghijklmnopqrstuvwxyz"
VOWELS = "aeiou"
CONSONANTS = "".join(c for c in LETTERS if c not in VOWELS)


def write(name: str, rows: list[dict]) -> None:
    path = HERE / "data" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(rows)} rows to {path.relative_to(HERE)}")


def successor(rng: np.random.Generator) -> list[dict]:
    rows = []
    for _ in range(ROWS):
        i = int(rng.integers(0, len(LETTERS) - 5))
        rows.append({"prompt": f"after {LETTERS[i]}=", "response": LETTERS[i + 1:i + 6]})
    return rows


def _word(rng: np.random.Generator) -> str:
    return "".join(LETTERS[j] for j in rng.integers(0, 26, size=int(rng.integers(3, 8))))


def shout(rng: np.random.Generator, rows: int = ROWS, avoid: set[str] = frozenset()) -> list[dict]:
    rows_out = []
    while len(rows_out) < rows:
        word = _word(rng)
        if len(rows_out) % 2 == 0:
            word = word.upper()
        if word in avoid:
            continue
        answer = "loud" if word.isupper() else "quiet"
        rows_out.append({"messages": [{"role": "user", "content": word},
                                      {"role": "assistant", "content": answer}]})
    return rows_out


def count(rng: np.random.Generator) -> list[dict]:
    rows = []
    for _ in range(ROWS):
        n = int(rng.integers(1, 10))
        rows.append({"prompt": f"count {n}=", "response": "".join(str(k) for k in range(1, n + 1))})
    return rows


def main() -> None:
    rng = np.random.default_rng(20261122)
    write("successor.jsonl", successor(rng))
    write("vowel.jsonl", vowel(rng))
    write("count.jsonl", count(rng))


if __name__ == "__main__":
    main()

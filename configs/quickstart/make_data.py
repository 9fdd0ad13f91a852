"""Regenerate the quickstart demo datasets and held-out prompts (deterministic; the outputs are committed).

    python configs/quickstart/make_data.py

Three tiny tasks that a LoRA on the tiny *random* byte-level base learns within the demo's 40 steps of 16
samples (each sample <= 40 byte tokens). Each is chosen so that the response follows from one nearby prompt
token and the previous response token, or from the whole prompt at once: a random 4-layer, 64-wide base cannot
learn to copy, reverse or add words in a minute, nor to read one letter a dozen tokens back (a "does the word
end in a vowel" chat job stayed at chance: 20/40):

  data/successor.jsonl  prompt/response  "after k=" -> "lmnop"         (the next five letters)
  data/shout.jsonl      chat (messages)  user "KITAB" -> assistant "loud", user "kitab" -> "quiet"
                                         (every letter of the message says it; half the words in capitals)
  data/countdown.jsonl  prompt/response  "countdown 4=" -> "4321"

heldout.jsonl holds `lorafusion generate` prompts with their expected answers: 40 shout words that are not in
its training file, and every prompt of successor (21) and countdown (9), whose tasks have no others.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROWS = 300
HELD_OUT = 40
HERE = Path(__file__).resolve().parent
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def write(path: Path, rows: list[dict]) -> None:
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


def shout(rng: np.random.Generator, rows: int = ROWS, avoid: frozenset[str] = frozenset()) -> list[dict]:
    out: list[dict] = []
    while len(out) < rows:
        word = "".join(LETTERS[j] for j in rng.integers(0, 26, size=int(rng.integers(3, 8))))
        if len(out) % 2 == 0:
            word = word.upper()
        if word in avoid:
            continue
        out.append({"messages": [{"role": "user", "content": word},
                                 {"role": "assistant", "content": "loud" if word.isupper() else "quiet"}]})
    return out


def countdown(rng: np.random.Generator) -> list[dict]:
    rows = []
    for _ in range(ROWS):
        n = int(rng.integers(1, 10))
        rows.append({"prompt": f"countdown {n}=", "response": "".join(str(k) for k in range(n, 0, -1))})
    return rows


def held_out(shout_rows: list[dict]) -> list[dict]:
    seen = frozenset(r["messages"][0]["content"] for r in shout_rows)
    rows = [{"prompt": f"after {LETTERS[i]}=", "job": "successor", "expected": LETTERS[i + 1:i + 6]}
            for i in range(len(LETTERS) - 5)]
    rows += [{"messages": r["messages"][:1], "job": "shout", "expected": r["messages"][1]["content"]}
             for r in shout(np.random.default_rng(99), HELD_OUT, seen)]
    rows += [{"prompt": f"countdown {n}=", "job": "countdown",
              "expected": "".join(str(k) for k in range(n, 0, -1))} for n in range(1, 10)]
    return rows


def main() -> None:
    rng = np.random.default_rng(20261122)
    shout_rows = shout(rng)
    write(HERE / "data" / "successor.jsonl", successor(rng))
    write(HERE / "data" / "shout.jsonl", shout_rows)
    write(HERE / "data" / "countdown.jsonl", countdown(rng))
    write(HERE / "heldout.jsonl", held_out(shout_rows))


if __name__ == "__main__":
    main()

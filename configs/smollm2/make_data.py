"""Regenerate the SmolLM2 example's datasets and held-out prompts (deterministic; the outputs are committed).

    python configs/smollm2/make_data.py

Three small real-language chat tasks for SmolLM2-135M-Instruct, each answered in one fixed form that the base
model does not use on its own (it answers at length), so exact-match accuracy shows what an adapter learnt:

  data/third_person.jsonl  a first-person sentence about the user rewritten in the third person, in one style:
                           "I walk my dog every morning." -> "The user walks their dog every morning."
  data/json_person.jsonl   a sentence about a person -> one JSON object of a fixed shape:
                           "Maria is 29 years old and lives in Lisbon."
                           -> {"name": "Maria", "age": 29, "city": "Lisbon"}
  data/word_problem.jsonl  a short arithmetic word problem -> the equation that answers it:
                           "Tom has 7 apples and buys 5 more. ..." -> "7 + 5 = 12"

heldout.jsonl holds `lorafusion generate` prompts with their expected answers, 30 a task, none of them in the
training files. Each user message states the task in words, so the base model alone gets a fair try.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROWS = 240
HELD_OUT = 30
HERE = Path(__file__).resolve().parent

# first person -> third person singular, each verb with objects it takes; "my" becomes "their"
VERBS = [
    ("walk", "walks", ["my dog", "to school", "home"]),
    ("wash", "washes", ["the dishes", "my car", "the windows"]),
    ("watch", "watches", ["the news", "a film", "the children"]),
    ("study", "studies", ["French", "maths", "history"]),
    ("carry", "carries", ["my bag", "the shopping", "an umbrella"]),
    ("fix", "fixes", ["my bike", "the fence", "old radios"]),
    ("visit", "visits", ["my parents", "the museum", "my sister"]),
    ("cook", "cooks", ["dinner", "rice", "pasta"]),
    ("clean", "cleans", ["the kitchen", "my room", "the garage"]),
    ("paint", "paints", ["portraits", "the walls", "flowers"]),
    ("read", "reads", ["a book", "the paper", "poems"]),
    ("call", "calls", ["my mother", "my friends", "the office"]),
    ("feed", "feeds", ["my cat", "the birds", "the fish"]),
    ("water", "waters", ["the plants", "the garden", "my roses"]),
    ("teach", "teaches", ["piano", "my nephew", "yoga"]),
    ("miss", "misses", ["the bus", "my old school", "the sea"]),
    ("drive", "drives", ["to work", "a taxi", "my kids to school"]),
    ("buy", "buys", ["fresh bread", "flowers", "coffee"]),
    ("fly", "flies", ["kites", "to Rome", "small planes"]),
    ("play", "plays", ["chess", "the guitar", "tennis"])]
WHEN = ["every morning", "on Sundays", "after work", "twice a week", "in the evening", "before lunch",
        "every day", "at night", "on weekends", "once a month"]

NAMES = ["Maria", "Tom", "Aisha", "Lukas", "Chen", "Sofia", "Omar", "Nina", "Pedro", "Yuki", "Anna", "David",
         "Fatima", "Ivan", "Grace", "Mateo", "Leila", "Jonas", "Priya", "Elena", "Kofi", "Hana", "Sam",
         "Zara"]
CITIES = ["Lisbon", "Paris", "Berlin", "Madrid", "Rome", "Vienna", "Oslo", "Dublin", "Prague", "Athens",
          "Cairo",
          "Tokyo", "Lima", "Nairobi", "Toronto", "Sydney", "Boston", "Warsaw", "Seoul", "Denver"]
PERSON_FORMS = ["{n} is {a} years old and lives in {c}.", "{n} lives in {c} and is {a} years old.",
                "At {a}, {n} lives in {c}.", "{n}, aged {a}, lives in {c}.", "{n} ({a}) is from {c}.",
                "Meet {n}: {a} years old, living in {c}."]

THINGS = ["apples", "stickers", "marbles", "books", "coins", "pencils", "cookies", "stamps", "shells",
          "cards"]
MORE = ["buys {b} more", "finds {b} more", "gets {b} more from a friend", "is given {b} more"]
LESS = ["gives away {b}", "loses {b}", "eats {b}", "sells {b}"]


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(rows)} rows to {path.relative_to(HERE)}")


def chat(user: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def pick(rng: np.random.Generator, items: list):
    return items[int(rng.integers(0, len(items)))]


def third_person(rng: np.random.Generator) -> dict:
    verb, verbs, objects = pick(rng, VERBS)
    obj, when = pick(rng, objects), pick(rng, WHEN)
    said = f"I {verb} {obj} {when}."
    done = f"The user {verbs} {obj.replace('my ', 'their ')} {when}."
    return chat(f"Rewrite in the third person: {said}", done)


def json_person(rng: np.random.Generator) -> dict:
    n, c, a = pick(rng, NAMES), pick(rng, CITIES), int(rng.integers(18, 90))
    text = pick(rng, PERSON_FORMS).format(n=n, a=a, c=c)
    return chat(f"Extract the person as JSON with name, age and city: {text}",
                json.dumps({"name": n, "age": a, "city": c}))


def word_problem(rng: np.random.Generator) -> dict:
    n, thing = pick(rng, NAMES), pick(rng, THINGS)
    a = int(rng.integers(3, 20))
    if rng.random() < 0.5:
        b = int(rng.integers(1, 10))
        act, answer = pick(rng, MORE).format(b=b), f"{a} + {b} = {a + b}"
    else:
        b = int(rng.integers(1, a))
        act, answer = pick(rng, LESS).format(b=b), f"{a} - {b} = {a - b}"
    question = f"{n} has {a} {thing} and {act}. How many {thing} does {n} have now?"
    return chat(f"{question} Answer with the equation.", answer)


TASKS = {"third_person": third_person, "json_person": json_person, "word_problem": word_problem}


def main() -> None:
    rng = np.random.default_rng(20261128)
    held: list[dict] = []
    for name, make in TASKS.items():
        seen: set[str] = set()
        train: list[dict] = []
        while len(train) < ROWS:
            row = make(rng)
            if row["messages"][0]["content"] not in seen:
                seen.add(row["messages"][0]["content"])
                train.append(row)
        tests: list[dict] = []
        while len(tests) < HELD_OUT:
            row = make(rng)
            if row["messages"][0]["content"] not in seen:
                seen.add(row["messages"][0]["content"])
                tests.append({"messages": row["messages"][:1], "job": name,
                              "expected": row["messages"][1]["content"]})
        write(HERE / "data" / f"{name}.jsonl", train)
        held += tests
    write(HERE / "heldout.jsonl", held)


if __name__ == "__main__":
    main()

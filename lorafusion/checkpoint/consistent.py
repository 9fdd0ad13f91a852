"""A run resumes only from checkpoints that agree across its jobs. The jobs checkpointed together at one chunk
boundary (a stop, a timed checkpoint, the end) record in each state.json where all of them stood
(``together``: job -> step). When one of those writes failed part-way (a full disk), the jobs' newest
checkpoints are of different boundaries, and resuming them would pack their data otherwise than an
uninterrupted run: the job ahead falls back to its newest checkpoint that agrees with the others (and says
so), or — none left — the resume is refused unless ``--allow-different-result``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from lorafusion.core.errors import ConfigError

Pick = tuple  # (checkpoint path or None, state or None, tensors or None)


def disagreements(name: str, state: dict | None, steps: dict[str, int]) -> list[tuple[str, int]]:
    """(job, step it had when ``name``'s checkpoint was written with it) for every job now at another step."""
    together = (state or {}).get("together") or {}
    return [(other, s) for other, s in together.items() if other != name and other in steps
            and steps[other] != s]


def consistent_picks(picks: dict[str, Pick], older: Callable[[str, Path], Iterable[Pick]], *, source: str,
                     allow_different_result: bool, log: Callable[[str], None]) -> dict[str, Pick]:
    """``picks`` (job -> its newest usable checkpoint) made consistent: a job whose checkpoint disagrees with
    another's step falls back to the newest of ``older(job, path)`` (its usable checkpoints older than
    ``path``, newest first) that agrees, until all agree."""
    picks = dict(picks)
    for _ in range(len(picks) * 8 + 1):  # (each fallback moves a job back: this ends)
        steps = {n: (st or {}).get("step", 0) for n, (_, st, _) in picks.items()}
        conflict = _first_conflict(picks, steps)
        if conflict is None:
            return picks
        name, why = conflict  # (name: the job ahead, which moves back)
        path = picks[name][0]
        others = {n: s for n, s in steps.items() if n != name}
        fallback = next((c for c in older(name, path) if not disagreements(name, c[1], others)
                         and not any(_names(name, c[1]["step"], picks[o][1]) for o in others)), None)
        if fallback is None:
            if allow_different_result:
                log(f"{why}; --allow-different-result: resumed anyway, its result differs from an "
                    f"uninterrupted run's")
                return picks
            raise ConfigError(f"{source}: {why}, and no older checkpoint of {name!r} agrees: resuming would "
                              "pack the jobs' data otherwise than an uninterrupted run; pass "
                              f"--allow-different-result to resume anyway")
        log(f"{why}: resuming {name!r} from {fallback[0]}, where they agree")
        picks[name] = fallback
    raise ConfigError(f"{source}: the jobs' checkpoints do not agree on one set; pass "
                      "--allow-different-result")


def _first_conflict(picks: dict[str, Pick], steps: dict[str, int]) -> tuple[str, str] | None:
    """(the job that is ahead, why) for the first pair of picked checkpoints that disagree, else None."""
    for name, (path, state, _) in picks.items():
        for other, then in disagreements(name, state, steps) if path is not None else ():
            ahead = name if steps[other] < then else other
            return ahead, (f"job {name!r}: its checkpoint {path} was written together with job {other!r} at "
                           f"step {then}, but {other!r} resumes from step {steps[other]} (a checkpoint of "
                           f"the jobs failed part-way, e.g. a full disk)")
    return None


def _names(name: str, step: int, other_state: dict | None) -> bool:
    """Whether another job's picked checkpoint says ``name`` was at another step than ``step`` when
    written."""
    together = (other_state or {}).get("together") or {}
    return name in together and together[name] != step

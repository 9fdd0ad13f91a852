"""The trainer stays a thin loop: at most 300 lines, and every attribute it keeps is declared in ``__init__``
(what ``_setup`` and ``_open_session`` fill in is named there first, so a reader finds the trainer's state in
one place)."""

import ast
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[2] / "lorafusion" / "runtime" / "trainer.py"


def _assigned(fn: ast.FunctionDef) -> set[str]:
    out = set()
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
        for target in targets:
            out |= {x.attr for x in ast.walk(target) if isinstance(x, ast.Attribute)
                    and isinstance(x.value, ast.Name) and x.value.id == "self"}
    return out


def test_trainer_is_short_and_declares_its_state_in_init():
    source = TRAINER.read_text()
    assert len(source.splitlines()) <= 300
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    methods = [f for f in cls.body if isinstance(f, ast.FunctionDef)]
    declared = _assigned(next(f for f in methods if f.name == "__init__"))
    elsewhere = {f.name: sorted(_assigned(f) - declared) for f in methods if f.name != "__init__"}
    assert {k: v for k, v in elsewhere.items() if v} == {}

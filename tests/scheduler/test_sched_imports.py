"""The scheduler package stays torch-free (DESIGN §1: the scheduler never imports torch models)."""

from __future__ import annotations

import ast
from pathlib import Path

import lorafusion.scheduler as sched

FORBIDDEN = {"torch", "triton", "megatron", "transformer_engine"}


def test_no_torch_imports_in_scheduler_modules():
    root = Path(sched.__file__).parent
    files = sorted(root.glob("*.py"))
    assert len(files) >= 9
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_public_api_is_exported():
    for name in sched.__all__:
        assert hasattr(sched, name), name
    assert "Contract with the runtime" in sched.__doc__

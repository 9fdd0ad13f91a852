"""Imports point down the data flow (DESIGN.md §1), checked on the source of every module:
``core`` imports nothing of ours and no torch at module level; ``config`` and ``scheduler`` import neither
torch nor megatron; ``kernels`` imports only ``core`` of ours; ``data`` never imports ``ops``, ``layers``,
``models`` or ``runtime``; no file of ``lorafusion/`` has more than 450 lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "lorafusion"


def _imports(path: Path, module_level_only: bool = False) -> list[str]:
    """Absolute module names ``path`` imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    package = ["lorafusion", *path.relative_to(PKG).parent.parts]
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                out.append(".".join(base + ([node.module] if node.module else [])))
            else:
                out.append(node.module or "")
    return out


def _files(sub: str) -> list[Path]:
    files = sorted((PKG / sub).rglob("*.py"))
    assert files, sub
    return files


def _ours(name: str) -> str | None:
    """The subpackage of lorafusion a module name belongs to (None when not ours)."""
    parts = name.split(".")
    return (parts[1] if len(parts) > 1 else "") if parts[0] == "lorafusion" else None


def _offences(sub: str, allowed_ours: set[str] | None = None, forbidden_ours: set[str] = frozenset(),
              forbidden_top: set[str] = frozenset(), module_level_top: set[str] = frozenset()) -> list[str]:
    bad = []
    for path in _files(sub):
        rel = path.relative_to(PKG.parent)
        for name in _imports(path):
            pkg = _ours(name)
            if pkg is not None and pkg != sub and (
                    (allowed_ours is not None and pkg not in allowed_ours) or pkg in forbidden_ours):
                bad.append(f"{rel} imports {name}")
            if name.split(".")[0] in forbidden_top:
                bad.append(f"{rel} imports {name}")
        for name in _imports(path, module_level_only=True):
            if name.split(".")[0] in module_level_top:
                bad.append(f"{rel} imports {name} at module level")
    return bad


def test_core_imports_nothing_of_ours_and_no_torch_at_module_level():
    assert _offences("core", allowed_ours=set(), module_level_top={"torch", "megatron", "triton"}) == []


def test_config_and_scheduler_import_neither_torch_nor_megatron():
    for sub in ("config", "scheduler"):
        assert _offences(sub, forbidden_top={"torch", "megatron", "triton"}) == []


def test_kernels_import_only_core():
    assert _offences("kernels", allowed_ours={"core"}) == []


def test_data_never_imports_ops_layers_models_or_runtime():
    assert _offences("data", forbidden_ours={"ops", "layers", "models", "runtime"}) == []


def test_no_file_over_450_lines():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert long == {}


@pytest.mark.parametrize("module", ["lorafusion.core.arch", "lorafusion.core.lora", "lorafusion.config",
                                    "lorafusion.scheduler"])
def test_torch_free_packages_import_without_torch(module):
    out = subprocess.run([sys.executable, "-c", f"import sys, {module}; print(sorted(m for m in ('torch', "
                          f"'megatron', 'triton') if m in sys.modules))"],
                         capture_output=True, text=True, check=True, cwd=PKG.parent)
    assert out.stdout.strip() == "[]"


def test_the_checks_see_violations(tmp_path, monkeypatch):
    """The rules would catch a back-edge (so the tests above can fail)."""
    fake = tmp_path / "lorafusion"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "x.py").write_text("import torch\nfrom lorafusion.ops import routing\nfrom ..data import y\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    assert _offences("core", allowed_ours=set(), module_level_top={"torch"}) == [
        "lorafusion/core/x.py imports lorafusion.ops", "lorafusion/core/x.py imports lorafusion.data",
        "lorafusion/core/x.py imports torch at module level"]

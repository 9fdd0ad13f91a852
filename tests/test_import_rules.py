"""Imports point down the data flow (DESIGN.md §1), checked on the source of every module (imports inside
functions included):

- ``core`` imports nothing of ours and no torch at module level; the top-level ``megatron_patches`` imports
  nothing of lorafusion;
- ``config``, ``scheduler``, ``rundir`` and ``resolve`` import neither torch nor Megatron nor Triton (and
  start without them); ``resolve`` (every ``auto`` made a value) imports only ``config`` and ``scheduler``;
- the model chain ``kernels ← ops ← layers ← models ← runtime ← cli``: each imports only what is below it;
- ``checkpoint``, ``export`` and ``inference`` never import ``runtime`` (nor cli); ``data`` never imports
  ``ops``, ``layers``, ``models`` or ``runtime``;
- every package of ``lorafusion/`` has a rule; no file has more than 400 lines and no function outside
  ``kernels`` more than 60 (an exception would be listed in LONG_FILES / LONG_FUNCTIONS and may only
  shrink; there are none);
- no two modules import each other, directly or round a longer circle: among the modules of ``lorafusion/``
  and ``megatron_patches/`` (a package's ``__init__`` is a module too), and among the scripts of ``scripts/``
  (module-level and function-level imports both).

``test_the_rules_catch_violations`` plants a violation of each rule in a copy of the tree and checks it is
seen.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "lorafusion"
# megatron-core shims: a sibling package that imports nothing of ours
PATCHES = PKG.parent / "megatron_patches"
SCRIPTS = PKG.parent / "scripts"  # tools run with scripts/ on sys.path: they import one another by file name
HEAVY = frozenset({"torch", "megatron", "triton"})
LOW = {"core"}  # the ground floor: may be imported from anywhere
# package -> the packages of ours it may import besides itself and LOW (STRICT ones: exactly those listed)
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "config": {"core"},
    "scheduler": {"core"},
    "resolve": {"config", "scheduler"},
    "rundir": {"core", "config", "data"},  # submit checks a job's data before it answers (torch-free readers)
    "kernels": {"core"},
    "ops": {"kernels"},
    "layers": {"ops"},
    "models": {"ops", "layers"},
    "dist": set(),
    "data": {"config"},
    "checkpoint": {"rundir", "export", "layers", "models", "dist"},
    "export": {"rundir", "layers", "models", "data", "dist", "config"},
    "inference": {"rundir", "export", "checkpoint", "ops", "layers", "models", "data", "dist", "config"},
    "runtime": {"config", "scheduler", "resolve", "rundir", "data", "ops", "layers", "models", "dist",
                "checkpoint", "export", "inference"},
    "cli": {"config", "scheduler", "resolve", "rundir", "data", "models", "dist", "checkpoint", "export",
            "inference", "runtime"},
}
STRICT = {"core": set(), "kernels": {"core"}}  # no LOW for these: exactly what is listed
TORCH_FREE = ("config", "scheduler", "rundir", "resolve")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60
# files and functions longer than the limits today: each may only shrink; new ones are refused
LONG_FILES: dict[str, int] = {}  # (none left)
LONG_FUNCTIONS: dict[str, int] = {}  # (none left)


@functools.lru_cache(maxsize=None)
def _parse(path: Path, stamp: tuple[int, int]) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _tree(path: Path) -> ast.Module:
    st = path.stat()
    return _parse(path, (st.st_mtime_ns, st.st_size))


def _imports(path: Path, module_level_only: bool = False) -> list[str]:
    """Absolute module names ``path`` imports (relative imports resolved against its package;
    ``from lorafusion import ops`` counts as importing ``lorafusion.ops``)."""
    tree = _tree(path)
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    root = PATCHES if path.is_relative_to(PATCHES) else PKG
    package = [root.name, *path.relative_to(root).parent.parts]
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                out.append(".".join(base + ([node.module] if node.module else [])))
            elif node.module == "lorafusion":
                out += [f"lorafusion.{a.name}" for a in node.names]
            else:
                out.append(node.module or "")
    return out


def _package(path: Path) -> str:
    """The package of ours a file belongs to (a top-level module: its name, e.g. ``cli``, ``dist``)."""
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _files(sub: str) -> list[Path]:
    files = sorted((PKG / sub).rglob("*.py")) if (PKG / sub).is_dir() else [PKG / f"{sub}.py"]
    files = [f for f in files if f.is_file()]
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


def _rule(sub: str) -> set[str]:
    return STRICT[sub] if sub in STRICT else ALLOWED[sub] | LOW


def _packages() -> list[str]:
    return sorted({_package(p) for p in PKG.rglob("*.py")} - {"__init__"})


def test_core_imports_nothing_of_ours_and_no_torch_at_module_level():
    assert _offences("core", allowed_ours=set(), module_level_top=HEAVY) == []


def test_config_scheduler_and_resolve_import_neither_torch_nor_megatron():
    for sub in ("config", "scheduler", "resolve"):
        assert _offences(sub, forbidden_top=HEAVY) == []


def test_rundir_imports_neither_torch_nor_megatron():
    assert _offences("rundir", forbidden_top=HEAVY) == []


def test_kernels_import_only_core():
    assert _offences("kernels", allowed_ours={"core"}) == []


def test_megatron_patches_import_nothing_of_ours():
    bad = [f"{path.relative_to(PATCHES.parent)} imports {name}" for path in sorted(PATCHES.rglob("*.py"))
           for name in _imports(path) if name.split(".")[0] == "lorafusion"]
    assert sorted(PATCHES.glob("*.py")) and bad == []


def test_data_never_imports_ops_layers_models_or_runtime():
    assert _offences("data", forbidden_ours={"ops", "layers", "models", "runtime"}) == []


def test_checkpoint_export_inference_never_import_runtime():
    for sub in ("checkpoint", "export", "inference"):
        assert _offences(sub, forbidden_ours={"runtime", "cli"}) == []


@pytest.mark.parametrize("sub", sorted(ALLOWED))
def test_each_package_imports_only_what_is_below_it(sub):
    """The whole chain: ``kernels ← ops ← layers ← models ← runtime ← cli`` and the rooms beside it."""
    assert _offences(sub, allowed_ours=_rule(sub)) == []


def test_every_package_has_a_rule():
    assert [p for p in _packages() if p not in ALLOWED] == []


def test_no_file_over_400_lines():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > LONG_FILES.get(str(p.relative_to(PKG.parent)),
                                                                       MAX_FILE_LINES)}
    assert long == {}


def _long_functions() -> dict[str, int]:
    out = {}
    for path in PKG.rglob("*.py"):
        if _package(path) == "kernels":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out[f"{path.relative_to(PKG.parent)}:{node.name}"] = n
    return out


def test_no_function_over_60_lines_outside_kernels():
    grown = {k: n for k, n in _long_functions().items() if n > LONG_FUNCTIONS.get(k, MAX_FUNCTION_LINES)}
    assert grown == {}


@pytest.mark.parametrize("module", ["lorafusion.core.arch", "lorafusion.core.lora", "lorafusion.config",
                                    "lorafusion.scheduler", "lorafusion.resolve",
                                    "lorafusion.rundir.requests", "lorafusion.rundir.status",
                                    "lorafusion.rundir.adapters", "lorafusion.rundir.atomic",
                                    "lorafusion.rundir.lock"])
def test_torch_free_packages_import_without_torch(module):
    out = subprocess.run([sys.executable, "-c", f"import sys, {module}; print(sorted(m for m in ('torch', "
                          f"'megatron', 'triton') if m in sys.modules))"],
                         capture_output=True, text=True, check=True, cwd=PKG.parent)
    assert out.stdout.strip() == "[]"


def _module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_targets(path: Path, root: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports, at module level or inside a function:
    ``from P import N`` counts as importing the module ``P.N`` when there is one, else ``P`` (its
    ``__init__``)."""
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = package[: len(package) - node.level + 1]
                base = ".".join(here + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # import a.b.c of a module a.b: the module a.b
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of ``graph`` (module -> the modules it imports): Tarjan's strongly connected components of
    more than one module, each sorted (a module importing itself is not counted)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v] - {v}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                cycles.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _package_graph(roots: list[Path]) -> dict[str, set[str]]:
    files = {_module_name(p, r): (p, r) for r in roots for p in sorted(r.rglob("*.py"))}
    return {m: _import_targets(p, r, set(files)) for m, (p, r) in files.items()}


def _scripts_graph() -> dict[str, set[str]]:
    """scripts/ run with scripts/ on sys.path: a script imports another by its file name
    (``import bench_train``)."""
    files = {p.stem: p for p in sorted(SCRIPTS.rglob("*.py"))}
    graph = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                targets |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                targets.add(node.module.split(".")[0])
        graph[name] = targets & set(files)
    return graph


def test_no_import_cycles():
    """No two modules of lorafusion/ or megatron_patches/ import each other, directly or round a longer
    circle."""
    assert _cycles(_package_graph([PKG, PATCHES])) == []


def test_no_import_cycles_in_scripts():
    assert _cycles(_scripts_graph()) == []


def test_the_checks_see_violations(tmp_path, monkeypatch):
    """The rules would catch a back-edge (so the tests above can fail)."""
    fake = tmp_path / "lorafusion"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "x.py").write_text(
        "import torch\nfrom lorafusion.ops import routing\nfrom ..data import y\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    assert _offences("core", allowed_ours=set(), module_level_top={"torch"}) == [
        "lorafusion/core/x.py imports lorafusion.ops", "lorafusion/core/x.py imports lorafusion.data",
        "lorafusion/core/x.py imports torch at module level"]


# one planted violation per rule: (file, source, the test that must fail)
PLANTED = [
    ("ops/bad.py", "from lorafusion.runtime import trainer\n",
     "test_each_package_imports_only_what_is_below_it"),
    ("layers/bad.py", "def f():\n    from lorafusion import models\n",
     "test_each_package_imports_only_what_is_below_it"),
    ("models/bad.py", "from lorafusion.runtime.feed import Feed\n",
     "test_each_package_imports_only_what_is_below_it"),
    ("runtime/bad.py", "import lorafusion.cli\n", "test_each_package_imports_only_what_is_below_it"),
    ("kernels/bad.py", "from lorafusion.ops.tables import TableCache\n", "test_kernels_import_only_core"),
    ("../megatron_patches/bad.py", "from lorafusion.models import provider\n",
     "test_megatron_patches_import_nothing_of_ours"),
    ("rundir/bad.py", "def f():\n    import torch.distributed\n",
     "test_rundir_imports_neither_torch_nor_megatron"),
    ("scheduler/bad.py", "import megatron.core\n",
     "test_config_scheduler_and_resolve_import_neither_torch_nor_megatron"),
    ("resolve.py", "def f():\n    import torch\n",
     "test_config_scheduler_and_resolve_import_neither_torch_nor_megatron"),
    ("resolve.py", "from lorafusion.runtime import trainer\n",
     "test_each_package_imports_only_what_is_below_it"),
    ("export/bad.py", "from ..runtime import trainer\n",
     "test_checkpoint_export_inference_never_import_runtime"),
    ("checkpoint/bad.py", "from lorafusion.runtime.feed import JobState\n",
     "test_checkpoint_export_inference_never_import_runtime"),
    ("data/bad.py", "from lorafusion.layers import inject\n",
     "test_data_never_imports_ops_layers_models_or_runtime"),
    ("core/bad.py", "import torch\n", "test_core_imports_nothing_of_ours_and_no_torch_at_module_level"),
    ("newroom/x.py", "X = 1\n", "test_every_package_has_a_rule"),
    ("ops/long.py", "\n" * 401, "test_no_file_over_400_lines"),
    ("ops/fn.py", "def f():\n" + "    x = 1\n" * 60, "test_no_function_over_60_lines_outside_kernels"),
    # inject -> lora_linear -> fused_proj -> inject (module level)
    ("layers/fused_proj.py", "from lorafusion.layers.inject import lora_modules\n", "test_no_import_cycles"),
    # hf_import imports hf_layout; back inside a function
    ("models/hf_layout.py", "def f():\n    from lorafusion.models.hf_import import HFCheckpoint\n",
     "test_no_import_cycles"),
    # a package's __init__ and one of its modules
    ("ops/reference.py", "from lorafusion.ops import multi_lora_delta\n", "test_no_import_cycles"),
    ("../megatron_patches/cpu.py", "import megatron_patches\n", "test_no_import_cycles"),
    # two scripts importing each other (the second file is planted with the first)
    ("../scripts/planted_a.py", {"../scripts/planted_a.py": "def f():\n    import planted_b\n",
                                 "../scripts/planted_b.py": "from planted_a import f\n"},
     "test_no_import_cycles_in_scripts"),
]


def _run_rule(name: str, sub: str) -> None:
    test = globals()[name]
    test(sub) if name == "test_each_package_imports_only_what_is_below_it" else test()


@pytest.mark.parametrize("planted", PLANTED, ids=[p[0] for p in PLANTED])
def test_the_rules_catch_violations(planted, tmp_path, monkeypatch):
    """A copy of the real tree passes every rule; with one violation planted, its rule fails."""
    import shutil

    fake = tmp_path / "lorafusion"
    shutil.copytree(PKG, fake, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(PATCHES, tmp_path / PATCHES.name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(SCRIPTS, tmp_path / SCRIPTS.name, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    monkeypatch.setattr(sys.modules[__name__], "PATCHES", tmp_path / PATCHES.name)
    monkeypatch.setattr(sys.modules[__name__], "SCRIPTS", tmp_path / SCRIPTS.name)
    rel, source, rule = planted
    sub = rel.split("/")[0].removesuffix(".py")  # (a top-level module: its name)
    _run_rule(rule, sub)  # the copy is clean
    for where, text in (source if isinstance(source, dict) else {rel: source}).items():
        (fake / where).parent.mkdir(parents=True, exist_ok=True)
        (fake / where).write_text(text)
    with pytest.raises(AssertionError):
        _run_rule(rule, sub)


def test_no_test_folder_shadows_a_package():
    """tests/ is on the workers' sys.path: a folder there named like a top-level package (without __init__.py,
    a namespace package) would be imported instead of the package by subprocesses started outside the
    checkout."""
    tests = Path(__file__).resolve().parent
    assert not [p.name for p in tests.iterdir() if p.is_dir() and p.name in {PKG.name, PATCHES.name}]

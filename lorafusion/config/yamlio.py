"""YAML files and the paths written in them: a bounded safe loader (duplicate keys refused, YAML 1.2 floats,
aliases limited), reading one file as one mapping, and turning a path in it into an absolute one that file
operations can use. Every problem is one :class:`ConfigError` naming the file (and the field, from
``where``)."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any

from lorafusion.core.errors import ConfigError

__all__ = ["check_path", "display", "load_bounded", "read_yaml", "resolve_path", "yaml_loader"]


def display(path: Path | str) -> str:
    """``path`` as messages show it: relative to the current directory when under it, else as given."""
    p = Path(path)
    try:
        rel = os.path.relpath(p)
    except ValueError:
        return str(p)
    return str(p) if rel.startswith("..") else rel


class _UniqueKeyLoader:
    """A yaml SafeLoader that rejects duplicate keys in a mapping (built lazily to keep yaml local)."""

    _cls = None

    @classmethod
    def get(cls):
        if cls._cls is None:
            import yaml

            class Loader(yaml.SafeLoader):
                pass

            def construct_mapping(loader, node, deep=False):
                keys = set()
                for key_node, _ in node.value:
                    if (key := loader.construct_object(key_node, deep=deep)) in keys:
                        raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                                                key_node.start_mark)
                    keys.add(key)
                return yaml.SafeLoader.construct_mapping(loader, node, deep)

            Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
            Loader.get_single_node = _bounded_single_node
            # YAML 1.2 floats: PyYAML (YAML 1.1) reads `lr: 1e-4` as the string "1e-4"
            Loader.add_implicit_resolver(
                "tag:yaml.org,2002:float",
                re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                list("-+0123456789"))
            cls._cls = Loader
        return cls._cls


# values a YAML document may expand to through its aliases (a real config has hundreds; nested aliases — the
# "billion laughs" — make a 1 kB file expand to billions, which validation and messages would walk)
_YAML_MAX_VALUES = 100_000


def _bounded_single_node(loader):
    """``SafeLoader.get_single_node``, refusing a document whose aliases expand it past ``_YAML_MAX_VALUES``
    values (counted on the composed graph, each node once: linear in the file)."""
    import yaml

    node = yaml.SafeLoader.get_single_node(loader)
    sizes: dict[int, int] = {}

    def size(n) -> int:  # iterative post-order: a deep file must not hit Python's recursion limit
        stack = [(n, False)]
        while stack:
            cur, done = stack.pop()
            if id(cur) in sizes:
                continue
            kids = [] if isinstance(cur, yaml.ScalarNode) else (
                [x for kv in cur.value for x in kv] if isinstance(cur, yaml.MappingNode) else list(cur.value))
            if done:
                sizes[id(cur)] = min(1 + sum(sizes[id(k)] for k in kids), _YAML_MAX_VALUES + 1)
            else:
                stack.append((cur, True))
                stack.extend((k, False) for k in kids if id(k) not in sizes)
        return sizes[id(n)]

    if node is not None and size(node) > _YAML_MAX_VALUES:
        raise yaml.YAMLError(f"the document expands to more than {_YAML_MAX_VALUES:,} values through its "
                             f"aliases (*name); expected a config without nested aliases")
    return node


def read_yaml(path: Path, what: str) -> dict:
    import yaml

    shown = display(path)
    check_path(path, "")
    if not path.exists():
        raise ConfigError(f"{shown}: file not found (expected {what})")
    if not path.is_file():
        raise ConfigError(f"{shown}: not a file (expected {what})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{shown}: cannot read ({e})") from None
    try:
        data = load_bounded(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        ctx = getattr(e, "context", None)
        raise ConfigError(f"{shown}: {where}invalid YAML: {problem}" + (f" ({ctx})" if ctx else "")) from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise ConfigError(f"{shown}: expected a mapping ({what}) at the top level, got {got}")
    return data



def check_path(p: Path, where: str) -> None:
    """ConfigError for a path no file operation can use: a NUL character, a symlink loop on the way."""
    try:
        os.stat(p)
    except ValueError:
        raise ConfigError(f"{where}{str(p)!r}: expected a path, got one with a NUL character") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(f"{where}{display(p)}: too many levels of symbolic links (a symlink "
                              "loop)") from None


def resolve_path(value: Any, base: Path, where: str = "") -> Any:
    """Absolute form of a path written in a YAML file (``~`` expanded; relative → against ``base``);
    ``where`` ("FILE: FIELD: ") starts the message of a path that cannot be used."""
    if isinstance(value, str) and value:
        try:
            p = Path(value).expanduser()
        except RuntimeError:  # ~user of a user without a home directory
            raise ConfigError(f"{where}{value!r}: cannot expand {value.split('/', 1)[0]!r} (no such user, or "
                              f"no home directory)") from None
        p = p if p.is_absolute() else base / p
        check_path(p, where)
        try:
            return str(p if Path(value).expanduser().is_absolute() else p.resolve())
        except (RuntimeError, OSError):  # a loop that appeared meanwhile
            raise ConfigError(f"{where}{display(p)}: cannot resolve the path (a symlink loop?)") from None
    return value


# nesting of mappings and lists a config may have (a run config is 5 deep; PyYAML's composer recurses: a file
# nested ~800 deep was a RecursionError)
YAML_MAX_DEPTH = 64


def load_bounded(text: str) -> Any:
    """``yaml.load`` with :func:`yaml_loader`; a document nested over ``YAML_MAX_DEPTH`` is a YAMLError."""
    import yaml

    depth = deepest = 0
    for tok in yaml.scan(text, Loader=yaml.SafeLoader):  # (flat: the scanner does not recurse)
        if isinstance(tok, (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken,
                            yaml.FlowMappingStartToken, yaml.FlowSequenceStartToken)):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > YAML_MAX_DEPTH:
                raise yaml.YAMLError(f"nested more than {YAML_MAX_DEPTH} levels deep; expected a config")
        elif isinstance(tok, (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)):
            depth -= 1
    return yaml.load(text, Loader=yaml_loader())


def yaml_loader():
    """The loader every YAML of ours is read with (see the module docstring)."""
    return _UniqueKeyLoader.get()

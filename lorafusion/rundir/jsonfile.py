"""Reading a JSON file that anyone may have put in a run directory (a request, a submitted job, a status):
only a regular file (a FIFO is opened without blocking and refused, so a reader never hangs), of bounded size,
UTF-8, nested to a bounded depth, without non-finite numbers. Anything else is a :class:`ValueError` saying
why (an ``OSError`` when it cannot be opened at all), never a hang, a RecursionError or a crash."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_JSON_BYTES", "loads_bounded", "read_json_file"]

MAX_JSON_BYTES = 4 << 20  # a request or record is a few kB
MAX_DEPTH = 32  # nesting of objects and arrays (a job is 3 deep)

_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR:
          "a character device", stat.S_IFBLK: "a block device"}


def read_json_file(path: Path | str, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_DEPTH,
                   nonfinite_as_none: bool = False) -> Any:
    """The JSON value in file ``path`` (see the module doc; ``nonfinite_as_none``: NaN, Infinity and numbers
    beyond a float read as None, unknown, instead of an error)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"not a regular file ({_KINDS.get(stat.S_IFMT(st.st_mode), 'a special file')})")
        if st.st_size > max_bytes:
            raise ValueError(f"{st.st_size:,} bytes, over the {max_bytes:,} a JSON record may have")
        data = b""
        while len(data) <= max_bytes and (part := os.read(fd, max_bytes + 1 - len(data))):
            data += part
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ValueError(f"over the {max_bytes:,} bytes a JSON record may have")
    return loads_bounded(data, max_depth=max_depth, nonfinite_as_none=nonfinite_as_none)


def loads_bounded(data: bytes | str, *, max_depth: int = MAX_DEPTH, nonfinite_as_none: bool = False) -> Any:
    """``json.loads`` of UTF-8 ``data`` refusing non-finite numbers and nesting over ``max_depth``
    (ValueError)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start})") from None
    if _bracket_depth(text) > max_depth:
        raise ValueError(f"nested more than {max_depth} levels deep")
    if nonfinite_as_none:
        return json.loads(text, parse_constant=lambda _: None, parse_float=lambda s: _finite(s, None))
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(s: str, *default) -> float | None:
    if not math.isfinite(v := float(s)):
        if default:
            return default[0]
        raise ValueError(f"{s[:40]} is out of the range of a float")
    return v


def _bracket_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` outside strings (before parsing: the parser itself recurses)."""
    if (n := text.count("[") + text.count("{")) < 8:  # (a shallow record: no scan)
        return n
    deepest = depth = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest

"""Complete-or-absent files: every file and directory lorafusion writes goes through here. A new file or
directory is written under a temporary sibling name (``.NAME.tmp...``, which :func:`remove_partial_outputs`
clears after a failed run) and renamed into place: a reader sees the old one or the new one, never a part."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path


def _tmp_sibling(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"


def write_text_atomic(path: Path, text: str, *, mkdir: bool = False) -> None:
    """Write ``text`` (UTF-8) to a temporary sibling, then rename it over ``path``; the temporary file is removed
    if the write fails. ``mkdir``: create ``path``'s directory first."""
    path = Path(path)
    if mkdir:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (not atomic: into a temporary directory or under a part name); an OSError (full
    disk, ``ulimit -f``: EFBIG) names the file."""
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def fill_dir_atomically(out_dir: str | Path, fill: Callable[[Path], None], *, replace: bool = True) -> Path:
    """``fill(tmp_dir)`` writes into a temporary sibling directory, which is then renamed to ``out_dir``;
    an existing ``out_dir`` is replaced only after the new one is complete, and only with ``replace`` (without:
    one written meanwhile, e.g. by a second export to the same path, is a :class:`ConfigError`)."""
    from lorafusion.core.errors import ConfigError

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(out)
    tmp.mkdir()
    taken = ConfigError(f"{out}: written meanwhile by another process (a second export to the same path?); "
                        f"left as it is")
    try:
        fill(tmp)
        old = None
        if out.exists() or out.is_symlink():
            if not replace:
                raise taken
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
        try:
            os.replace(tmp, out)
        except OSError as e:  # a non-empty directory appeared at out since the check above
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise taken from None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_dir_atomically(out_dir: str | Path, files: dict[str, Callable[[Path], None]]) -> Path:
    """Write ``files`` ({filename: writer(path)}) into a temporary sibling directory, then rename it to
    ``out_dir``; an existing ``out_dir`` is replaced only after the new one is complete."""
    def fill(tmp: Path) -> None:
        for fname, writer in files.items():
            writer(tmp / fname)

    return fill_dir_atomically(out_dir, fill)


def copier(src: str | Path) -> Callable[[Path], None]:
    """A ``fill`` for :func:`fill_dir_atomically`: the files of directory ``src`` (an adapter) copied in."""
    files = [p for p in Path(src).iterdir() if p.is_file()]

    def fill(tmp: Path) -> None:
        for p in files:
            shutil.copyfile(p, tmp / p.name)

    return fill


def check_writable_dir(path: Path, what: str) -> None:
    """One :class:`ConfigError` naming ``what`` (e.g. ``--out``) unless directory ``path`` exists or can be created
    and a file can be created in it (``/proc/self/x``, a path under a file, a read-only disk), before any work."""
    from lorafusion.core.errors import ConfigError

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".lorafusion-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{what}: cannot write in {path} ({e.strerror or e})") from None


def remove_partial_outputs(out: Path) -> None:
    """Remove temporary files a failed run left behind (never complete checkpoints or exports)."""
    if not out.exists():
        return
    for p in list(out.rglob(".*.tmp*")):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes (1 MiB reads): what a checkpoint's manifest and a run's dataset record hold."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()

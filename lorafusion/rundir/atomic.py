"""Complete-or-absent files: every file and directory lorafusion writes goes through here. A new file or
directory is written under a temporary sibling name (``.NAME.tmp...``, which :func:`remove_partial_outputs`
clears after a failed run) and renamed into place: a reader sees the old one or the new one, never a part."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import os
import re
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path


def _tmp_sibling(path: Path) -> Path:  # (the writer's pid: one left by a killed writer is known as such)
    return path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def write_text_atomic(path: Path, text: str, *, mkdir: bool = False, replace: bool = True) -> None:
    """Write ``text`` (UTF-8) to a temporary sibling, then rename it over ``path``; the temporary file is
    removed if the write fails (an OSError names the file). ``mkdir``: create ``path``'s directory first.
    Without ``replace`` a ``path`` that exists by then (written meanwhile by another process) is a
    ConfigError, left as it is."""
    from lorafusion.core.errors import ConfigError

    path = Path(path)
    if mkdir:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    try:
        write_bytes(tmp, text.encode("utf-8"))
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # (atomic and never over an existing file)
            except FileExistsError:
                raise ConfigError(f"{path}: written meanwhile by another process (a second writer of the "
                                  f"same path?); left as it is") from None
            tmp.unlink()
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename == str(tmp):  # (a full disk: the file being written is path)
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (not atomic: into a temporary directory or under a part name); an OSError
    (full disk, ``ulimit -f``: EFBIG) names the file."""
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def fill_dir_atomically(out_dir: str | Path, fill: Callable[[Path], None], *, replace: bool = True) -> Path:
    """``fill(tmp_dir)`` writes into a temporary sibling directory, which is then renamed to ``out_dir``;
    an existing ``out_dir`` is replaced only after the new one is complete, and only with ``replace``
    (without: one written meanwhile, e.g. by a second export to the same path, is a :class:`ConfigError`). One
    writer of ``out`` at a time (:func:`exclusive_out`); what a killed one left beside it is removed first."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_out(out):
        _drop_leftovers(out)
        return _fill(out, fill, replace)


def _fill(out: Path, fill: Callable[[Path], None], replace: bool) -> Path:
    from lorafusion.core.errors import ConfigError

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


def _drop_leftovers(out: Path) -> None:
    """Temporary siblings of ``out`` that a killed writer left (its pid is gone; held by
    :func:`exclusive_out`, so no live writer of ``out`` is at work): a SIGKILL during a 16 GB export left them
    forever."""
    for p in out.parent.glob(f".{glob.escape(out.name)}.*"):
        m = re.fullmatch(r"\.(?:tmp-(\d+)-[0-9a-f]{8}|old-[0-9a-f]{8})", p.name[len(out.name) + 1:])
        if m and not (m.group(1) and _alive(int(m.group(1)))) and (m.group(1) or out.exists()):  # (an .old
            # one without out: the writer died between its two renames; it is the only copy, kept)
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() \
                else p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process)
        return True
    return True


@contextlib.contextmanager
def exclusive_out(out: Path, what: str = "--out"):
    """Held while ``out`` is written (an export, a generate output): a second process writing the same path at
    the same time fails at once, so two writers never both report success. While held in the main thread, a
    stop (SIGTERM, SIGHUP) ends the write through Python — its temporary files are removed — instead of
    killing the process where it stands."""
    from lorafusion.core.errors import ConfigError

    out = Path(out)
    lock = out.parent / f".{out.name}.tmp-lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"{out}: {what} is being written by another process right now (a second export "
                              f"or generate to the same path?); run one at a time") from None
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break  # (else the holder before removed it between our open and lock: take the new one)
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        with _stops_raise():
            yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


@contextlib.contextmanager
def _stops_raise():
    """SIGTERM and SIGHUP raise SystemExit (exit status 128 + signal) while inside, where they would otherwise
    kill the process at once: only in the main thread, and only over the default action (a run's own handlers
    stay)."""
    sigs = [s for s in (signal.SIGTERM, signal.SIGHUP)
            if threading.current_thread() is threading.main_thread()
            and signal.getsignal(s) == signal.SIG_DFL]

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    for s in sigs:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s in sigs:
            signal.signal(s, signal.SIG_DFL)


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
    """One :class:`ConfigError` naming ``what`` (e.g. ``--out``) unless directory ``path`` exists or can be
    created and a file can be created in it (``/proc/self/x``, a path under a file, a read-only disk), before
    any work."""
    from lorafusion.core.errors import ConfigError

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".lorafusion-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{what}: cannot write in {path} "
                          f"({blocker(Path(path)) or e.strerror or e})") from None


def blocker(path: Path) -> str | None:
    """Why directory ``path`` cannot be created where a mkdir says only "File exists": the first name on its
    way that is a dangling symlink or not a directory (None when there is none)."""
    for p in (path, *path.parents):
        if p.is_symlink() and not p.exists():
            return f"{p} is a symlink to {os.readlink(p)}, which does not exist"
        if p.exists():
            return None if p.is_dir() else f"{p} is not a directory"
    return None


def remove_partial_outputs(out: Path) -> None:
    """Remove temporary files a failed run left behind (never complete checkpoints or exports)."""
    if not out.exists():
        return
    for p in list(out.rglob(".*.tmp*")):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes (1 MiB reads): what a checkpoint's manifest and a run's dataset record
    hold."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()

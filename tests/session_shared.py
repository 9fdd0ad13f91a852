"""For the multi-process tests: one expensive artefact per test session, shared by the xdist workers
(pytest-xdist's recipe for a session fixture that runs once: the first worker that asks builds it under a file
lock, the others wait for it and reuse it), and a launch of two ranks."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def shared_dir(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """``build(dir)`` fills a fresh directory once per session; returns it. (A build that raised leaves no
    directory behind: the next worker that asks builds it again, and fails the same way.)"""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        d = tmp_path_factory.mktemp(name)
        build(d)
        return d
    root = tmp_path_factory.getbasetemp().parent  # this session's directory, the same for every worker
    d = root / name
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (root / f"{name}.done").exists():
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
            try:
                build(d)
            except BaseException:
                shutil.rmtree(d, ignore_errors=True)
                raise
            (root / f"{name}.done").touch()
    return d


def launch_two_ranks(argv: list[str], logs: list[Path], *, cwd: Path | None = None, timeout: float = 600,
                     env: dict | None = None) -> list[int]:
    """``argv`` as ranks 0 and 1 of a two-process gloo world (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT;
    one thread each), each writing to ``logs[rank]``; waits for both and returns their exit statuses. A rank
    that failed leaves its peer waiting for it in a collective: the peer is ended 10 s later (both at
    ``timeout``)."""
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(2):
        with logs[rank].open("w") as f:
            procs.append(subprocess.Popen(argv, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=dict(
                env if env is not None else os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")))
    deadline, failed_at = time.monotonic() + timeout, None
    while None in (codes := [p.poll() for p in procs]):
        if failed_at is None and any(codes):
            failed_at = time.monotonic()
        if time.monotonic() > deadline or (failed_at is not None and time.monotonic() > failed_at + 10):
            for p in procs:
                p.kill()
            break
        time.sleep(0.05)
    return [p.wait() for p in procs]


def launch_in_turn(argv: list[str], items: list[str], logdir: Path, *, cwd: Path | None = None,
                   timeout: float = 600, env: dict | None = None) -> None:
    """Two ranks (:func:`launch_two_ranks`) of ``argv + items``: a program that works through ``items`` in
    order, printing ``=== ITEM`` before and ``=== ITEM done`` after each, and exiting with an error at the
    first one that fails. A launch that ends before every item is done gives up the item it ended in and
    starts again with the items after it: one failure costs the other items nothing. Each rank's output over
    all launches, with a line ``=== ITEM not done: exit status [..]`` for each item given up, goes to
    ``logdir/rank{0,1}.log``."""
    logs, todo, attempt = ["", ""], list(items), 0
    while todo:
        paths = [logdir / f"rank{rank}.{attempt}.log" for rank in range(2)]
        codes = launch_two_ranks(argv + todo, paths, cwd=cwd, timeout=timeout, env=env)
        text = [p.read_text() for p in paths]
        n = 0
        while n < len(todo) and all(f"=== {todo[n]} done\n" in t for t in text):
            n += 1
        if n < len(todo):
            text = [t + f"\n=== {todo[n]} not done: exit status {codes}\n" for t in text]
            n += 1
        logs = [a + b for a, b in zip(logs, text)]
        todo, attempt = todo[n:], attempt + 1
    for rank in range(2):
        (logdir / f"rank{rank}.log").write_text(logs[rank])

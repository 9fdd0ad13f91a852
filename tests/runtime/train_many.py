"""``python tests/runtime/train_many.py SPEC.json NAME...``: one rank of a two-process launch that trains the
named runs one after another in this one process, each through ``lorafusion train`` (the CLI's ``main``).
SPEC: a list of ``{"name", "run", "guard"}``; ``guard``: tests/runtime/sync_guard.py's check is on for that
run.

Each run rendezvouses on a port of its own (MASTER_PORT; the CLI destroys its process group at the end of a
run): rank 0 picks a free one just before the run and hands it to rank 1 through a store that lives as long as
the launch, on the launch's MASTER_PORT (ports picked in advance could be taken meanwhile, by gloo's own
sockets).

Starting a process pair (importing torch and Megatron) costs more than a tiny run, so the two-process tests
share one launch (tests/runtime/conftest.py, fixture ``two_process``). Prints ``=== NAME`` before and
``=== NAME done`` after each run; the first run that fails ends the launch with exit status 1 (its peer may be
waiting for it; the fixture starts the runs after it in a new launch)."""

import json
import os
import socket
import sys
import traceback
from datetime import timedelta

import p2p_guard
import sync_guard  # the guard is installed on import; each run turns it on or off
from torch.distributed import TCPStore

from lorafusion.cli import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    spec = {run["name"]: run for run in json.loads(open(sys.argv[1]).read())}
    rank = int(os.environ["RANK"])
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, rank == 0,
                     timeout=timedelta(minutes=10))
    for name in sys.argv[2:]:
        run = spec[name]
        print(f"=== {name}", flush=True)
        if rank == 0:
            store.set(f"port/{name}", str(_free_port()))
        os.environ["MASTER_PORT"] = store.get(f"port/{name}").decode()
        sync_guard.enabled = p2p_guard.enabled = run["guard"]
        try:
            rc = main(["train", run["run"]])
        except BaseException:
            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        if rc != 0:
            print(f"=== {name} failed: exit status {rc}", flush=True)
            sys.exit(1)
        print(f"=== {name} done", flush=True)

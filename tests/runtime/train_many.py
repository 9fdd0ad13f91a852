"""``python tests/runtime/train_many.py SPEC.json``: one rank of a multi-process launch that trains several runs
one after another in this one process, each through ``lorafusion train`` (the CLI's ``main``), each with its own
rendezvous port (MASTER_PORT; the CLI destroys its process group at the end of a run). SPEC: a list of
``{"name", "run", "port", "guard"}``; ``guard``: tests/runtime/sync_guard.py's check is on for that run.

Starting a process pair (importing torch and Megatron) costs more than a tiny run, so the two-process tests share
one launch (tests/runtime/conftest.py, fixture ``two_process``). Prints ``=== NAME`` before and ``=== NAME done``
after each run; the first run that fails ends the launch with exit status 1 (its peer may be waiting for it)."""

import json
import os
import sys
import traceback

import sync_guard  # the guard is installed on import; off unless a run asks for it

from lorafusion.cli import main

if __name__ == "__main__":
    for run in json.loads(open(sys.argv[1]).read()):
        print(f"=== {run['name']}", flush=True)
        os.environ["MASTER_PORT"] = str(run["port"])
        sync_guard.enabled = run["guard"]
        try:
            rc = main(["train", run["run"]])
        except BaseException:
            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        if rc != 0:
            print(f"=== {run['name']} failed: exit status {rc}", flush=True)
            sys.exit(1)
        print(f"=== {run['name']} done", flush=True)

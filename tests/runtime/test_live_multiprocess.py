"""Online jobs beside a running run: the request commands (``submit``, ``cancel``, ``status``) are processes of
their own that start while the run's processes keep the machine busy."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from runtime_utils import job_dict, write_dataset

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # torchrun sets its own
        env.pop(k, None)
    return env


def test_request_commands_start_without_torch(tmp_path):
    """``submit``, ``cancel`` and ``status`` run beside a busy training run: they import neither torch nor
    megatron (seconds of CPU each on a loaded machine)."""
    code = ("import sys; from lorafusion.cli import main\n"
            "for argv in (['status', sys.argv[1], '--json'], ['cancel', sys.argv[1], '--job', 'x'],\n"
            "             ['submit', sys.argv[1], sys.argv[2]]):\n"
            "    main(argv)\n"
            "print(sorted(m for m in ('torch', 'megatron', 'numpy') if m in sys.modules))")
    run = tmp_path / "run"
    run.mkdir()
    (run / "status.json").write_text(json.dumps({"run": {"state": "done", "elapsed_s": 1.0, "tokens_per_s": 0.0,
                                                         "updated": "-"}, "jobs": {"x": {}}}))
    job = job_dict("y", write_dataset(tmp_path / "y.jsonl", 1), r=4)
    (tmp_path / "y.yaml").write_text(yaml.safe_dump(job))
    p = subprocess.run([sys.executable, "-c", code, str(run), str(tmp_path / "y.yaml")], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout
    assert len(list((run / "requests").glob("*.json"))) == 2

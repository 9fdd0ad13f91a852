"""Multi-node launch path: ``slurm/train.sbatch`` itself, run on this machine as two "nodes".

``srun`` and ``scontrol`` are replaced by shims on PATH: ``scontrol show hostnames`` names 127.0.0.1 and
``srun`` starts its command once per node (two torchrun agents, ``--nnodes 2``, c10d rendezvous on
127.0.0.1, one CPU/gloo process each). The run (``dp: auto`` → 2) must finish on both agents with the same
metrics and adapters as a 2-process single-node torchrun of the same YAML.
"""

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from runtime_utils import assert_close, job_dict, load_adapter, write_dataset, write_run

ROOT = Path(__file__).resolve().parents[2]

SRUN = """#!/usr/bin/env bash
# srun shim: drop srun's own options, start the command once per node (SLURM_JOB_NUM_NODES), wait for all
while [[ "${1:-}" == -* ]]; do shift; done
pids=()
for ((n = 0; n < SLURM_JOB_NUM_NODES; n++)); do
  SLURM_NODEID=$n SLURM_PROCID=$n "$@" > "$SHIM_LOG_DIR/node$n.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""

SCONTROL = """#!/usr/bin/env bash
# scontrol shim: every node of the job is this machine. One write: the sbatch reads the first line through
# `| head -n 1` under pipefail, and a second write after head has exited would die of SIGPIPE (exit 141)
if [[ "$1 $2" == "show hostnames" ]]; then printf '127.0.0.1\n127.0.0.1\n'; exit 0; fi
exit 0
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shim(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _metrics(out: Path):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda r: (r["job"], r["step"]))


@pytest.mark.slow
def test_sbatch_command_on_two_nodes_equals_single_node_two_processes(tmp_path):
    jobs = [job_dict("rev", write_dataset(tmp_path / "d" / "rev.jsonl", 1), r=4, dropout=0.1, steps=3),
            job_dict("up", write_dataset(tmp_path / "d" / "up.jsonl", 2, kind="upper"), r=8, gbs=3, steps=3,
                     targets=["q_proj", "k_proj", "v_proj", "o_proj"])]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _shim(bin_dir / "srun", SRUN)
    _shim(bin_dir / "scontrol", SCONTROL)
    base_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        base_env.pop(k, None)

    def run_yaml(out):
        path = write_run(tmp_path, jobs, out=out, name=f"{out}.yaml")
        text = path.read_text().replace("dp: 1", "dp: auto")
        assert "dp: auto" in text
        path.write_text(text)
        return path

    # two nodes through the sbatch script
    multi = run_yaml("multi")
    env = dict(base_env, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable,
               SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node[0-1]",
               SLURM_JOB_ID="4242", GPUS_PER_NODE="1", MASTER_PORT=str(_free_port()),
               SHIM_LOG_DIR=str(tmp_path))
    single = run_yaml("single")
    single_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                  "-m", "lorafusion.cli", "train", str(single)]
    p_multi = subprocess.Popen(["bash", str(ROOT / "slurm" / "train.sbatch"), str(multi)], cwd=tmp_path,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    p_single = subprocess.Popen(single_cmd, cwd=ROOT, env=base_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    out_multi = p_multi.communicate(timeout=300)[0]
    out_single = p_single.communicate(timeout=300)[0]
    logs = "\n".join(f"--- node{n}\n" + (tmp_path / f"node{n}.log").read_text()[-3000:]
                     for n in range(2) if (tmp_path / f"node{n}.log").exists())
    assert p_multi.returncode == 0, out_multi[-2000:] + logs
    assert p_single.returncode == 0, out_single[-4000:]
    for n in range(2):  # both agents ran, and met at one rendezvous of two nodes
        assert (tmp_path / f"node{n}.log").exists()
    ours, ref = _metrics(tmp_path / "multi"), _metrics(tmp_path / "single")
    assert [(r["job"], r["step"]) for r in ours] == [(r["job"], r["step"]) for r in ref] and len(ours) == 6
    for a, b in zip(ours, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["tokens"] == b["tokens"], (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
    summary = json.loads((tmp_path / "multi" / "summary.json").read_text())
    assert summary["parallelism"]["dp"] == 2
    for job in ("rev", "up"):
        assert_close(load_adapter(tmp_path / "multi", job), load_adapter(tmp_path / "single", job), rel=1e-5)

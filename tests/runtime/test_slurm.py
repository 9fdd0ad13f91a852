"""slurm/train.sbatch with stand-ins for srun and scontrol: SIGUSR1 reaches the run, the job is requeued, and
a requeued job resumes."""

import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "slurm" / "train.sbatch"

FAKE_SRUN = """#!/usr/bin/env bash
echo "$@" > "$LOG/srun_args"
echo "$TORCHELASTIC_SIGNALS_TO_HANDLE" > "$LOG/signals"
trap 'echo USR1 > "$LOG/srun_got"; exit 0' USR1
touch "$LOG/srun_started"
for i in $(seq 300); do sleep 0.1; done
"""


def _fakes(tmp: Path) -> dict:
    bin_ = tmp / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text(FAKE_SRUN)
    (bin_ / "scontrol").write_text('#!/usr/bin/env bash\n[ "$1" = show ] && { echo node1; exit 0; }\n'
                                   'echo "$@" >> "$LOG/scontrol"\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", LOG=str(tmp), SLURM_JOB_ID="77",
                SLURM_JOB_NODELIST="node1", SLURM_JOB_NUM_NODES="1", SLURM_SUBMIT_DIR=str(ROOT),
                GPUS_PER_NODE="1")


def test_sbatch_directives():
    text = SCRIPT.read_text()
    assert "#SBATCH --signal=B:USR1@120" in text and "#SBATCH --requeue" in text


def test_usr1_is_forwarded_and_the_job_requeued(tmp_path):
    env = _fakes(tmp_path)
    p = subprocess.Popen(["bash", str(SCRIPT), "run.yaml", "seed=3"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "srun_started").exists():
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()[0]
        time.sleep(0.05)
    p.send_signal(signal.SIGUSR1)
    out = p.communicate(timeout=30)[0]
    assert p.returncode == 0, out
    assert (tmp_path / "srun_got").read_text().strip() == "USR1"
    assert (tmp_path / "scontrol").read_text().split() == ["requeue", "77"]
    assert "SIGUSR1" in (tmp_path / "signals").read_text()
    args = (tmp_path / "srun_args").read_text().split()
    assert args[-2:] == ["run.yaml", "seed=3"] and "--resume" not in args


def test_requeued_job_resumes(tmp_path):
    env = dict(_fakes(tmp_path), SLURM_RESTART_COUNT="1")
    (tmp_path / "bin" / "srun").write_text('#!/usr/bin/env bash\necho "$@" > "$LOG/srun_args"\n')
    p = subprocess.run(["bash", str(SCRIPT), "run.yaml"], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "srun_args").read_text().split()[-2:] == ["run.yaml", "--resume"]
    assert not (tmp_path / "scontrol").exists()

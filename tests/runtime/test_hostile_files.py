"""Files a user hands over that are damaged, unreadable or odd: one line naming the right file and
what is wrong, exit 2 — never a traceback, never a silent wrong; and a stop while starting or after the end
exits 0 like a stop during the run."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lorafusion.cli import main
from runtime_utils import checkout_env, job_dict, write_dataset, write_run

ROOT = Path(__file__).resolve().parents[2]


def _one_line(capsys, cmd, *needles) -> str:
    err = capsys.readouterr().err
    assert (err.startswith(f"lorafusion {cmd}: error: ") and err.count("\n") == 1
            and "Traceback" not in err), err
    for n in needles:
        assert n in err, (n, err)
    return err


def _hf_run(tmp_path, damage) -> Path:
    from hf_utils import write_hf_checkpoint
    from lorafusion.core.arch import preset

    write_hf_checkpoint(preset("tiny-llama"), tmp_path / "hf")
    damage(tmp_path / "hf")
    run = write_run(tmp_path,
                    [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=1)], out="never")
    raw = yaml.safe_load(run.read_text())
    raw["model"] = {"path": str(tmp_path / "hf"), "dtype": "float32"}
    run.write_text(yaml.safe_dump(raw))
    return run


def test_config_json_that_is_a_list(tmp_path, capsys, megatron_single):
    run = _hf_run(tmp_path, lambda d: (d / "config.json").write_text("[1, 2]"))
    capsys.readouterr()
    assert main(["train", str(run)]) == 2
    _one_line(capsys, "train", f"{tmp_path / 'hf' / 'config.json'}: expected a JSON object", "got list")


def test_a_nan_in_a_base_weight_is_named_at_load(tmp_path, capsys, megatron_single):
    from safetensors.torch import load_file, save_file

    def poison(d):
        t = load_file(d / "model.safetensors")
        t["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})

    run = _hf_run(tmp_path, poison)
    capsys.readouterr()
    assert main(["train", str(run)]) == 2
    _one_line(capsys, "train",
              "model.safetensors: tensor 'model.layers.1.mlp.down_proj.weight' holds non-finite")
    assert not (tmp_path / "never").exists()


@pytest.fixture
def run_copy(three_jobs, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(three_jobs[3], out)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "reverse abc:", "job": "rev"}) + "\n")
    return out


def test_generate_refuses_a_non_finite_adapter(run_copy, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    f = run_copy / "adapters" / "rev" / "adapter_model.safetensors"
    t = load_file(f)
    k = sorted(t)[0]
    t[k][0, 0] = float("nan")
    save_file(t, f, metadata={"format": "pt"})
    from lorafusion.rundir.integrity import ADAPTER_HASHES, adapter_hashes  # (as if the run wrote it so)

    (f.parent / ADAPTER_HASHES).write_text(adapter_hashes({n: (f.parent / n).read_bytes() for n in (
        "adapter_config.json", "adapter_model.safetensors")}))
    assert main(
        ["generate", str(run_copy), "--prompts", str(tmp_path / "p.jsonl"), "--out",
         str(tmp_path / "o")]) == 2
    _one_line(capsys, "generate", f"{f}: tensor", "holds non-finite values")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case", ["0xff", "temperature", "top_p"])
def test_generate_odd_input(run_copy, tmp_path, capsys, case):
    args = ["generate", str(run_copy), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o")]
    if case == "0xff":
        (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xff"}\n')
        needles = [f"{tmp_path / 'p.jsonl'}:2: not valid UTF-8 (byte 0xff"]
    else:
        args += ["--temperature" if case == "temperature" else "--top-p", "nan"]
        needles = ["--temperature must be >= 0"]
    assert main(args) == 2
    _one_line(capsys, "generate", *needles)


def test_a_rank_file_without_its_states(tmp_path, capsys, megatron_single):
    import torch

    from runtime_utils import train_inprocess

    run = write_run(tmp_path, [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=2)], out="o")
    _, out = train_inprocess(run)
    capsys.readouterr()  # (the training's lines, on stderr)
    step = out / "checkpoints" / "a" / "step_000002"
    torch.save({"something": 1}, step / "rank_tp0_pp0.pt")
    # (as if written so: else the manifest names it)
    manifest = json.loads((step / "manifest.json").read_text())
    from lorafusion.rundir.atomic import file_sha256

    (step / "manifest.json").write_text(
        json.dumps({**manifest, "rank_tp0_pp0.pt": file_sha256(step / "rank_tp0_pp0.pt")}))
    capsys.readouterr()
    assert main(["train", str(run), "jobs.0.max_steps=3", "--resume"]) == 2
    _one_line(capsys, "train", "rank_tp0_pp0.pt: expected a checkpoint's 'adapter' and 'optimizer' states")


def test_a_full_disk_under_export_names_the_destination(run_copy, tmp_path, capsys, monkeypatch):
    def full(src, dst, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(src), None, str(dst))

    monkeypatch.setattr(shutil, "copyfile", full)
    assert main(["export", str(run_copy), "--job", "rev", "--out", str(tmp_path / "exp")]) == 2
    err = _one_line(capsys, "export", "cannot write", "No space left on device (ENOSPC)")
    assert f"{tmp_path}/.exp" in err and "adapters/rev" not in err, err  # (the temporary sibling of --out)


def test_an_unreadable_dataset_is_a_read_error(tmp_path, capsys, monkeypatch):
    import builtins

    import lorafusion.data.dataset as dataset

    data = write_dataset(tmp_path / "a.jsonl", 1)
    run = write_run(tmp_path, [job_dict("a", data, r=4, steps=1)], out="never")

    def guarded(file, *a, **kw):
        if Path(file) == data:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return builtins.open(file, *a, **kw)

    monkeypatch.setattr(dataset, "open", guarded, raising=False)
    assert main(["plan", str(run), "--windows", "1", "--out", str(tmp_path / "plan")]) == 2
    _one_line(capsys, "plan", f"job 'a': dataset {data}: cannot read (Permission denied)")


def test_sigterm_while_starting_exits_0_and_leaves_nothing(tmp_path):
    run = write_run(tmp_path, [job_dict("a", write_dataset(tmp_path / "a.jsonl", 1), r=4, steps=50)], out="o")
    env = checkout_env()
    p = subprocess.Popen([sys.executable, "-m", "lorafusion.cli", "train", str(run)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(1.0)  # importing torch and Megatron
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()[-2000:]
    assert not (tmp_path / "o" / "checkpoints").exists()


def test_a_stop_after_the_end_exits_0():
    from lorafusion.runtime.signals import exit_on_stop_outside_run

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        exit_on_stop_outside_run()
        for sig in before:
            with pytest.raises(SystemExit) as e:
                os.kill(os.getpid(), sig)
                time.sleep(1)
            assert e.value.code == 0
    finally:
        for s, h in before.items():
            signal.signal(s, h)



def _python(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a new Python process with the checkout importable (its output captured as text)."""
    return subprocess.run([sys.executable, "-c", code], env=checkout_env(), capture_output=True, text=True,
                          timeout=120)


def test_a_stop_during_the_heavy_imports_is_taken_after_them():
    """train imports torch inside stops_held(): a SIGTERM that lands then is kept pending and ends the process
    (status 0) once the imports are done — raised inside torch's import it aborted the process (status -6)."""
    code = ("import os, signal\n"
            "from lorafusion.runtime.signals import exit_on_stop_outside_run, stops_held\n"
            "exit_on_stop_outside_run()\n"
            "with stops_held():\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    from lorafusion.runtime.trainer import Trainer\n"
            "    print('imported', flush=True)\n"
            "print('not reached', flush=True)\n")
    p = _python(code)
    assert (p.returncode, p.stdout) == (0, "imported\n"), p.stderr[-2000:]


def test_a_stop_delivered_to_another_thread_during_the_heavy_imports_is_taken_after_them():
    """The mask of stops_held() holds a signal back from the main thread only; one the kernel hands to another
    thread still runs the Python handler in the main thread, mid-import. The handler defers it too: the block
    finishes, then the process exits 0."""
    code = ("import signal, threading, time\n"
            "from lorafusion.runtime.signals import exit_on_stop_outside_run, stops_held\n"
            "exit_on_stop_outside_run()\n"
            "t = threading.Thread(target=threading.Event().wait, daemon=True)\n"
            "t.start()\n"
            "with stops_held():\n"
            "    signal.pthread_kill(t.ident, signal.SIGTERM)\n"
            "    time.sleep(0.5)\n"
            "    print('inside', flush=True)\n"
            "print('not reached', flush=True)\n")
    p = _python(code)
    assert (p.returncode, p.stdout) == (0, "inside\n"), p.stderr[-2000:]

"""A damaged or tampered artifact is never used silently, and writers of an output never leave or lose work:
an adapter checked against the hashes the run recorded (a flipped byte was exported and decoded from with exit
0), a checkpoint without its manifest not believed, an edited base_model.json refused, one writer of an --out
at a time (two generate --out F both reported success), a stop during an export leaving no temporary files.
CPU, no training."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorafusion.core.errors import ConfigError
from lorafusion.rundir.adapters import find_adapter
from lorafusion.rundir.atomic import exclusive_out, fill_dir_atomically, write_text_atomic
from lorafusion.rundir.integrity import (ADAPTER_HASHES, MANIFEST, DamagedFileError, adapter_hashes,
                                         check_base_record, check_manifest)

ROOT = Path(__file__).resolve().parents[2]


def _adapter(d: Path, hashes=True) -> Path:
    d.mkdir(parents=True)
    files = {"adapter_config.json": b'{"r": 4}\n', "adapter_model.safetensors": _safetensors()}
    for n, b in files.items():
        (d / n).write_bytes(b)
    if hashes:
        (d / ADAPTER_HASHES).write_text(adapter_hashes(files))
    return d


def _safetensors() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    return len(header).to_bytes(8, "little") + header + b"\0" * 8


def _flip(path: Path) -> None:
    b = bytearray(path.read_bytes())
    b[-3] ^= 1
    path.write_bytes(b)


def test_a_flipped_byte_in_a_runs_adapter_is_never_used(tmp_path):
    run = tmp_path / "run"
    _adapter(run / "adapters" / "j")
    (run / "summary.json").write_text('{"jobs": {"j": {"status": "done"}}}')
    assert find_adapter(run, "j")[0] == run / "adapters" / "j"
    _flip(run / "adapters" / "j" / "adapter_model.safetensors")
    with pytest.raises(DamagedFileError,
                       match="adapter_model.safetensors: does not match the sha256 the run recorded"):
        find_adapter(run, "j")


def test_a_checkpoints_adapter_is_checked_against_its_manifest(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "j" / "step_000002"
    _adapter(step / "adapter", hashes=False)
    (step / "state.json").write_text('{"job": "j", "step": 2, "stream": {}}')
    names = ["adapter/adapter_config.json", "adapter/adapter_model.safetensors", "state.json"]
    from lorafusion.rundir.atomic import file_sha256

    (step / MANIFEST).write_text(json.dumps({n: file_sha256(step / n) for n in names}))
    assert find_adapter(step, "j")[0] == step / "adapter"
    _flip(step / "adapter" / "adapter_model.safetensors")
    with pytest.raises(DamagedFileError, match="does not match the checkpoint's manifest.json"):
        find_adapter(step, "j")
    os.unlink(step / MANIFEST)  # (deleting the manifest is no way around it)
    with pytest.raises(DamagedFileError, match="manifest.json: missing"):
        check_manifest(step, ["state.json"])


def test_an_edited_base_record_is_refused(tmp_path):
    from lorafusion.rundir.atomic import file_sha256

    step = tmp_path / "checkpoints" / "j" / "step_000002"
    step.mkdir(parents=True)
    settings = {"(run) seed": 1234, "(run) model.dtype": "float32", "(run) model": "tiny-llama",
                "(run) tokenizer.type": "byte"}
    (step / "state.json").write_text(json.dumps({"job": "j", "step": 2, "settings": settings}))
    (step / MANIFEST).write_text(json.dumps({"state.json": file_sha256(step / "state.json")}))
    record = {"preset": "tiny-llama", "path": None, "seed": 1234, "dtype": "float32",
              "tokenizer": {"type": "byte"}}
    check_base_record(tmp_path, record)
    for key, value in (("seed", 7), ("dtype", "bfloat16"), ("preset", "tiny-qwen")):
        with pytest.raises(DamagedFileError, match="base_model.json: .* the record was edited"):
            check_base_record(tmp_path, {**record, key: value})


def test_one_writer_of_an_out_at_a_time(tmp_path):
    out = tmp_path / "answers.jsonl"
    with exclusive_out(out):
        with pytest.raises(ConfigError, match="being written by another process right now"):
            with exclusive_out(out):
                pass
    with exclusive_out(out):  # (released)
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    write_text_atomic(out, "first\n", replace=False)
    with pytest.raises(ConfigError, match="written meanwhile by another process"):
        # (the second generate: its rows must not vanish either)
        write_text_atomic(out, "second\n", replace=False)
    assert out.read_text() == "first\n" and sorted(p.name for p in tmp_path.iterdir()) == ["answers.jsonl"]


def test_a_stop_during_an_export_leaves_no_temporary_files(tmp_path):
    code = ("import sys, time\nfrom pathlib import Path\nfrom lorafusion.rundir.atomic import "
            "fill_dir_atomically\ndef fill(tmp):\n    (tmp / 'model.safetensors').write_bytes(b'x' * 1000)\n"
            "    Path(sys.argv[2]).write_text('filling')\n    time.sleep(60)\n"
            "fill_dir_atomically(Path(sys.argv[1]), fill)\n")
    flag = tmp_path / "flag"
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "merged"), str(flag)], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while not flag.exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 128 + signal.SIGTERM
    assert sorted(x.name for x in tmp_path.iterdir()) == ["flag"]


def test_what_a_killed_export_left_is_removed_by_the_next(tmp_path):
    dead = tmp_path / ".merged.tmp-999999999-0123abcd"  # (no such pid)
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"x")
    live = tmp_path / f".merged.tmp-{os.getpid()}-0123abcd"
    live.mkdir()
    fill_dir_atomically(tmp_path / "merged", lambda tmp: (tmp / "a").write_text("a"))
    assert sorted(x.name for x in tmp_path.iterdir()) == [live.name, "merged"]


def test_a_full_disk_during_a_merged_export_names_the_file(tmp_path, monkeypatch):
    """safetensors' writer raised its SafetensorError (a traceback); the adapter export said 'cannot
    write'."""
    import safetensors

    import lorafusion.models.hf_export as hf_export
    from lorafusion.export.hf import _write_weights

    def full(*a, **kw):
        raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: '
                                          'StorageFull, message: "No space left on device" })')

    monkeypatch.setattr(hf_export, "write_hf_weights", full)
    with pytest.raises(OSError) as e:
        _write_weights(tmp_path, iter(()), 1 << 30)
    assert e.value.errno == 28 and e.value.filename == str(tmp_path), e.value


def test_a_directory_that_cannot_be_made_says_why(tmp_path):
    """A dangling symlink as output_dir / --out's directory said only "File exists"; a file on the way too."""
    from lorafusion.rundir.atomic import check_writable_dir

    (tmp_path / "dang").symlink_to("/nonexistent/y")
    with pytest.raises(ConfigError, match="dang is a symlink to /nonexistent/y, which does not exist"):
        check_writable_dir(tmp_path / "dang", "--out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"cannot write in .*file/sub \(.*file is not a directory\)"):
        check_writable_dir(tmp_path / "file" / "sub", "--out")

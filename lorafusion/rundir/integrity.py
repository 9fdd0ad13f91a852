"""What a run wrote is checked against the hashes it recorded before anything uses it (torch-free): a
checkpoint's files against its ``manifest.json`` (required: a checkpoint without one is not believed), a PEFT
adapter the run wrote against its ``.lorafusion-sha256.json``, and the run's record of its base
(``base_model.json``) against the settings its checkpoints recorded. A damaged or edited file is a
:class:`DamagedFileError`, never used silently."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from lorafusion.core.errors import MissingFileError
from lorafusion.rundir.atomic import file_sha256
from lorafusion.rundir.jsonfile import read_json_file

__all__ = ["ADAPTER_HASHES", "MANIFEST", "DamagedFileError", "adapter_hashes", "check_adapter",
           "check_base_record", "check_manifest", "model_digest"]

MANIFEST = "manifest.json"  # a checkpoint's: the sha256 of every other file, written last
ADAPTER_HASHES = ".lorafusion-sha256.json"  # beside a PEFT adapter the run wrote: the sha256 of its two files
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class DamagedFileError(MissingFileError):
    """A file the run wrote does not match the hash it recorded (damaged or edited): not to be used."""


def adapter_hashes(files: dict[str, bytes]) -> str:
    """The hash record of a PEFT adapter's files (name -> bytes), as written beside them."""
    return json.dumps({n: hashlib.sha256(b).hexdigest() for n, b in files.items()}, indent=1) + "\n"


def _recorded(record: Path) -> dict:
    try:
        hashes = read_json_file(record)
    except (OSError, ValueError) as e:
        raise DamagedFileError(f"{record}: not readable ({e}); the files it vouches for are not "
                               "used") from None
    if not isinstance(hashes, dict):
        raise DamagedFileError(f"{record}: expected a JSON object of file hashes")
    return hashes


def check_manifest(ckpt: Path, names: list[str]) -> None:
    """DamagedFileError unless the files ``names`` of checkpoint directory ``ckpt`` are those its manifest
    records; a checkpoint without a manifest is not believed (a run writes it last, with every checkpoint)."""
    if not (ckpt / MANIFEST).is_file():
        raise DamagedFileError(f"{ckpt / MANIFEST}: missing — the checkpoint's files cannot be checked, so "
                               f"they are not used (deleted, or the checkpoint was copied incompletely)")
    manifest = _recorded(ckpt / MANIFEST)
    for name in names:
        if manifest.get(name) != _sha256(ckpt / name):
            raise DamagedFileError(
                f"{ckpt / name}: does not match the checkpoint's {MANIFEST} (edited or damaged)")


def _sha256(path: Path) -> str | None:
    try:
        return file_sha256(path)
    except OSError:
        return None


def check_adapter(adapter: Path) -> None:
    """A PEFT adapter directory of a run checked against its hashes: its own record, or (a checkpoint's
    ``adapter/``) the checkpoint's manifest. An adapter with neither (written before hashes were recorded, or
    not by a run) is taken as it is."""
    adapter = Path(adapter)
    if (adapter / ADAPTER_HASHES).is_file():
        hashes = _recorded(adapter / ADAPTER_HASHES)
        for name in _ADAPTER_FILES:
            if name in hashes and hashes[name] != _sha256(adapter / name):
                raise DamagedFileError(f"{adapter / name}: does not match the sha256 the run recorded in "
                                       f"{ADAPTER_HASHES} (edited or damaged); not used")
    elif adapter.name == "adapter" and (adapter.parent / "state.json").is_file():
        check_manifest(adapter.parent, [f"adapter/{n}" for n in _ADAPTER_FILES if (adapter / n).exists()])


def check_base_record(run_dir: Path, record: dict) -> None:
    """``base_model.json`` against what every checkpoint of the run recorded of its base (their state.json,
    checked by their manifests): the seed, dtype, model, tokenizer type and (``model.path``) the model files'
    digest. An edited record would rebuild another base than the adapters were trained on."""
    where = Path(run_dir) / "base_model.json"
    for state_file in sorted(Path(run_dir).glob("checkpoints/*/step_*/state.json")):
        try:
            check_manifest(state_file.parent, ["state.json"])
            settings = read_json_file(state_file).get("settings") or {}
        except (DamagedFileError, OSError, ValueError, AttributeError):
            continue  # (a damaged checkpoint vouches for nothing; resume and export name it themselves)
        path = record.get("path")
        mine = {"(run) seed": record.get("seed"), "(run) model.dtype": record.get("dtype"),
                "(run) tokenizer.type": (record.get("tokenizer") or {}).get("type"),
                **({} if path else {"(run) model": record.get("preset")})}  # (a path: by its digest below)
        for key, value in mine.items():
            if key in settings and settings[key] != value:
                raise DamagedFileError(f"{where}: {key[6:]} is {value!r}, but the run trained with "
                                       f"{settings[key]!r} ({state_file}); the record was edited or is of "
                                       f"another run: not used")
        if path and settings.get("(run) model.digest") and Path(path).is_dir() \
                and model_digest(Path(path)) != settings["(run) model.digest"]:
            raise DamagedFileError(f"{where}: the base model at {path} differs from the one the run trained "
                                   f"on (its config or weights changed); not used")
        return


def model_digest(path: Path) -> str:
    """The identity of a HF model directory by content, cheaply: sha256 over config.json, and of every
    ``*.safetensors`` file its size, its header (names, dtypes, shapes, offsets) and 16 samples of 64 KiB
    spread over its data (other weights of the same shapes differ there; a few MB read, whatever the model's
    size)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(head + fh.read(min(n, size)))
            for i in range(16):
                fh.seek(8 + n + (max(0, size - 8 - n - 65536) * i) // 15)
                h.update(fh.read(65536))
    return h.hexdigest()

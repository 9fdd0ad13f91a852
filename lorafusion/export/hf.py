"""Whole-model exports of a run: the base (``lorafusion export RUN_DIR --base``) and a job's adapter merged
into it (``lorafusion export RUN_DIR --job J --merged``), as HF checkpoint directories.

A run records its base in ``RUN_DIR/base_model.json`` (written with every adapter export): the
preset or ``model.path``, the seed, the dtype, the device type the random weights were drawn on, the HF
config and the tokenizer. The base is rebuilt from that record, never gathered from training ranks:

- ``model.path``: its files are copied (config.json, safetensors, tokenizer and generation files).
- a preset: the weights are drawn again with :func:`lorafusion.models.provider.init_random_weights` for
  the same seed (TP = PP = 1; every layout draws whole tensors, so this is the model every TP/PP run
  trained against) on the same device type (a CUDA generator draws other numbers than the CPU one), cast
  to the run's dtype, and mapped to HF names by :func:`lorafusion.models.hf_export.hf_state_from_model`.

Adapters name their base (``base_model_name_or_path``): ``model.path`` when set, otherwise ``RUN_DIR/base``,
where ``lorafusion export RUN_DIR --base --out RUN_DIR/base`` puts it (:func:`base_reference`).

Merging is done on the HF names of the exported PEFT adapter, whose fused q/k/v and gate/up are already
split: ``W + scaling * B @ A`` in fp32 for every targeted projection (``scaling`` = alpha/r, or
alpha/sqrt(r) with rslora), cast back to the weight's dtype.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from lorafusion.core.arch import ModelArch, arch_from_hf_config, arch_to_hf_config
from lorafusion.core.errors import ConfigError, MissingFileError
from lorafusion.dist import is_rank0

RECORD = "base_model.json"
# tokenizer and generation files of a HF model directory, copied with it when present
_HF_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                  "added_tokens.json", "chat_template.jinja")


def base_reference(cfg, run_dir: Path, arch: ModelArch, device) -> str:
    """What the run's adapters name as their base; global rank 0 also (re)writes ``RUN_DIR/base_model.json``
    with every adapter export (a resume must keep seed, model and dtype, so its record is the same)."""
    run_dir = Path(run_dir)
    ref = str(Path(cfg.model.path).resolve()) if cfg.model.path else str(run_dir.resolve() / "base")
    if not is_rank0():
        return ref
    from lorafusion.rundir.atomic import write_text_atomic

    record = {
        "preset": cfg.model.preset, "path": str(Path(cfg.model.path).resolve()) if cfg.model.path else None,
        "seed": cfg.seed, "dtype": cfg.model.dtype, "base_precision": cfg.model.base_precision,
        "init_device": torch.device(device).type if device is not None else "cpu",
        "tokenizer": {"type": cfg.tokenizer.type,
                      "path": str(Path(cfg.tokenizer.path).resolve()) if cfg.tokenizer.path else None},
        "config": arch_to_hf_config(arch),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / RECORD, json.dumps(record, indent=2) + "\n")
    return ref


def read_record(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MissingFileError(f"{run_dir}: no such run directory (expected a lorafusion train output_dir)")
    f = run_dir / RECORD
    if not f.is_file():
        raise MissingFileError(f"{f}: missing (expected a lorafusion train output_dir; runs written before "
                               f"base export was added have no record of their base)")
    try:
        record = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{f}: expected a JSON object, got {type(record).__name__}")
    from lorafusion.rundir.integrity import check_base_record

    check_base_record(run_dir, record)  # (an edited record would rebuild another base than the run's)
    return record


def _record_arch(record: dict, run_dir: Path) -> ModelArch:
    return arch_from_hf_config(record["config"], str(Path(run_dir) / RECORD))


def _hf_config(record: dict, arch: ModelArch) -> dict:
    cfg = {**arch_to_hf_config(arch), "torch_dtype": record["dtype"]}
    if record["tokenizer"]["type"] == "byte":
        from lorafusion.data.tokenizer import ByteTokenizer

        cfg.update(bos_token_id=ByteTokenizer.BOS, eos_token_id=ByteTokenizer.EOS,
                   pad_token_id=ByteTokenizer.PAD)
    return cfg


def _preset_base_state(record: dict, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """The preset base of the run, rebuilt (TP = PP = 1) on the device type it was drawn on."""
    from megatron.core import parallel_state

    from lorafusion.models.base import build_base
    from lorafusion.models.hf_export import hf_state_from_model
    from lorafusion.dist import init_distributed

    device = record.get("init_device", "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{record['preset']}: the run drew its random base weights on CUDA; export it on a "
                          f"machine with a GPU (a CPU generator draws other numbers)")
    if not (parallel_state.model_parallel_is_initialized()
            and parallel_state.get_tensor_model_parallel_world_size() == 1
            and parallel_state.get_pipeline_model_parallel_world_size() == 1):
        init_distributed(1, 1, seed=record["seed"])
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None
    model = build_base(arch, dtype=record["dtype"], device=dev, seed=record["seed"])
    yield from hf_state_from_model(model, arch)


def _path_base_state(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from lorafusion.models.hf_import import HFCheckpoint

    ckpt = HFCheckpoint(path)
    for key in ckpt.files:
        yield key, ckpt.get(key)


def _write_tokenizer(record: dict, out: Path) -> str:
    """Tokenizer files into ``out``, made to encode as training did (:func:`match_training`); returns a short
    description."""
    desc = _copy_tokenizer(record, out)
    match_training(record, out)
    return desc


def _copy_tokenizer(record: dict, out: Path) -> str:
    tok = record["tokenizer"]
    if tok["type"] == "byte":
        write_byte_tokenizer(out)
        return "byte tokenizer as tokenizer.json"
    src = Path(tok["path"] or record["path"] or "")
    if tok["type"] == "sentencepiece":
        f = src / "tokenizer.model" if src.is_dir() else src
        shutil.copyfile(f, out / "tokenizer.model")
        return "sentencepiece tokenizer.model"
    copied = []
    for n in _HF_SIDE_FILES:
        if (src / n).is_file():
            if not (out / n).exists():
                shutil.copyfile(src / n, out / n)
            copied.append(n)
    return f"tokenizer files {', '.join(copied)}" if copied else "no tokenizer files"


def _run_tokenizer(record: dict):
    from lorafusion.data.tokenizer import ByteTokenizer, HFTokenizer

    tok = record["tokenizer"]
    if tok["type"] == "byte":
        return ByteTokenizer(), "<s>"
    if tok["type"] == "hf":
        t = HFTokenizer(tok["path"] or record["path"])
        return t, t.bos_token
    return None, None


def match_training(record: dict, out: Path) -> None:
    """Make the HF tokenizer files in ``out`` do what training did, so transformers needs no manual fix:

    - encoding with special tokens (transformers' default) prepends bos exactly when training's samples start
      with it (a ``TemplateProcessing`` step in tokenizer.json when the tokenizer would not);
    - ``chat_template``: the tokenizer's own, else the built-in template training renders chat data with
      (:func:`lorafusion.data.tokenizer.simple_chat_jinja`);
    - ``generation_config.json`` (when the base has none): bos / eos / pad ids, eos ending generation as in
      ``lorafusion generate``.

    A sentencepiece tokenizer is copied as is (transformers builds its own from tokenizer.model)."""
    from lorafusion.data.tokenizer import simple_chat_jinja

    tok, bos_token = _run_tokenizer(record)
    if tok is None or not (out / "tokenizer.json").is_file():
        return
    if tok.bos_id is not None:
        _prepend_bos(out / "tokenizer.json", bos_token, tok.bos_id)
    tc_file = out / "tokenizer_config.json"
    tc = json.loads(tc_file.read_text()) if tc_file.is_file() else {}
    tc["add_bos_token"] = tok.bos_id is not None
    tc["add_eos_token"] = False
    if not tc.get("chat_template") and not (out / "chat_template.jinja").is_file():
        tc["chat_template"] = simple_chat_jinja(tok.bos_id is not None)
    tc_file.write_text(json.dumps(tc, indent=2) + "\n")
    if not (out / "generation_config.json").is_file():
        gen = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
        (out / "generation_config.json").write_text(
            json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2) + "\n")


def _prepend_bos(tok_json: Path, bos_token: str, bos_id: int) -> None:
    from tokenizers import Tokenizer, processors

    t = Tokenizer.from_file(str(tok_json))
    if t.encode("a").ids[:1] == [bos_id]:
        return
    bos = processors.TemplateProcessing(single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B:1",
                                        special_tokens=[(bos_token, bos_id)])
    t.post_processor = bos if t.post_processor is None else processors.Sequence([t.post_processor, bos])
    t.save(str(tok_json))


def write_byte_tokenizer(out: Path) -> None:
    """The byte tokenizer (ids 0-255 bytes, 256 <s>, 257 </s>, 258 <pad>) as a HF fast tokenizer: a
    byte-level BPE without merges whose vocabulary puts each byte at its own id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from lorafusion.data.tokenizer import ByteTokenizer

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):  # GPT-2's byte → unicode map, which the ByteLevel pre-tokenizer applies
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ("<s>", "</s>", "<pad>")
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    assert [tok.token_to_id(t) for t in specials] == [ByteTokenizer.BOS, ByteTokenizer.EOS, ByteTokenizer.PAD]
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "add_bos_token": False, "add_eos_token": False,
        "model_max_length": 1000000000000000019884624838656,
    }, indent=2) + "\n")


def write_base(run_dir: Path, out: Path, *, max_shard_bytes: int | None = None):
    """A filler for :func:`lorafusion.rundir.atomic.fill_dir_atomically` that writes the run's base, and a
    description of what it wrote (from the record, before anything is written)."""
    from lorafusion.models.hf_export import DEFAULT_SHARD_BYTES

    record = read_record(run_dir)
    arch = _record_arch(record, run_dir)

    def fill(tmp: Path) -> None:
        if record["path"]:
            src = Path(record["path"])
            if not src.is_dir():
                raise MissingFileError(f"{src}: the run's model.path is gone")
            names = ["config.json", *_HF_SIDE_FILES]
            names += [p.name for p in src.iterdir() if p.name.endswith(".safetensors")
                      or p.name == "model.safetensors.index.json"]
            for n in names:
                if (src / n).is_file():
                    shutil.copyfile(src / n, tmp / n)
        else:
            _write_weights(tmp, _preset_base_state(record, arch), max_shard_bytes or DEFAULT_SHARD_BYTES)
            (tmp / "config.json").write_text(json.dumps(_hf_config(record, arch), indent=2) + "\n")
        _write_tokenizer(record, tmp)

    what = f"copy of model.path {record['path']}" if record["path"] else \
        f"preset {record['preset']!r} (seed {record['seed']}, {record['dtype']})"
    return fill, what + fp8_note(record)


def _write_weights(tmp: Path, state, max_shard_bytes: int) -> None:
    """``write_hf_weights``, a failed write an OSError naming the file (safetensors' writer raises its own
    SafetensorError for a full disk, which the CLI cannot tell from a bug)."""
    import errno
    import re

    from lorafusion.models.hf_export import write_hf_weights

    try:
        write_hf_weights(tmp, state, max_shard_bytes)
    except Exception as e:
        if type(e).__name__ != "SafetensorError":
            raise
        code = re.search(r"code: (\d+)", str(e))
        if code is None and shutil.disk_usage(tmp).free >= 64 << 20:
            raise
        num = int(code.group(1)) if code else errno.ENOSPC
        shards = sorted(tmp.glob(".shard-*")) or [tmp]
        raise OSError(num, os.strerror(num), str(shards[-1])) from None


def fp8_note(record: dict) -> str:
    """What an export of a run trained on an FP8 base says: the weights written are the original ones."""
    if record.get("base_precision", "bf16") == "bf16":
        return ""
    src = record["path"] or f"preset {record['preset']!r} drawn again from seed {record['seed']}"
    return (f" (the run trained on an {record['base_precision'].upper()} base; these are the original "
            f"{record['dtype']} weights, reloaded from {src})")


def write_merged(run_dir: Path, adapter_dir: Path, *, max_shard_bytes: int | None = None):
    """Filler (see :func:`write_base`) for the base with the PEFT adapter at ``adapter_dir`` merged in."""
    from lorafusion.models.hf_export import DEFAULT_SHARD_BYTES
    from lorafusion.export.peft import read_peft_adapter

    record = read_record(run_dir)
    arch = _record_arch(record, run_dir)
    spec, tensors = read_peft_adapter(adapter_dir)
    tensors = {k.replace(".default.weight", ".weight"): v for k, v in tensors.items()}

    def merged(state) -> Iterator[tuple[str, torch.Tensor]]:
        used = set()
        for name, w in state:
            stem = "base_model.model." + name.removesuffix(".weight")
            ka, kb = stem + ".lora_A.weight", stem + ".lora_B.weight"
            if name.endswith(".weight") and ka in tensors:
                if kb not in tensors:
                    raise ConfigError(f"{adapter_dir}: tensor {kb!r} missing")
                a, b = tensors[ka].to(w.device, torch.float32), tensors[kb].to(w.device, torch.float32)
                w = (w.float() + spec.scaling * (b @ a)).to(w.dtype)
                used |= {ka, kb}
            yield name, w
        unused = sorted(set(tensors) - used)
        if unused:
            raise ConfigError(f"{adapter_dir}: tensors {unused[:3]} match no weight of the base")

    def fill(tmp: Path) -> None:
        if record["path"]:
            state = _path_base_state(Path(record["path"]))
            cfg = json.loads((Path(record["path"]) / "config.json").read_text())
            for n in ("generation_config.json",):
                if (Path(record["path"]) / n).is_file():
                    shutil.copyfile(Path(record["path"]) / n, tmp / n)
        else:
            state, cfg = _preset_base_state(record, arch), _hf_config(record, arch)
        _write_weights(tmp, merged(state), max_shard_bytes or DEFAULT_SHARD_BYTES)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        _write_tokenizer(record, tmp)

    return fill, f"adapter {adapter_dir} merged into the base (scaling {spec.scaling:g}){fp8_note(record)}"


__all__ = ["RECORD", "base_reference", "read_record", "write_base", "write_byte_tokenizer", "write_merged"]

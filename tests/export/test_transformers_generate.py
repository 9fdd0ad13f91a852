"""A run's exports reproduce training in transformers with no manual fix: the exported base's tokenizer
prepends bos as training did (tokenizer(prompt)), its chat template renders a chat job's prompt as training
did (apply_chat_template), generation_config.json ends at eos, and greedy generate() of base + PEFT adapter
equals `lorafusion generate` token for token (CPU)."""

import json

import pytest
import torch

from runtime_utils import job_dict, train_inprocess, write_dataset, write_run

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
NEW = 12


@pytest.fixture(scope="module")
def run(tmp_path_factory, megatron_single):
    tmp = tmp_path_factory.mktemp("gen")
    a = job_dict("a", write_dataset(tmp / "d" / "a.jsonl", 1, rows=8), r=4, steps=2, lr=5e-2,
                 targets=["q_proj", "v_proj"])
    chat = tmp / "d" / "c.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"},
                                                     {"role": "assistant", "content": w.upper()}]}) + "\n"
                            for w in ("abc", "hello", "wxyz", "q", "pear", "lime", "fig", "kiwi")))
    c = job_dict("c", chat, r=8, steps=2, lr=5e-2)
    c["dataset"]["format"] = "chat"
    _, out = train_inprocess(write_run(tmp, [a, c], capacity=96))
    from lorafusion.cli import main

    assert main(["export", str(out), "--base", "--out", str(out / "base")]) == 0
    return tmp, out


def _lorafusion_generate(out, tmp, rows):
    from lorafusion.cli import main

    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["generate", str(out), "--prompts", str(prompts), "--out", str(tmp / "gen.jsonl"),
                 "--max-new-tokens", str(NEW)]) == 0
    return [json.loads(x) for x in (tmp / "gen.jsonl").read_text().splitlines()]


def _ids(enc):
    ids = enc["input_ids"] if not isinstance(enc, torch.Tensor) else enc
    return torch.as_tensor(ids).reshape(1, -1)


def test_greedy_generate_in_transformers_equals_lorafusion_generate(run):
    tmp, out = run
    msgs = [{"role": "user", "content": "say hello"}]
    rows = [{"prompt": "reverse abcd:", "job": "a"}, {"messages": msgs, "job": "c"}]
    got = _lorafusion_generate(out, tmp, rows)
    tok = transformers.AutoTokenizer.from_pretrained(out / "base")
    gen_cfg = json.loads((out / "base" / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == 257 and gen_cfg["bos_token_id"] == 256
    for row, g in zip(rows, got, strict=True):
        pm = peft.AutoPeftModelForCausalLM.from_pretrained(out / "adapters" / row["job"],
                                                           dtype=torch.float32).eval()
        if "prompt" in row:
            ids = _ids(tok(row["prompt"], return_tensors="pt"))
        else:
            ids = _ids(
                tok.apply_chat_template(row["messages"], add_generation_prompt=True, return_tensors="pt"))
        assert ids[0].tolist() == g["prompt_ids"], row  # bos and chat rendering as training built them
        ref = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                          do_sample=False)
        assert ref[0, ids.shape[1]:].tolist() == g["output_ids"], row
        assert tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True) == g["output"]


def test_chat_template_renders_training_samples(run):
    """A whole conversation rendered by the exported chat template is training's sample: bos, prompt,
    response, eos; the history with the generation prompt is its prompt."""
    from lorafusion.data.dataset import build_sample
    from lorafusion.data.tokenizer import ByteTokenizer

    _, out = run
    tok = transformers.AutoTokenizer.from_pretrained(out / "base")
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hi"},
            {"role": "assistant", "content": "HI"}]
    bt = ByteTokenizer()
    p, r = bt.apply_chat(conv)
    ids, prompt_len = build_sample(p, r, bt, mask_prompt=True)
    assert _ids(tok.apply_chat_template(conv, return_tensors="pt"))[0].tolist() == ids
    assert _ids(tok.apply_chat_template(conv[:-1], add_generation_prompt=True,
                                        return_tensors="pt"))[0].tolist() == ids[:prompt_len]


@pytest.mark.parametrize("case", ["bos", "no_bos", "own_template"])
def test_hf_tokenizer_export_encodes_as_training(tmp_path, case):
    """A HF tokenizer whose tokenizer.json adds no bos (a generic fast tokenizer: transformers ignores
    add_bos_token for it) while training prepends one gets a post-processor that does; one whose config says
    add_bos_token: false stays without; a tokenizer's own chat template is kept; eos ends generation."""
    from lorafusion.data.tokenizer import HFTokenizer
    from lorafusion.export.hf import match_training, write_byte_tokenizer

    src, out = tmp_path / "src", tmp_path / "out"
    for d in (src, out):
        d.mkdir()
    write_byte_tokenizer(src)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("add_bos_token")
    if case == "no_bos":
        cfg["add_bos_token"] = False
    if case == "own_template":
        cfg["chat_template"] = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    for n in ("tokenizer.json", "tokenizer_config.json"):
        (out / n).write_bytes((src / n).read_bytes())
    trained = HFTokenizer(src)  # what training used
    match_training({"tokenizer": {"type": "hf", "path": str(src)}, "path": None}, out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    want = ([trained.bos_id] if trained.bos_id is not None else []) + trained.encode("reverse abc:")
    assert tok("reverse abc:").input_ids == want and (want[0] == 256) == (case != "no_bos")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == trained.eos_id == 257
    msgs = [{"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert rendered == ("<user>hi" if case == "own_template" else ("" if case == "no_bos" else "<s>")
                        + "user: hi\nassistant: ")

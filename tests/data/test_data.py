"""Data layer: tokenizers round-trip, dataset loading (one clear DataError per malformed dataset), samples,
and per-job streams (deterministic, independent of other jobs, exact epochs, resumable)."""

import csv
import io
import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from lorafusion.config import (
    ConfigError,
    DatasetConfig,
    JobConfig,
    TokenizerConfig,
    load_run_config,
)
from lorafusion.core.lora import LoRASpec
from lorafusion.data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    JobStream,
    SentencePieceTokenizer,
    build_tokenizer,
    epoch_permutation,
    load_job_samples,
)

ROOT = Path(__file__).resolve().parents[2]


def job_for(path, fmt="prompt_response", name="j", **ds) -> JobConfig:
    return JobConfig(name=name, dataset=DatasetConfig(path=str(path), format=fmt, **ds),
                     lora=LoRASpec(r=4, lora_alpha=8), global_batch_size=2, max_steps=3)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------------------------- tokenizers
def test_byte_tokenizer_round_trip():
    tok = build_tokenizer(TokenizerConfig(type="byte"))
    assert isinstance(tok, ByteTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)
    for text in ("hello world", "ünïcødé ✓", "", "a\nb\tc"):
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == text
    assert tok.decode([256, *tok.encode("hi"), 257, 258]) == "hi"
    prompt, response = tok.apply_chat([{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "HI"}])
    assert tok.decode(prompt) == "system: be brief\nuser: hi\nassistant: " and tok.decode(response) == "HI"


def _hf_dir(tmp: Path, chat_template: str | None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50 + ["hello world"] * 20,
                            trainer=trainer)
    d = tmp / "hf_tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if chat_template:
        cfg["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_hf_tokenizer_round_trip_and_chat_template(tmp_path):
    pytest.importorskip("tokenizers")
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    d = _hf_dir(tmp_path, template)
    tok = build_tokenizer(TokenizerConfig(type="hf", path=str(d)))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == tok._tok.token_to_id("</s>") and tok.bos_id == tok._tok.token_to_id("<s>")
    assert tok.vocab_size == tok._tok.get_vocab_size(with_added_tokens=True)
    for text in ("the lazy dog", "hello brown fox!", "zebra 123"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    prompt, response = tok.apply_chat([{"role": "user", "content": "hello"},
                                       {"role": "assistant", "content": "world"}])
    assert tok.decode(prompt) == "<user>hello<assistant>"
    # the response is what the template adds after the generation prompt: content + end-of-turn
    assert response[-1] == tok._tok.token_to_id("<|im_end|>") and tok.decode(response) == "world"
    # the HF directory defaults to model.path
    assert build_tokenizer(TokenizerConfig(type="hf"), model_path=str(d)).vocab_size == tok.vocab_size


def test_hf_tokenizer_without_template_uses_simple_template(tmp_path):
    pytest.importorskip("tokenizers")
    tok = HFTokenizer(_hf_dir(tmp_path, None))
    prompt, response = tok.apply_chat([{"role": "user", "content": "hello"},
                                       {"role": "assistant", "content": "world"}])
    assert tok.decode(prompt) == "user: hello\nassistant: " and tok.decode(response) == "world"


def test_hf_tokenizer_missing_dir_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="expected a HF tokenizer directory with tokenizer.json"):
        build_tokenizer(TokenizerConfig(type="hf", path=str(tmp_path / "none")))


def test_sentencepiece_round_trip(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "and", "then", "some",
             "more", "words", "appear", "here"]
    sents = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sents), model_writer=buf, vocab_size=60,
                                   model_type="unigram", minloglevel=2, unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=3, hard_vocab_limit=False)
    path = tmp_path / "sp.model"
    path.write_bytes(buf.getvalue())
    tok = build_tokenizer(TokenizerConfig(type="sentencepiece", path=str(path)))
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    for text in ("the lazy fox", "some more words appear here"):
        assert tok.decode(tok.encode(text)) == text
    p, r = tok.apply_chat(
        [{"role": "user", "content": "the dog"}, {"role": "assistant", "content": "the fox"}])
    assert tok.decode(r) == "the fox" and "the dog" in tok.decode(p)
    with pytest.raises(ConfigError, match="sentencepiece model file not found"):
        SentencePieceTokenizer(tmp_path / "nope.model")


# ----------------------------------------------------------------------------------------------- samples
def test_prompt_response_samples_and_masking(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl",
                    [{"prompt": "ab=", "response": "ba"}, {"prompt": "xyz=", "response": "zyx"}])
    tok = ByteTokenizer()
    data = load_job_samples(job_for(p), tok)
    assert data.samples[0] == ([256, 97, 98, 61, 98, 97, 257], 4)
    assert data.lengths == [7, 9] and data.num_samples == 2 and data.num_tokens == 16
    data = load_job_samples(job_for(p, mask_prompt=False), tok)
    assert data.samples[1] == ([256, *b"xyz=zyx", 257], 0)


def test_chat_and_text_formats(tmp_path):
    tok = ByteTokenizer()
    p = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "HI"}]}])
    ids, plen = load_job_samples(job_for(p, "chat"), tok).samples[0]
    assert tok.decode(ids[1:plen]) == "user: hi\nassistant: " and tok.decode(ids[plen:]) == "HI"
    assert ids[0] == 256 and ids[-1] == 257
    t = write_jsonl(tmp_path / "t.jsonl", [{"body": "some text"}])
    ids, plen = load_job_samples(job_for(t, "text", text_field="body"), tok).samples[0]
    assert plen == 0 and ids == [256, *b"some text", 257]


def test_parquet_and_csv(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"q": ["1+1=", "2+3="], "a": ["2", "5"]}), tmp_path / "d.parquet")
    tok = ByteTokenizer()
    data = load_job_samples(job_for(tmp_path / "d.parquet", prompt_field="q", response_field="a"), tok)
    assert [tok.decode(s) for s, _ in data.samples] == ["1+1=2", "2+3=5"]
    with open(tmp_path / "d.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerows([["prompt", "response"], ["7+8=", "15"], ["1,2=", "3"]])  # numbers stay strings
    data = load_job_samples(job_for(tmp_path / "d.csv"), tok)
    assert [tok.decode(s) for s, _ in data.samples] == ["7+8=15", "1,2=3"]
    # explicit file_type for an unusual extension
    write_jsonl(tmp_path / "d.data", [{"prompt": "a", "response": "b"}])
    assert load_job_samples(job_for(tmp_path / "d.data", file_type="jsonl"), tok).num_samples == 1


def test_truncate(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p=", "response": "r" * 50}])
    data = load_job_samples(job_for(p, max_seq_len=10, truncate=True), ByteTokenizer())
    assert data.lengths == [10] and data.num_truncated == 1 and data.samples[0][1] == 3


BAD_DATA = [
    ("missing-file", None, {}, ["job 'j'", "nope.jsonl", "file not found"]),
    ("empty-file", "", {}, ["job 'j'", "empty dataset"]),
    ("unreadable", '{"prompt": "a", "response": "b"}\n{"prompt": oops}\n', {},
     ["job 'j'", "cannot read", "line 2"]),
    ("missing-column", [{"prompt": "a", "answer": "b"}], {},
     ["no field 'response'", "dataset.response_field"]),
    ("missing-field-in-row", [{"prompt": "a", "response": "b"}, {"prompt": "c"}], {},
     ["row 1: missing field 'response'"]),
    ("wrong-type", [{"prompt": 5, "response": 6}], {}, ["row 0: field 'prompt': expected a string, got int"]),
    ("too-long", [{"prompt": "a", "response": "b"}, {"prompt": "x" * 40, "response": "y"}],
     {"max_seq_len": 16}, ["job 'j'", "sample 1", "43 tokens", "max_seq_len = 16", "truncate"]),
    ("no-response", [{"prompt": "a", "response": ""}], {}, ["row 0: no response tokens"]),
    ("prompt-fills-truncation", [{"prompt": "x" * 20, "response": "y"}], {"max_seq_len": 8, "truncate": True},
     ["sample 0", "no response tokens are left"]),
    ("chat-last-not-assistant", [{"messages": [{"role": "user", "content": "hi"}]}], {"fmt": "chat"},
     ["row 0: field 'messages'", "last message must have role 'assistant'"]),
    ("chat-missing-content", [{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}],
     {"fmt": "chat"}, ["row 0: field 'messages'", "message 0: missing field 'content'"]),
]


@pytest.mark.parametrize("case", BAD_DATA, ids=[c[0] for c in BAD_DATA])
def test_malformed_dataset_is_one_clear_error(tmp_path, case):
    _, content, kw, expected = case
    path = tmp_path / ("nope.jsonl" if content is None else "d.jsonl")
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        write_jsonl(path, content)
    kw = dict(kw)
    fmt = kw.pop("fmt", "prompt_response")
    with pytest.raises(DataError) as ei:
        load_job_samples(job_for(path, fmt, **kw), ByteTokenizer())
    msg = str(ei.value)
    assert isinstance(ei.value, ConfigError) and str(path.name) in msg
    for s in expected:
        assert s in msg, f"{s!r} not in {msg!r}"


def test_quickstart_datasets_are_short_and_valid():
    cfg = load_run_config(ROOT / "configs" / "quickstart.yaml")
    tok = build_tokenizer(cfg.tokenizer)
    for job in cfg.jobs:
        data = load_job_samples(job, tok)
        assert 200 <= data.num_samples <= 1000 and max(data.lengths) <= 40, job.name
        assert all(p < len(ids) for ids, p in data.samples)
        assert all(max(ids) < 512 for ids, _ in data.samples)  # fits the tiny model's vocab


# ----------------------------------------------------------------------------------------------- streams
def _drain(stream):
    return list(stream)


def test_stream_epochs_cover_every_sample_once():
    s = JobStream("a", num_samples=23, global_batch_size=5, seed=7, num_epochs=3)
    assert s.steps_per_epoch == 4 and s.total_steps == 12
    batches = _drain(s)
    assert len(batches) == 12 and s.next_global_batch() is None and s.finished and s.steps_done == 12
    for e in range(3):
        ids = [i for b in batches[e * 4:(e + 1) * 4] for i in b]
        assert len(ids) == len(set(ids)) == 20  # no duplicates, remainder (3) dropped
        assert ids == epoch_permutation(7, "a", e, 23)[:20].tolist()
    # epochs are reshuffled
    assert batches[0:4] != batches[4:8]


def test_stream_max_steps_and_both_limits():
    assert JobStream("a", 10, 3, 0, max_steps=7).total_steps == 7
    assert len(_drain(JobStream("a", 10, 3, 0, max_steps=7))) == 7
    assert JobStream("a", 10, 3, 0, max_steps=100, num_epochs=2).total_steps == 6
    assert JobStream("a", 10, 3, 0, max_steps=4, num_epochs=2).total_steps == 4
    with pytest.raises(ConfigError, match="global_batch_size: expected at most the number of samples"):
        JobStream("a", 4, 5, 0, max_steps=1)


def test_stream_determinism_and_independence():
    a1 = _drain(JobStream("sql", 50, 4, seed=1, max_steps=30))
    a2 = _drain(JobStream("sql", 50, 4, seed=1, max_steps=30))
    assert a1 == a2
    # another job's existence, size or interleaving does not change this job's order
    s, other = JobStream("sql", 50, 4, seed=1, max_steps=30), JobStream("chat", 77, 3, seed=1, max_steps=99)
    mixed = []
    for _ in range(30):
        for _ in range(3):
            other.next_global_batch()
        mixed.append(s.next_global_batch())
    assert mixed == a1
    # different job names / seeds give different orders
    assert _drain(JobStream("chat", 50, 4, seed=1, max_steps=30)) != a1
    assert _drain(JobStream("sql", 50, 4, seed=2, max_steps=30)) != a1
    # stable across processes and Python versions (crc32 + numpy PCG64, never hash()): pinned
    assert epoch_permutation(1234, "reverse", 0, 10).tolist() == [9, 1, 0, 6, 2, 5, 4, 3, 8, 7]
    assert epoch_permutation(1234, "reverse", 0, 10).tolist() == \
        np.random.default_rng([1234, zlib.crc32(b"reverse"), 0]).permutation(10).tolist()


def test_stream_state_dict_resume():
    full = _drain(JobStream("j", 17, 4, seed=3, num_epochs=5))
    for cut in (0, 1, 4, 5, 9, len(full)):
        s = JobStream("j", 17, 4, seed=3, num_epochs=5)
        head = [s.next_global_batch() for _ in range(cut)]
        state = json.loads(json.dumps(s.state_dict()))  # checkpoints are JSON-able
        r = JobStream("j", 17, 4, seed=3, num_epochs=5)
        r.load_state_dict(state)
        assert r.steps_done == cut and head + _drain(r) == full
    with pytest.raises(ConfigError,
                       match="cannot resume the data stream: the checkpoint has num_samples = 17"):
        JobStream("j", 18, 4, seed=3, num_epochs=5).load_state_dict(state)



def test_pad_to_multiple_adds_rows_of_no_adapter_no_loss_in_their_own_segment():
    from lorafusion.data.packing import pack_microbatch, pad_to_multiple

    b = pack_microbatch([("a", [5, 6, 7]), ("b", [8, 9])], prompt_lengths=[1, 0], row_ids=[3, 4])
    assert pad_to_multiple(b, 1) is b and pad_to_multiple(pad_to_multiple(b, 2), 2).num_tokens == 6
    p = pad_to_multiple(b, 4)
    assert p.num_tokens == 8 and p.tokens[0, :5].tolist() == b.tokens[0].tolist()
    assert p.cu_seqlens.tolist() == [0, 3, 5, 8] and p.position_ids[0, 5:].tolist() == [0, 1, 2]
    assert p.loss_mask[0, 5:].tolist() == [0.0] * 3 and p.loss_mask[0, :5].tolist() == b.loss_mask[0].tolist()
    assert p.routing.segments == b.routing.segments and p.routing.num_rows == 8
    assert list(p.routing.row_ids[:5]) == list(b.routing.row_ids)
    assert p.adapters == b.adapters and p.sample_adapter == b.sample_adapter

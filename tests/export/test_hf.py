"""Base and merged exports (HF format): a short preset run exported and loaded with transformers + peft; the
exported base is the base the run trained against, the merged model equals base + PEFT adapter (fp32)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runtime_utils import job_dict, train_inprocess, write_dataset, write_run

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _export(*args) -> int:
    from lorafusion.cli import main

    return main(["export", *map(str, args)])


@pytest.fixture(scope="module")
def run(tmp_path_factory, megatron_single):
    tmp = tmp_path_factory.mktemp("exp")
    a = job_dict("a", write_dataset(tmp / "d" / "a.jsonl", 1, rows=8), r=4, steps=2, lr=5e-2)
    a["lora"]["use_rslora"] = True  # scaling alpha/sqrt(r); all-linear: fused qkv and gate/up
    b = job_dict("b", write_dataset(tmp / "d" / "b.jsonl", 2, rows=8, kind="upper"), r=8, steps=2, lr=5e-2,
                 targets=["q_proj", "k_proj", "v_proj", "down_proj"])
    _, out = train_inprocess(write_run(tmp, [a, b], capacity=96))
    assert _export(out, "--base", "--out", out / "base") == 0  # where the adapters say their base is
    return tmp, out


def _ids(vocab=259):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))


def _hf(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def test_base_export_is_the_trained_base_and_adapters_load_in_peft(run):
    from lorafusion.core.arch import preset
    from lorafusion.data.tokenizer import ByteTokenizer
    from lorafusion.models.provider import build_model
    from lorafusion.export.peft import import_peft_adapter
    from test_peft_parity import ours_logits

    tmp, out = run
    base = out / "base"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in base.iterdir()}
    # the weights get the mode of every other file written there (safetensors itself creates 0600)
    assert ((base / "model.safetensors").stat().st_mode & 0o777
            == (base / "config.json").stat().st_mode & 0o777)
    for job in ("a", "b"):
        cfg = json.loads((out / "adapters" / job / "adapter_config.json").read_text())
        assert cfg["base_model_name_or_path"] == str(base.resolve())
    # the byte tokenizer as a HF tokenizer: the same ids
    tok = transformers.AutoTokenizer.from_pretrained(base)
    text = "reverse héllo:\n"
    assert tok(text, add_special_tokens=False).input_ids == ByteTokenizer().encode(text)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    assert tok.decode(ByteTokenizer().encode(text)) == text
    # base + PEFT adapter in transformers == the run's own model (rebuilt from the seed on the device type the
    # run drew it on, as its record says: CPU and CUDA draw different numbers) with that adapter, in plain
    # torch ops, on the GPU when there is one (Megatron moves a CPU model's RoPE there at its first forward)
    drawn = json.loads((out / "base_model.json").read_text())["init_device"]
    dev = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
           else torch.device("cpu"))
    ours = build_model(preset("tiny-llama"), seed=1234, device=dev if drawn == "cuda" else None,
                       fused_ops="off")
    ours = ours.to(dev).eval()
    ids = _ids()
    for job in ("a", "b"):
        pm = peft.AutoPeftModelForCausalLM.from_pretrained(out / "adapters" / job, dtype=torch.float32).eval()
        ref = pm(ids).logits
        with pm.disable_adapter():
            assert (pm(ids).logits - ref).abs().max() > 1e-3, "trained adapters change the logits"
        import_peft_adapter(ours, job, out / "adapters" / job)
        torch.testing.assert_close(ours_logits(ours, ids.to(dev), job).cpu(), ref, atol=1e-4, rtol=0)


def test_merged_equals_base_plus_peft_adapter(run):
    tmp, out = run
    ids = _ids()

    def peft_logits(job, dtype):  # a fresh base each time: PeftModel injects its layers into the one it gets
        return peft.PeftModel.from_pretrained(_hf(out / "base", dtype),
                                              out / "adapters" / job).eval()(ids).logits

    for job in ("a", "b"):
        assert _export(out, "--job", job, "--merged", "--out", tmp / f"merged_{job}") == 0
        got = _hf(tmp / f"merged_{job}")(ids).logits
        ref64 = peft_logits(job, torch.float64)  # the higher-precision reference
        peft32 = peft_logits(job, torch.float32)
        # the merged fp32 model is as close to it as base + adapter in fp32 (one more rounding of W + s·BA)
        err = (got.double() - ref64).abs().max().item()
        err_peft = (peft32.double() - ref64).abs().max().item()
        assert err <= 4 * err_peft + 1e-5, (err, err_peft)
        torch.testing.assert_close(got, peft32, atol=1e-4, rtol=0)


def test_export_never_deletes_and_bad_input_is_one_line(run, capfd):
    tmp, out = run
    (tmp / "taken").mkdir()
    (tmp / "taken" / "keep").write_text("x")
    cases = [
        ([out, "--base", "--out", tmp / "taken"], "--out already exists"),
        ([out, "--job", "a", "--merged", "--out", tmp / "taken"], "--out already exists"),
        ([out, "--base", "--job", "a", "--out", tmp / "n1"], "takes no --job"),
        ([out, "--merged", "--out", tmp / "n2"], "--merged needs --job"),
        ([out, "--job", "nope", "--merged", "--out", tmp / "n3"], "unknown job 'nope'; the run's jobs: a, b"),
        ([tmp / "missing", "--base", "--out", tmp / "n4"], "no such run directory"),
        ([tmp / "missing", "--job", "a", "--merged", "--out", tmp / "n5"], "no such directory"),
    ]
    for args, msg in cases:
        capfd.readouterr()
        assert _export(*args) == 2, args
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], (args, err)
    assert (tmp / "taken" / "keep").read_text() == "x"
    assert not any((tmp / f"n{i}").exists() for i in range(1, 6))
    # a user's own directory: never replaced
    assert _export(out, "--base", "--out", tmp / "taken", "--force") == 2
    assert ("not an earlier lorafusion export" in capfd.readouterr().err
            and (tmp / "taken" / "keep").read_text() == "x")
    assert _export(out, "--base", "--out", tmp / "b1") == 0
    assert _export(out, "--job", "a", "--merged", "--out", tmp / "b1",
                   "--force") == 0  # an earlier export: replaced
    assert (tmp / "b1" / "model.safetensors").is_file() and (tmp / "b1" / ".lorafusion-export.json").is_file()


def test_model_path_base_is_copied_and_merged_sharded(tmp_path, megatron_single):
    """A ``model.path`` run: adapters point at model.path, --base copies it, merging reads and writes
    shards."""
    from hf_utils import write_hf_checkpoint
    from lorafusion.core.arch import preset
    from lorafusion.core.lora import LoRASpec
    from lorafusion.layers import add_adapter
    from lorafusion.models.hf_import import build_model_from_hf
    from lorafusion.export.peft import export_peft_adapter
    from lorafusion.rundir.atomic import fill_dir_atomically
    from lorafusion.export.hf import base_reference, write_merged
    from test_peft_parity import randomize_adapters

    arch = preset("tiny-qwen2")  # qkv bias, tied embeddings
    hf = write_hf_checkpoint(arch, tmp_path / "hf", shards=2)
    model = build_model_from_hf(tmp_path / "hf")
    add_adapter(model, "j", LoRASpec(r=4, lora_alpha=16, target_modules=("all-linear",), use_rslora=True))
    randomize_adapters(model)
    run_dir = tmp_path / "run"
    cfg = SimpleNamespace(model=SimpleNamespace(path=str(tmp_path / "hf"), preset=None, dtype="float32",
                                                    base_precision="bf16"), seed=1,
                          tokenizer=SimpleNamespace(type="byte", path=None))
    ref = base_reference(cfg, run_dir, arch, None)
    assert ref == str((tmp_path / "hf").resolve())
    export_peft_adapter(model, "j", run_dir / "adapters" / "j", base_model=ref)
    assert _export(run_dir, "--base", "--out", tmp_path / "base") == 0
    assert {p.name for p in (tmp_path / "hf").iterdir()} <= {p.name for p in (tmp_path / "base").iterdir()}
    fill, _ = write_merged(run_dir, run_dir / "adapters" / "j", max_shard_bytes=100_000)
    fill_dir_atomically(tmp_path / "merged", fill)
    assert (tmp_path / "merged" / "model.safetensors.index.json").is_file()
    ids = _ids(arch.vocab_size)
    ref_logits = peft.PeftModel.from_pretrained(hf, run_dir / "adapters" / "j").eval()(ids).logits
    torch.testing.assert_close(_hf(tmp_path / "merged")(ids).logits, ref_logits, atol=2e-5, rtol=0)
    assert Path(tmp_path / "base" / "model.safetensors.index.json").is_file()

"""``init_from`` in a job: training continues from a PEFT adapter (its settings fill the job's lora section);
a missing adapter or settings that disagree with it are one error naming the field, before any work."""

import json

import pytest

from runtime_utils import job_dict, load_adapter, train_inprocess, write_dataset, write_run


def test_a_job_continues_from_a_peft_adapter(tmp_path, megatron_single):
    data = write_dataset(tmp_path / "d" / "a.jsonl", 1)
    first = job_dict("a", data, r=4, steps=2, targets=["q_proj", "v_proj", "down_proj"])
    _, out = train_inprocess(write_run(tmp_path, [first], out="o1"))
    start = load_adapter(out, "a")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in start.items())
    # the next job names only the adapter: r, alpha and targets come from it; a tiny lr keeps it where it
    # began
    nxt = {k: v for k, v in job_dict("b", data, r=4, steps=1, lr=1e-12).items() if k != "lora"}
    nxt["init_from"] = str(out / "adapters" / "a")
    summary, out2 = train_inprocess(write_run(tmp_path, [nxt], out="o2"))
    assert summary["jobs"]["b"]["steps"] == 1
    got = load_adapter(out2, "b")
    assert got.keys() == start.keys()
    for k in start:
        assert (got[k] - start[k]).abs().max() <= 1e-9, k
    cfg = json.loads((out2 / "adapters" / "b" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["q_proj", "v_proj", "down_proj"] and cfg["r"] == 4


def test_init_from_errors_name_the_field(tmp_path):
    from lorafusion.config import load_run_config
    from lorafusion.core.errors import ConfigError

    data = write_dataset(tmp_path / "d" / "a.jsonl", 1)
    ad = tmp_path / "ad"
    ad.mkdir()
    job = dict(job_dict("a", data, r=8, steps=1), init_from=str(ad))
    with pytest.raises(ConfigError, match=r"run.yaml: jobs.0.init_from: expected a PEFT adapter directory, "
                                          r"adapter_config.json and adapter_model.safetensors not found"):
        load_run_config(write_run(tmp_path, [job]))
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                        "target_modules": ["q_proj", "v_proj"]}))
    (ad / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError,
                       match=r"run.yaml: jobs.0.lora.r: the adapter in init_from .* has 4, the job 8"):
        load_run_config(write_run(tmp_path, [job]))
    job["lora"] = {"lora_dropout": 0.1}  # the rest from the adapter
    cfg = load_run_config(write_run(tmp_path, [job]))
    assert (cfg.jobs[0].lora.r, cfg.jobs[0].lora.target_modules, cfg.jobs[0].lora.lora_dropout) == \
        (4, ("q_proj", "v_proj"), 0.1)
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                        "use_dora": True, "target_modules": ["q_proj"]}))
    with pytest.raises(ConfigError,
                       match=r"jobs.0.init_from: .*adapter_config.json: use_dora: expected False"):
        load_run_config(write_run(tmp_path, [job]))


def test_a_job_continues_from_an_adapter_peft_made_on_a_hf_model(tmp_path, megatron_single):
    """A PEFT adapter (all-linear, which PEFT writes out as module paths; its own A per projection) of a HF
    LLaMA directory: `lorafusion train` with init_from starts from it (a tiny lr keeps it there) and the job's
    exported adapter loads in PEFT with the same logits."""
    import copy

    import torch
    import yaml

    from hf_utils import write_hf_checkpoint
    from lorafusion.core.arch import ModelArch

    peft = pytest.importorskip("peft")
    arch = ModelArch(family="llama", vocab_size=300, hidden_size=48, num_layers=2, num_attention_heads=6,
                     num_query_groups=2, ffn_hidden_size=80, max_position_embeddings=256)
    hf = write_hf_checkpoint(arch, tmp_path / "base")
    torch.manual_seed(0)
    pm = peft.get_peft_model(copy.deepcopy(hf),
                             peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                              lora_dropout=0.0, init_lora_weights=False))
    pm.save_pretrained(tmp_path / "peft")
    job = {k: v for k, v in job_dict("p", write_dataset(tmp_path / "d" / "p.jsonl", 3), r=4, steps=1,
                                     lr=1e-12).items() if k != "lora"}
    job["init_from"] = str(tmp_path / "peft")
    run = write_run(tmp_path, [job], out="o")
    cfg = yaml.safe_load(run.read_text())
    cfg["model"] = {"path": str(tmp_path / "base"), "dtype": "float32"}
    run.write_text(yaml.safe_dump(cfg))
    summary, out = train_inprocess(run)
    assert summary["jobs"]["p"]["steps"] == 1
    start = load_file_dict(tmp_path / "peft")
    got = load_adapter(out, "p")
    assert got.keys() == start.keys() and len(got) == 2 * 7 * arch.num_layers
    for k in start:
        assert (got[k] - start[k]).abs().max() <= 1e-9, k
    ids = torch.randint(0, arch.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    again = peft.PeftModel.from_pretrained(copy.deepcopy(hf), out / "adapters" / "p").eval()
    torch.testing.assert_close(again(ids).logits, pm.eval()(ids).logits, rtol=0, atol=1e-6)


def load_file_dict(adapter_dir):
    from safetensors.torch import load_file

    return load_file(adapter_dir / "adapter_model.safetensors")

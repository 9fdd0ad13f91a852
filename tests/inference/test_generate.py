"""``lorafusion generate``: batched multi-adapter decoding with a KV cache.

Run directories are laid out as ``lorafusion train`` leaves them (PEFT adapters under ``adapters/<job>``,
checkpoints written by the trainer's own checkpoint writer) without training, so the tests stay fast:
(1) greedy output equals transformers + PEFT greedy ``generate`` for two adapters and the base decoded in one
batch; (2) KV-cache decoding equals full recomputation token for token (greedy and seeded sampling), a
preset base is rebuilt from the run's seed, and the training path is untouched afterwards; (3) bad input is
one error line and exit 2.
"""

import copy
import json

import pytest
import torch

from hf_utils import write_hf_checkpoint
from lorafusion.cli import main
from lorafusion.core.arch import preset
from lorafusion.core.lora import LoRASpec
from lorafusion.layers import adapter_parameters, add_adapter, lora_modules
from lorafusion.checkpoint.format import save_job_checkpoint
from lorafusion.export.peft import export_peft_adapter, peft_adapter_snapshot

peft = pytest.importorskip("peft")

ARCH = preset("tiny-llama")
SPECS = {"alpha": LoRASpec(r=4, lora_alpha=8, target_modules=("all-linear",)),
         "beta": LoRASpec(r=8, lora_alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "down_proj"))}
EOS = 257  # the byte tokenizer's
# where `lorafusion generate` builds its model (the GPU when there is one): a preset base drawn there is the
# one a run drawn there trained against (CPU and CUDA draw different numbers from one seed)
DEV = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Decoding is many small ops: on a busy 2-core machine (pytest -n 2) a second intra-op thread per worker
    spins far more than it helps (tens of seconds instead of one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _randomize(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, mod in lora_modules(model):
            for name in sorted(mod.lora_B):
                mod.lora_B[name].copy_(torch.randn(mod.lora_B[name].shape, generator=gen) * 0.3)


def _write_run(model, run, base_ref: str, seed: int):
    """A run directory as the trainer writes it: final adapters + one checkpoint per job."""
    for name in SPECS:
        export_peft_adapter(model, name, run / "adapters" / name, base_model=base_ref)
        state = {"job": name, "step": 3, "seed": seed,
                 "settings": {"(run) seed": seed, "(run) model.dtype": "float32",
                              "(run) tokenizer.type": "byte"}}
        save_job_checkpoint(run / "checkpoints" / name, 3, adapter_params=adapter_parameters(model, name),
                            optimizer_state={}, state=state,
                            adapter=peft_adapter_snapshot(model, name, base_model=base_ref))
    (run / "summary.json").write_text(
        json.dumps({"status": "done", "jobs": {n: {"status": "done"} for n in SPECS}}))


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, megatron_single):
    from lorafusion.models.hf_import import build_model_from_hf

    d = tmp_path_factory.mktemp("gen_hf")
    hf = write_hf_checkpoint(ARCH, d / "base")
    model = build_model_from_hf(d / "base")
    for i, (name, spec) in enumerate(SPECS.items()):
        add_adapter(model, name, spec, seed=i)
    _randomize(model)
    _write_run(model, d / "run", str(d / "base"), seed=7)
    return hf, d


@pytest.fixture(scope="module")
def preset_run(tmp_path_factory, megatron_single):
    from lorafusion.models.provider import build_model

    d = tmp_path_factory.mktemp("gen_preset")
    model = build_model(ARCH, seed=1234, device=DEV)
    for i, (name, spec) in enumerate(SPECS.items()):
        add_adapter(model, name, spec, seed=i)
    _randomize(model, seed=1)
    _write_run(model, d / "run", "tiny-llama", seed=1234)
    return model.eval(), d


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_greedy_equals_transformers_peft_for_two_adapters_and_the_base_in_one_batch(hf_run, tmp_path, capsys):
    hf, d = hf_run
    rows = [{"prompt": "reverse abc:", "job": "alpha", "id": 0}, {"prompt": "reverse abc:", "job": "beta"},
            {"prompt": "reverse abc:", "job": None}, {"prompt": "upper hello there:", "job": "alpha"},
            {"prompt": "x"}, {"prompt": "the base again, a longer prompt", "job": "beta"}]
    out = tmp_path / "out.jsonl"
    assert main(["generate", str(d / "run"), "--prompts", str(_jsonl(tmp_path / "p.jsonl", rows)),
                 "--out", str(out), "--max-new-tokens", "10"]) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [{k: g[k] for k in r} for g, r in zip(got, rows)] == rows  # input fields kept, in order
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), d / "run" / "adapters" / "alpha",
                                        adapter_name="alpha")
    pm.load_adapter(d / "run" / "adapters" / "beta", adapter_name="beta")
    pm.eval()
    for g in got:
        ids = torch.tensor([g["prompt_ids"]])
        assert g["prompt_ids"][0] == 256 and bytes(g["prompt_ids"][1:]).decode() == g["prompt"]
        kw = dict(max_new_tokens=10, do_sample=False, num_beams=1, eos_token_id=EOS, pad_token_id=258)
        if g.get("job"):
            pm.set_adapter(g["job"])
            ref = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        else:
            ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        assert g["output_ids"] == ref[0, ids.shape[1]:].tolist(), g
        assert g["output"] == bytes(t for t in g["output_ids"] if t < 256).decode("utf-8", errors="replace")
    same = [g["output_ids"] for g in got[:3]]
    assert len({tuple(s) for s in same}) == 3, "the adapters must change the greedy output here"
    assert "generated" in capsys.readouterr().err


def test_kv_cache_equals_full_recompute_and_leaves_training_untouched(preset_run):
    from lorafusion.layers import lora_batch
    from lorafusion.inference.kv_cache import attention_modules, rope_positions
    from lorafusion.inference.generate import Request, build_run_model, generate_ids, load_run

    trained, d = preset_run
    info = load_run(d / "run")
    assert (info.preset, info.seed, sorted(info.adapters)) == ("tiny-llama", 1234, ["alpha", "beta"])
    model = build_run_model(info, ["alpha", "beta"])
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(9)[None]

    def logits(m, name):
        from lorafusion.core.routing import Routing

        dev = next(m.parameters()).device
        with lora_batch(m, Routing.single(9), [name]):
            return m(ids.to(dev), pos.to(dev), attention_mask=None)

    # the base rebuilt from the run's seed and the imported adapter are the trained model
    torch.testing.assert_close(logits(model, "alpha"), logits(trained, "alpha"), rtol=0, atol=1e-5)
    before = logits(model, "beta")

    prompts = [[256, *b"abc"], [256, *b"a much longer prompt"], [256, *b"q"], [256, *b"hello"], [256, *b"zz"]]
    jobs = ["beta", "alpha", None, "alpha", "beta"]

    def run(use_cache, eos=-1, **kw):
        reqs = [Request({}, j, p, "") for j, p in zip(jobs, prompts)]
        generate_ids(model, reqs, eos_id=eos, max_new_tokens=12, context=ARCH.max_position_embeddings,
                     use_cache=use_cache, **kw)
        return [r.output_ids for r in reqs]

    ref = run(False)
    assert run(True) == ref and all(len(o) == 12 for o in ref)
    eos = ref[1][3]  # a token that ends some sequences early while others go on
    ref_eos = run(False, eos)
    assert run(True, eos) == ref_eos and len({len(o) for o in ref_eos}) > 1
    sampled = run(False, temperature=0.9, top_p=0.9, seed=5)
    assert run(True, temperature=0.9, top_p=0.9, seed=5) == sampled != ref
    assert all(m.kv_cache is None for m in attention_modules(model))
    assert rope_positions(model.config) is None
    torch.testing.assert_close(logits(model, "beta"), before, rtol=0, atol=0)


def test_run_record_and_adapter_choice(preset_run, tmp_path):
    """RUN_DIR/base_model.json (a run's record of its base), when present, is what rebuilds the base; a job
    that did not finish decodes with its latest checkpoint's adapter, as `lorafusion export` picks."""
    import shutil

    from lorafusion.inference.generate import load_run

    _, d = preset_run
    run = tmp_path / "run"
    shutil.copytree(d / "run", run)
    record = {"preset": "tiny-llama", "path": None, "seed": 1234, "dtype": "float32", "init_device": "cpu",
              "base_precision": "fp8", "tokenizer": {"type": "byte", "path": None}}
    (run / "base_model.json").write_text(json.dumps(record))
    (run / "summary.json").write_text(
        json.dumps({"jobs": {"alpha": {"status": "stopped"}, "beta": {"status": "done"}}}))
    info = load_run(run)
    assert ((info.preset, info.seed, info.base_precision, info.init_device)
            == ("tiny-llama", 1234, "fp8", "cpu"))
    # a record that says another seed or dtype than the run's checkpoints recorded (edited, or of another run)
    # would rebuild another base than the adapters were trained on: refused
    from lorafusion.rundir.integrity import DamagedFileError

    for key, value in (("seed", 99), ("dtype", "bfloat16")):
        (run / "base_model.json").write_text(json.dumps({**record, key: value}))
        with pytest.raises(DamagedFileError, match=f"base_model.json: (model.)?{key} is {value!r}, but the "
                                                   "run trained"):
            load_run(run)
    (run / "base_model.json").write_text(json.dumps(record))
    assert info.adapters == {"alpha": run / "checkpoints" / "alpha" / "step_000003" / "adapter",
                             "beta": run / "adapters" / "beta"}
    # every job that ended early decodes with the adapter it ended with, as export picks it (one rule for
    # both)
    from lorafusion.rundir.adapters import find_adapter

    if not (run / "adapters" / "alpha").is_dir():  # the adapter it ended with (any adapter files serve here)
        shutil.copytree(run / "adapters" / "beta", run / "adapters" / "alpha")
    for status in ("early_stopped", "cancelled", "diverged"):
        (run / "summary.json").write_text(json.dumps({"jobs": {"alpha": {"status": status}}}))
        assert load_run(run).adapters["alpha"] == find_adapter(run, "alpha")[0] == run / "adapters" / "alpha"


@pytest.mark.parametrize("case",
                         ["unknown_job", "empty_prompt", "too_long", "missing_run",
                          "malformed", "out_exists"])
def test_bad_input_is_one_error_line_and_exit_2(preset_run, tmp_path, capsys, case):
    _, d = preset_run
    run, out = d / "run", tmp_path / "out.jsonl"
    good = {"prompt": "hi", "job": "alpha"}
    rows, expect = {
        "unknown_job": ([good, {"prompt": "hi", "job": "gamma"}], "p.jsonl:2: job 'gamma' is not a job of"),
        "empty_prompt": ([{"prompt": "", "job": "beta"}], "p.jsonl:1: the prompt is empty"),
        "too_long": ([good, good, {"prompt": "x" * 1100}], "p.jsonl:3: the prompt has 1101 tokens; the "
                                                            "model's context is 1024"),
        "missing_run": ([good], "no such run directory"),
        "malformed": ([good, '{"prompt": "hi", "job": '], "p.jsonl:2: not valid JSON"),
        "out_exists": ([good], "--out already exists"),
    }[case]
    if case == "missing_run":
        run = tmp_path / "nope"
    if case == "out_exists":
        out.write_text("keep me\n")
    code = main(
        ["generate", str(run), "--prompts", str(_jsonl(tmp_path / "p.jsonl", rows)), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("lorafusion generate: error: "), err
    assert expect in err[0], err[0]
    assert out.read_text() == "keep me\n" if case == "out_exists" else not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU takes --decode graph")
def test_decode_graph_without_a_gpu_is_an_error_not_something_else(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    code = main(
        ["generate", str(tmp_path / "run"), "--prompts",
         str(_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])), "--out", str(out), "--decode", "graph"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--decode graph: a CUDA graph needs a CUDA GPU" in err[0], err
    assert "--decode static" in err[0] and not out.exists()


def test_a_checkpoint_pruned_between_lookup_and_load_is_looked_up_again(preset_run, tmp_path):
    """On a live run, generate failed ("step_…/adapter_config.json: missing") when the checkpoint it had
    picked was pruned before it was loaded: it now looks the adapter up again and takes the newer one."""
    import shutil

    from lorafusion.inference.generate import build_run_model, load_run

    _, d = preset_run
    run = tmp_path / "run"
    shutil.copytree(d / "run", run)
    info = load_run(run)
    # (picked, then pruned)
    info.adapters["alpha"] = run / "checkpoints" / "alpha" / "step_000001" / "adapter"
    build_run_model(info, ["alpha"])
    assert info.adapters["alpha"] == run / "adapters" / "alpha"

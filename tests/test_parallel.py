"""TP=2 and PP=2 (two gloo processes, 1F1B) equal the single-process model: losses and every LoRA grad."""

import json
import sys
from pathlib import Path

import pytest
import torch

from hf_utils import write_hf_checkpoint
from lorafusion.core.lora import LoRASpec
from lorafusion.layers import add_adapter
from lorafusion.models.hf_import import build_model_from_hf
from lorafusion.core.arch import ModelArch
from lorafusion.export.peft import adapter_peft_state, export_peft_adapter
from model_utils import randomize_b
from session_shared import launch_in_turn, shared_dir

pytestmark = pytest.mark.slow
ARCH = ModelArch(family="qwen2", vocab_size=128, hidden_size=48, num_layers=4, num_attention_heads=4,
                 num_query_groups=2, ffn_hidden_size=96, qkv_bias=True, max_position_embeddings=256)
SPECS = {
    "a": LoRASpec(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=("all-linear",)),
    "b": LoRASpec(r=8, lora_alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "down_proj")),
    "c": LoRASpec(r=2, lora_alpha=4, lora_dropout=0.3, target_modules=("o_proj", "gate_proj", "up_proj")),
    # PEFT's A per projection on a subset of the fused linears (GQA-interleaved q/v rows, gate rows)
    "d": LoRASpec(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=("q_proj", "v_proj", "gate_proj")),
    "e": LoRASpec(r=3, lora_alpha=6, target_modules=("all-linear",), shared_fused_a=True),
}


def _tok(seed, n):
    return torch.randint(0, ARCH.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


MBS = [
    {"samples": [["a", _tok(1, 9)], ["b", _tok(2, 7)], ["c", _tok(3, 5)], ["d", _tok(10, 6)]],
     "row_ids": [0, 1, 2, 9]},
    {"samples": [["a", _tok(4, 4)], ["c", _tok(5, 11)], ["e", _tok(11, 4)]], "row_ids": [3, 4, 10]},
    {"samples": [["b", _tok(6, 13)]], "row_ids": [5]},
    {"samples": [["c", _tok(7, 6)], ["d", _tok(12, 4)], ["b", _tok(8, 3)], ["e", _tok(13, 2)],
                 ["a", _tok(9, 8)]],
     "row_ids": [6, 11, 7, 12, 8]},
]


# fused ops ("torch": fused RMSNorm / SwiGLU / packed RoPE; at TP=2 Megatron's vocab-parallel loss, at PP=2
# the fused loss on the last stage) against the same single-process model with Megatron's ops
FUSED = ["off", "torch"]
MODES = ["tp", "tpsp", "pp"]
# TP collectives overlapped with compute (parallelism.tp_overlap, 3 nano-batches a linear): without and with
# sequence parallelism, and with SP and full activation recompute
OVERLAP = ["tpo:off", "tpspo:off", "tpspo:torch", "tpspo_rc:torch"]


def _build_and_launch(d: Path) -> None:
    """The base checkpoint, the adapters and the microbatches (with each adapter's token count over all of
    them) in ``d``; then one two-process launch of parallel_worker.py runs every configuration (mode × fused
    ops) in turn (after one that fails, a new launch runs the rest), and each test below checks its own.
    (One launch, not six: starting a process pair costs more than the model runs.)"""
    write_hf_checkpoint(ARCH, d / "base")
    model = build_model_from_hf(d / "base")
    for i, (n, s) in enumerate(SPECS.items()):
        add_adapter(model, n, s, seed=i)
    randomize_b(model, seed=1)
    for n in SPECS:
        export_peft_adapter(model, n, d / "adapters" / n)
    (d / "shared_a.json").write_text(json.dumps([n for n, s in SPECS.items() if s.shared_fused_a]))
    denom = {n: 0 for n in SPECS}
    from parallel_worker import microbatches

    (d / "batches.json").write_text(json.dumps({"mbs": MBS, "denom": {}}))
    mbs, _ = microbatches(d)
    for b in mbs:
        for n in b.adapters:
            denom[n] += float((b.adapter_token_mask(n).float() * b.loss_mask).sum())
    (d / "batches.json").write_text(json.dumps({"mbs": MBS, "denom": denom}))
    launch_in_turn([sys.executable, str(Path(__file__).parent / "parallel_worker.py"), str(d)],
                   [f"{m}:{f}" for m in MODES for f in FUSED] + OVERLAP, d, timeout=400)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, megatron_single):
    """(the launch's directory, once per session for all xdist workers; single-process losses, LoRA grads and
    per-token losses of the same exported adapters and microbatches)"""
    d = shared_dir(tmp_path_factory, "parallel", _build_and_launch)
    from lorafusion.export.peft import import_peft_adapter
    from model_utils import per_token_loss
    from parallel_worker import import_spec, loss_terms, microbatches

    mbs, spec = microbatches(d)
    ref = build_model_from_hf(d / "base")
    for n in SPECS:
        import_peft_adapter(ref, n, d / "adapters" / n, spec=import_spec(d, n))
    assert [n for n in SPECS if n in ref.decoder.layers[0].mlp.linear_fc1.lora_A
            and n not in ref.decoder.layers[0].mlp.linear_fc1.lora_proj] == ["e"]
    ref.train()
    losses, per_token = [], []
    for b in mbs:
        loss = per_token_loss(ref, b)
        total = loss_terms(loss, b, spec["denom"])
        total.backward()
        losses.append(total.item())
        per_token.append(loss.detach()[0].clone())
    grads = {n: adapter_peft_state(ref, n, ARCH, grad=True) for n in SPECS}
    return d, losses, grads, per_token


def _result(d: Path, mode: str, fused: str, name: str) -> Path:
    """d/name written by the configuration ``mode:fused`` of the launch, or the failure of that
    configuration."""
    tag = "" if fused == "off" else f"_{fused}"
    err = d / f"{mode}{tag}_error.txt"
    assert not err.exists(), err.read_text()[-4000:]
    assert (d / name).exists(), f"{name} missing\n" + "\n".join(
        f"--- rank {r}:\n" + (d / f"rank{r}.log").read_text().partition(f"=== {mode}:{fused}\n")[2][-3000:]
        for r in range(2))
    return d / name


def _assert_grads_equal(got, want):
    for n in want:
        assert got[n].keys() == want[n].keys()
        for k in want[n]:
            scale = want[n][k].abs().max().clamp_min(1e-8)
            assert (got[n][k] - want[n][k]).abs().max() / scale <= 1e-5, (n, k)


@pytest.mark.parametrize("fused", FUSED)
def test_tensor_parallel_2_equals_single_process(workdir, fused):
    d, losses, grads, _ = workdir
    res = torch.load(_result(d, "tp", fused, "tp_result.pt" if fused == "off" else f"tp_{fused}_result.pt"))
    assert res["losses"] == pytest.approx(losses, rel=1e-5)
    _assert_grads_equal(res["grads"], grads)


@pytest.mark.parametrize("fused", FUSED)
def test_pipeline_parallel_2_1f1b_equals_single_process(workdir, fused):
    d, losses, grads, _ = workdir
    tag = "" if fused == "off" else f"_{fused}"
    assert json.loads(_result(d, "pp", fused, f"pp{tag}_losses.json").read_text()) == \
        pytest.approx(losses, rel=1e-5)
    res = torch.load(_result(d, "pp", fused, f"pp{tag}_result.pt"))
    _assert_grads_equal(res["grads"], grads)


@pytest.mark.parametrize("fused", FUSED)
def test_tensor_parallel_2_with_sequence_parallelism_equals_single_process(workdir, fused):
    """TP=2 + SP: every microbatch has an odd token count (padded to even), several adapters, dropout on;
    per-token losses of the real tokens and every LoRA gradient equal the single process."""
    d, losses, grads, ref_per_token = workdir
    assert all(sum(len(s[1]) for s in mb["samples"]) % 2 for mb in MBS)  # the padding is exercised
    res = torch.load(
        _result(d, "tpsp", fused, "tpsp_result.pt" if fused == "off" else f"tpsp_{fused}_result.pt"))
    assert res["losses"] == pytest.approx(losses, rel=1e-5)
    for got, want in zip(res["per_token"], ref_per_token, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    _assert_grads_equal(res["grads"], grads)


@pytest.mark.parametrize("config", OVERLAP)
def test_tensor_parallel_2_with_overlapped_collectives_equals_single_process(workdir, config):
    """``tp_overlap`` (every TP linear's collectives in flight while the GEMM of another nano-batch runs; the
    worker checks every decoder linear took that path): losses, per-token losses (SP) and every adapter's
    gradient equal the single process, as TP=2 without overlap does, with and without SP and recompute."""
    d, losses, grads, ref_per_token = workdir
    mode, fused = config.split(":")
    tag = "" if fused == "off" else f"_{fused}"
    res = torch.load(_result(d, mode, fused, f"{mode}{tag}_result.pt"))
    assert res["losses"] == pytest.approx(losses, rel=1e-5)
    for got, want in zip(res["per_token"], ref_per_token if mode.startswith("tpsp") else [], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    _assert_grads_equal(res["grads"], grads)


def test_stage_layers_split_the_decoder_unevenly():
    """``parallelism.stage_layers`` → Megatron's first/last-stage layer counts: each stage builds its share at
    its global offset (which layer numbers, hence names and HF weights, it holds); bad splits are one clear
    error."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from lorafusion.core.arch import preset
    from lorafusion.core.errors import ConfigError
    from lorafusion.models.spec import transformer_config

    arch = preset("tiny-llama")  # 4 decoder layers
    for split, pp in (([3, 1], 2), ([1, 2, 1], 3), ([2, 1, 1], 3)):
        cfg = transformer_config(arch, pp=pp, stage_layers=split)
        assert [get_num_layers_to_build(cfg, pp_rank=r) for r in range(pp)] == split
        assert [get_transformer_layer_offset(cfg, pp_rank=r)
                for r in range(pp)] == [sum(split[:r]) for r in range(pp)]
    assert transformer_config(arch, pp=2, stage_layers=[2, 2]).num_layers_in_first_pipeline_stage is None
    for bad in ([2, 1], [4, 0], [3, 2], [1, 1]):  # ([1, 1]: even, but not the model's 4 layers)
        with pytest.raises(ConfigError, match="parallelism.stage_layers: expected 2 counts >= 1 summing to "
                                              "num_layers=4"):
            transformer_config(arch, pp=2, stage_layers=bad)
    with pytest.raises(ConfigError, match="more than the 3 decoder layers"):
        transformer_config(arch, pp=2, stage_layers=[3, 1], recompute=True, recompute_layers=4)


def test_virtual_stage_layers_become_megatrons_layout():
    """With virtual_stages V, ``stage_layers`` counts per virtual stage in layer order (stage c·pp + r is
    chunk c of rank r): an uneven split becomes Megatron's pipeline_model_parallel_layout (embedding first,
    loss last), an even one its default; interleaving sends each p2p direction alone (a PP=2 ring would cross
    them)."""
    from megatron.core.transformer.enums import LayerType

    from lorafusion.core.arch import preset
    from lorafusion.core.errors import ConfigError
    from lorafusion.models.spec import transformer_config

    arch = preset("tiny-llama", num_layers=10)
    split = [2, 1, 1, 1, 1, 1, 2, 1]
    cfg = transformer_config(arch, pp=4, virtual_stages=2, stage_layers=split)
    layout = cfg.pipeline_model_parallel_layout
    assert cfg.virtual_pipeline_model_parallel_size == 2 and (cfg.overlap_p2p_comm,
                                                              cfg.batch_p2p_comm) == (False, False)
    assert [[layout.layout[r][c].count(LayerType.decoder) for r in range(4)]
            for c in range(2)] == [split[:4], split[4:]]
    assert layout.layout[0][0][0] == LayerType.embedding and layout.layout[3][1][-1] == LayerType.loss
    even = transformer_config(preset("tiny-llama"), pp=2, virtual_stages=2)
    assert even.pipeline_model_parallel_layout is None and even.virtual_pipeline_model_parallel_size == 2
    # V = 1 with unequal middle stages: the layout too (first/last counts cannot say it)
    assert transformer_config(arch, pp=4,
                              stage_layers=[2, 3, 4, 1]).pipeline_model_parallel_layout is not None
    with pytest.raises(ConfigError, match=r"expected 8 counts >= 1 \(one per virtual stage"):
        transformer_config(arch, pp=4, virtual_stages=2, stage_layers=[3, 3, 2, 2])
    with pytest.raises(ConfigError, match="virtual_stages: pp x virtual_stages = 8 must divide "
                                          "num_layers=10"):
        transformer_config(arch, pp=4, virtual_stages=2)
    with pytest.raises(ConfigError,
                       match=r"more than the 2 decoder layers of a pipeline stage \(model chunk\)"):
        transformer_config(arch, pp=4, virtual_stages=2, stage_layers=split, recompute=True,
                           recompute_layers=3)

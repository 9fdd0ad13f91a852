"""The static decode step (``lorafusion.inference.static_decode``): on CPU it runs eagerly and must give the
dynamic step's tokens and logits (several adapters and base rows, rows ending at different steps, batch sizes
1 / 3 / 8, prompts of different lengths, greedy and seeded sampling); on a GPU the CUDA graph's replay must
give the eager static step's tokens and logits, with no capture fallback."""

import warnings

import pytest
import torch

from lorafusion.core.arch import preset
from lorafusion.core.lora import LoRASpec
from lorafusion.inference.static_decode import GraphCaptureWarning
from lorafusion.layers import add_adapter, lora_modules

ARCH = preset("tiny-llama")
SPECS = {"alpha": LoRASpec(r=4, lora_alpha=8, target_modules=("all-linear",)),
         "beta": LoRASpec(r=8, lora_alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "down_proj"))}
PROMPTS = [[256, *b"abc"], [256, *b"a much longer prompt here"], [256, *b"q"], [256, *b"hello"],
           [256, *b"zz"], [256, *b"seven!!"], [256, *b"an even longer prompt than the others"], [256, *b"xy"]]
JOBS = ["beta", "alpha", None, "alpha", "beta", None, "alpha", "beta"]
NEW = 10


def _model(device, dtype=torch.float32):
    from lorafusion.models.provider import build_model

    model = build_model(ARCH, seed=1234, device=device, params_dtype=dtype)
    for i, (name, spec) in enumerate(SPECS.items()):
        add_adapter(model, name, spec, seed=i)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, mod in lora_modules(model):
            for name in sorted(mod.lora_B):
                mod.lora_B[name].copy_(torch.randn(mod.lora_B[name].shape, generator=gen) * 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def cpu_model(megatron_single):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _model(None)
    torch.set_num_threads(before)


def _run(model, batch, decode, monkeypatch, eos=-1, **kw):
    """(output ids per row, the logits of the live rows at every step) of one generate_ids call."""
    from lorafusion.inference import generate as G
    from lorafusion.inference import sampling
    from lorafusion.inference import static_decode as S

    seen = []
    monkeypatch.undo()  # (pick_tokens unwrapped again)

    def recording_pick(logits, *args):
        seen.append(logits.detach().clone().cpu())
        return sampling.pick_tokens(logits, *args)

    monkeypatch.setattr(G, "pick_tokens", recording_pick)  # the prefill and the dynamic steps
    monkeypatch.setattr(S, "pick_tokens", recording_pick)  # the static steps
    reqs = [G.Request({}, j, p, "") for j, p in zip(JOBS[:batch], PROMPTS[:batch])]
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=GraphCaptureWarning)
        G.generate_ids(model, reqs, eos_id=eos, max_new_tokens=NEW, context=ARCH.max_position_embeddings,
                       decode=decode, **kw)
    return [r.output_ids for r in reqs], seen


def _same(a, b, atol):
    (ta, la), (tb, lb) = a, b
    assert ta == tb
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_static_step_equals_the_dynamic_step_greedy_with_rows_ending_early(cpu_model, monkeypatch, batch):
    ref = _run(cpu_model, batch, "dynamic", monkeypatch)
    assert all(len(o) == NEW for o in ref[0])
    _same(_run(cpu_model, batch, "static", monkeypatch), ref, atol=1e-4)
    _same(_run(cpu_model, batch, "graph", monkeypatch), ref, atol=1e-4)  # no GPU: the same step, eagerly
    eos = ref[0][-1][3]  # a token that ends some rows early while others go on
    ref_eos = _run(cpu_model, batch, "dynamic", monkeypatch, eos=eos)
    if batch > 1:
        assert len({len(o) for o in ref_eos[0]}) > 1
    _same(_run(cpu_model, batch, "static", monkeypatch, eos=eos), ref_eos, atol=1e-4)


def test_static_step_equals_the_dynamic_step_sampling_and_at_the_context_limit(cpu_model, monkeypatch):
    kw = dict(temperature=0.9, top_p=0.9, seed=5)
    ref = _run(cpu_model, 8, "dynamic", monkeypatch, **kw)
    _same(_run(cpu_model, 8, "static", monkeypatch, **kw), ref, atol=1e-4)
    assert ref[0] != _run(cpu_model, 8, "dynamic", monkeypatch)[0]
    # rows limited by the context (one with no room at all) next to rows that are not
    from lorafusion.inference import generate as G

    ctx = len(PROMPTS[1]) + 4  # row 1: 4 tokens of room; row 6: none (its prompt is longer than that)
    out = {}
    for decode in ("dynamic", "static"):
        reqs = [G.Request({}, j, p, "") for j, p in zip(JOBS[:7], PROMPTS[:7])]
        G.generate_ids(cpu_model, reqs, eos_id=-1, max_new_tokens=NEW, context=ctx, decode=decode)
        out[decode] = [r.output_ids for r in reqs]
    assert out["static"] == out["dynamic"] and out["static"][6] == [] and len(out["static"][1]) == 4
    assert [len(o) for o in out["static"]] == [max(0, min(NEW, ctx - len(p))) for p in PROMPTS[:7]]


def test_static_decode_leaves_the_model_as_it_was(cpu_model):
    from lorafusion.inference.generate import DECODE_MODES, Request, generate_ids
    from lorafusion.inference.kv_cache import attention_modules, rope_positions
    from lorafusion.core.errors import ConfigError

    outs = {}
    for decode in ("static", "dynamic"):  # base rows only: no LoRA segment at all
        reqs = [Request({}, None, p, "") for p in PROMPTS[:3]]
        generate_ids(cpu_model, reqs, eos_id=-1, max_new_tokens=3, context=64, decode=decode)
        outs[decode] = [r.output_ids for r in reqs]
    assert outs["static"] == outs["dynamic"]
    assert all(m.kv_cache is None for m in attention_modules(cpu_model))
    assert rope_positions(cpu_model.config) is None
    assert cpu_model.lora_context.routing is None
    with pytest.raises(ConfigError, match="decode: expected one of"):
        generate_ids(cpu_model, [Request({}, None, PROMPTS[0], "")], eos_id=-1, max_new_tokens=3, context=64,
                     decode="fast")
    assert "graph" in DECODE_MODES


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_equals_the_eager_static_step(megatron_single, monkeypatch, dtype):
    model = _model(torch.device("cuda", torch.cuda.current_device()), dtype)
    # (the same kernels: equal in practice; a margin for cuBLAS' choice)
    tol = 1e-5 if dtype == torch.float32 else 0.05
    for batch, kw in ((8, {}), (3, dict(temperature=0.8, top_p=0.95, seed=2))):
        eager = _run(model, batch, "static", monkeypatch, **kw)
        graph = _run(model, batch, "graph", monkeypatch, **kw)  # a capture failure fails the test (warning)
        _same(graph, eager, atol=tol)
    eos = eager[0][0][2]
    _same(_run(model, 8, "graph", monkeypatch, eos=eos),
          _run(model, 8, "static", monkeypatch, eos=eos), atol=tol)
    if dtype == torch.float32:  # the graph's greedy tokens and logits against the dynamic step's
        _same(_run(model, 8, "graph", monkeypatch), _run(model, 8, "dynamic", monkeypatch), atol=1e-4)


def test_the_static_step_reads_nothing_back_and_builds_no_host_tensor(cpu_model, monkeypatch):
    """What a CUDA graph capture of the step needs, checked on CPU at the dispatcher: after the first step
    (the warm-up before capture builds the LoRA tables), no op of the step reads a tensor value on the host
    (``.item()``, ``bool(t)``, ``.tolist()``, nonzero: each waits for the GPU, and capture refuses it) or
    makes a tensor from host data (``torch.tensor``: a copy from host memory, which capture would bake in)."""
    from dispatch_utils import HOST_READS, OpWatch

    from lorafusion.inference.generate import Request, generate_ids
    from lorafusion.inference.static_decode import StaticStep

    flagged = HOST_READS | {"aten.lift_fresh.default",
                            "aten._pin_memory.default"}  # (+ tensors from host data)
    seen: list[str] = []

    steps = []
    forward = StaticStep.forward

    def watched(self):
        if not steps:
            steps.append(forward(self))
            return steps[-1]
        with OpWatch(flagged, seen):
            steps.append(forward(self))
        return steps[-1]

    monkeypatch.setattr(StaticStep, "forward", watched)
    reqs = [Request({}, j, p, "") for j, p in zip(JOBS, PROMPTS)]
    generate_ids(cpu_model, reqs, eos_id=-1, max_new_tokens=4, context=64, decode="static")
    assert len(steps) == 3 and seen == []
    with OpWatch(flagged, seen):  # the watch itself sees both kinds
        float(torch.tensor([1.0]).sum())
    assert seen == ["aten.lift_fresh.default", "aten._local_scalar_dense.default"]

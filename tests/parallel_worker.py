"""Worker for multi-process (gloo) tests: ``python parallel_worker.py WORKDIR MODE:FUSED [MODE:FUSED ...]``
under RANK/WORLD_SIZE env: each configuration in turn, in this one process (one launch serves several tests).
FUSED is build_model's fused_ops ("off", "torch", ...; results of another than "off" carry its name).

MODE "tp": TP=2 forward+backward of packed microbatches; "tpsp": the same with sequence parallelism
(microbatches padded to an even token count; per-token losses saved too); "tpo" / "tpspo": the same with the
TP collectives overlapped (3 nano-batches a linear), "tpspo_rc" also with full activation recompute. MODE
"pp": PP=2, 1F1B via Megatron's ``get_forward_backward_func`` (its p2p shapes from the runtime's
``p2p_shapes``). Every configuration builds its model afresh
from WORKDIR; Megatron's parallel state is set up again when the layout changes (tp*: TP=2; pp: PP=2). Writes
the results of rank 0 (and the last stage) to WORKDIR. Prints ``=== MODE:FUSED`` before and ``=== MODE:FUSED
done`` after each configuration; one that raises writes ``MODE[_FUSED]_error.txt`` and ends the process (exit
status 1; the test relaunches the configurations after it).
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))


def microbatches(workdir: Path):
    from lorafusion.data import pack_microbatch

    spec = json.loads((workdir / "batches.json").read_text())
    return [pack_microbatch([tuple(s) for s in mb["samples"]], row_ids=mb["row_ids"])
            for mb in spec["mbs"]], spec


def import_spec(workdir: Path, name: str):
    """The LoRA settings to import adapter ``name`` with: its file's, with one shared A on the fused linears
    when WORKDIR/shared_a.json lists it (PEFT's files cannot say so), else None (the file's own)."""
    from lorafusion.core.lora import LoRASpec
    from lorafusion.export.peft import read_peft_adapter

    f = workdir / "shared_a.json"
    if not f.exists() or name not in json.loads(f.read_text()):
        return None
    return LoRASpec(
        **{**read_peft_adapter(workdir / "adapters" / name)[0].model_dump(), "shared_fused_a": True})


def loss_terms(loss, batch, denom):
    """Σ_a (adapter a's token-loss sum in this microbatch) / (adapter a's tokens over all microbatches)."""
    total = 0.0
    for name in batch.adapters:
        m = batch.adapter_token_mask(name).float() * batch.loss_mask
        total = total + (loss * m).sum() / denom[name]
    return total


def run_one(mode: str, fused: str, workdir: Path) -> None:
    """One configuration: build the model, import the adapters, forward+backward every microbatch, save."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from lorafusion.layers import lora_batch
    from lorafusion.models.hf_import import build_model_from_hf
    from lorafusion.dist import init_distributed
    from lorafusion.export.peft import adapter_peft_state, import_peft_adapter
    from model_utils import adapter_seed

    tag = "" if fused == "off" else f"_{fused}"
    tp, pp = (2, 1) if mode != "pp" else (1, 2)
    sp, nano = mode.startswith("tpsp"), (3 if mode in ("tpo", "tpspo", "tpspo_rc") else 0)
    init_distributed(tp, pp)
    model = build_model_from_hf(workdir / "base", fused_ops=fused, sequence_parallel=sp, tp_overlap=nano,
                                recompute=mode.endswith("_rc"))
    for name in sorted(os.listdir(workdir / "adapters")):
        import_peft_adapter(model, name, workdir / "adapters" / name, spec=import_spec(workdir, name))
    model.train()
    mbs, spec = microbatches(workdir)
    denom = spec["denom"]
    rank = torch.distributed.get_rank()
    out = {}

    if mode != "pp":
        from lorafusion.ops.saved import REBUILT
        from lorafusion.ops.tp_overlap import OVERLAPPED

        REBUILT["gathered"] = OVERLAPPED[0] = 0  # counted for this configuration alone
        losses, per_token = [], []
        for b in mbs:
            if sp:
                from lorafusion.data import pad_to_multiple

                n = b.num_tokens
                b = pad_to_multiple(b, tp)
            seeds = [adapter_seed(7, n) for n in b.adapters]
            with lora_batch(model, b.routing, b.adapters, seeds):
                loss = model(b.tokens, b.position_ids, attention_mask=None, labels=b.labels,
                             packed_seq_params=b.packed_seq_params())
            total = loss_terms(loss, b, denom)
            total.backward()
            losses.append(total.item())
            if sp:
                assert loss.shape[-1] == b.num_tokens and b.num_tokens % tp == 0
                per_token.append(loss.detach()[0, :n].clone())
        out["losses"] = losses
        out["per_token"] = per_token
        if sp:  # the column-parallel LoRA inputs were saved as sequence shards (or their norm), not gathered
            assert REBUILT["gathered"] > 0, REBUILT
        # every decoder linear of every microbatch overlapped (twice with recompute), none without tp_overlap
        want = len(mbs) * 4 * model.config.num_layers * (2 if mode.endswith("_rc") else 1) if nano else 0
        assert OVERLAPPED[0] == want, (OVERLAPPED, want)
    else:
        it = iter(mbs)

        def forward_step(data_iterator, model_):
            b = next(data_iterator)
            seeds = [adapter_seed(7, n) for n in b.adapters]
            with lora_batch(model_, b.routing, b.adapters, seeds):
                output = model_(b.tokens, b.position_ids, attention_mask=None, labels=b.labels,
                                packed_seq_params=b.packed_seq_params())

            def loss_func(loss):
                total = loss_terms(loss, b, denom)
                return total, torch.tensor(1, dtype=torch.int), {"loss": total.detach().clone()}

            return output, loss_func

        from megatron_patches import local_p2p_shapes

        from lorafusion.runtime.pipeline import p2p_shapes

        fb = get_forward_backward_func()
        # the p2p shapes from the microbatches, as the runtime gives them (megatron_patches/p2p.py)
        with local_p2p_shapes(p2p_shapes([model], mbs, lambda b: b.num_tokens, 1, forward_only=False)):
            res = fb(forward_step_func=forward_step, data_iterator=it, model=[model],
                     num_microbatches=len(mbs), seq_length=max(b.num_tokens for b in mbs), micro_batch_size=1,
                     forward_only=False)
        if parallel_state.is_pipeline_last_stage():
            (workdir / f"pp{tag}_losses.json").write_text(json.dumps([r["loss"].item() for r in res]))
    from lorafusion.ops.comm import sum_partial_grads

    # the gradients the TP linears leave partial over TP, summed as the optimizer step does
    summed = sum_partial_grads(list(model.parameters()), parallel_state.get_tensor_model_parallel_group())
    assert (summed > 0) == (mode != "pp"), summed
    grads = {n: adapter_peft_state(model, n, model.config.arch, grad=True)
             for n in sorted(os.listdir(workdir / "adapters"))}
    if rank == 0:
        out["grads"] = grads
        torch.save(out, workdir / f"{mode}{tag}_result.pt")


def main():
    workdir, configs = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    import traceback

    from lorafusion.dist import destroy_distributed

    for config in configs:
        mode, fused = config.split(":")
        print(f"=== {config}", flush=True)
        try:
            run_one(mode, fused, workdir)
        except Exception:
            text = traceback.format_exc()
            print(f"{text}\n=== {config} failed", flush=True)
            tag = "" if fused == "off" else f"_{fused}"
            (workdir / f"{mode}{tag}_error.txt").write_text(f"rank {os.environ.get('RANK', '0')}:\n{text}")
            sys.exit(1)  # the peer may be waiting in a collective of this configuration
        print(f"=== {config} done", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()

"""Static decode steps for ``lorafusion generate``: on CUDA one CUDA graph, replayed once per token.

After the packed prefill (:func:`lorafusion.inference.generate.generate_ids`), every decode step has the same
shape and the same tensors:

- one row per slot of the batch: rows that have finished are computed and ignored (their position stops
  moving, so they rewrite their own last cache row; no other row reads it);
- the LoRA routing of the whole batch (rows sorted by adapter: one segment per adapter) fixed for the decode,
  so the kernels' device tables are built once, by the first step, and kept by the model's table cache;
- tokens and positions in persistent device buffers, updated in place from a pinned host buffer
  (``copy_(non_blocking=True)``); the packed-sequence boundaries and RoPE length fixed (``max_len``);
- attention over the cache's whole ``max_len`` with a key mask built on the device from the positions
  (:meth:`lorafusion.inference.kv_cache.KVCache.static`).

Nothing in such a step reads a device value on the host, so on CUDA it is captured once in a
``torch.cuda.CUDAGraph`` (after warm-up steps on a side stream, PyTorch's recipe; a warm-up step rewrites the
first decode step's cache rows with the values that step writes anyway) and replayed per token. The host's
work per token is the two small copies, one replay and reading the picked tokens (one sync: it must see who
has finished). Sampling (temperature / top-p with per-row generators) runs outside the graph on its logits.

If the capture fails, one :class:`GraphCaptureWarning` and the same static step runs eagerly, as it does on a
CPU (where the tests compare it with the dynamic step: tokens and logits).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from lorafusion.core.routing import Routing
from lorafusion.inference.sampling import commit_tokens, pick_tokens
from lorafusion.layers import lora_batch
from lorafusion.ops.tables import to_device

WARMUP_STEPS = 2  # eager steps on the capture stream before capture (lazy init, Triton JIT, cuBLAS workspace)
GRAPH_BY_DEFAULT = True
"""Whether ``decode="auto"`` (generate's default) takes the graph on CUDA (on since its GPU tests and timing
ran; docs/BENCHMARKS.md: one H100, 8B shape, 8 rows: 476 tokens/s against the dynamic step's 80 and
transformers + PEFT's 149)."""


class GraphCaptureWarning(UserWarning):
    """CUDA graph capture of the decode step failed; decoding goes on with the same step run eagerly."""


def adapter_routing(jobs: Sequence[str | None], counts: Sequence[int]):
    """One LoRA segment per run of same-adapter sequences (base rows: no segment); (routing, adapters)."""
    names: list[str] = []
    segs, start = [], 0
    for job, n in zip(jobs, counts, strict=True):
        if job is not None:
            if job not in names:
                names.append(job)
            slot = names.index(job)
            if segs and segs[-1][0] == slot and segs[-1][1] + segs[-1][2] == start:
                segs[-1] = (slot, segs[-1][1], segs[-1][2] + n)
            else:
                segs.append((slot, start, n))
        start += n
    return Routing(segments=tuple(segs), num_rows=start), tuple(names)


class StaticStep:
    """One decode forward of every slot of ``cache`` (row ``i`` = slot ``i``, adapter ``jobs[i]``), called
    as ``step(tokens, positions)`` → logits [slots, vocab] (fp32). With ``graph`` on CUDA the first call
    captures it and later calls replay it; the logits tensor is then the graph's and is overwritten by the
    next call. Run it inside ``lora_batch(model, step.routing, step.names)`` and
    ``decoding(model, cache)``."""

    def __init__(self, model, cache, jobs: Sequence[str | None], graph: bool = True):
        n, dev = cache.num_slots, cache.device
        if len(jobs) != n:
            raise ValueError(f"StaticStep: {len(jobs)} jobs for {n} cache slots")
        self.model, self.n = model, n
        self.routing, self.names = adapter_routing(jobs, [1] * n)
        self.tokens = torch.zeros(1, n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        cu = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                   max_seqlen_q=cache.max_len, max_seqlen_kv=cache.max_len)
        self.cuda = dev.type == "cuda"
        self.host = torch.zeros(2, n, dtype=torch.long, pin_memory=self.cuda)
        self.copied = torch.cuda.Event() if self.cuda else None  # the last copy out of ``host`` is done
        self.graph = graph and self.cuda
        self.captured: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        cache.static(self.positions)

    def forward(self) -> torch.Tensor:
        out = self.model(self.tokens, self.positions[None], attention_mask=None, packed_seq_params=self.psp)
        return out[0].float()

    def __call__(self, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()  # (the pinned buffer is reused: the previous step's copy must be done)
        self.host.copy_(torch.tensor([list(tokens), list(positions)], dtype=torch.long))
        self.tokens[0].copy_(self.host[0], non_blocking=True)
        self.positions.copy_(self.host[1], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if self.graph and self.captured is None:
            self._capture()
        if self.captured is None:
            return self.forward()
        self.captured.replay()
        return self.logits

    def _capture(self) -> None:
        stream = torch.cuda.Stream(device=self.positions.device)
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_STEPS):
                    self.forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                logits = self.forward()
        except Exception as e:  # a host sync or an op capture does not support: the same step, eagerly
            torch.cuda.synchronize()
            warnings.warn(f"generate: CUDA graph capture of the decode step failed ({type(e).__name__}: "
                          f"{str(e)[:300]}); decoding with the same step run eagerly", GraphCaptureWarning,
                          stacklevel=3)
            self.graph = False
            return
        torch.cuda.current_stream().wait_stream(stream)
        self.captured, self.logits = graph, logits


def decode_static(model, cache, reqs, live: list[int], limit: Sequence[int], *, eos_id: int,
                  temperature: float, top_p: float, gens, graph: bool = True) -> None:
    """Decode ``reqs`` (each with its first token picked by the prefill) to the end with :class:`StaticStep`;
    the same tokens as the dynamic step, which runs only the live rows (see ``generate_ids``)."""
    step = StaticStep(model, cache, [r.job for r in reqs], graph)
    last = cache.max_len - 1
    with lora_batch(model, step.routing, step.names):
        while live:
            tokens = [r.output_ids[-1] if r.output_ids else 0 for r in reqs]
            positions = [min(len(r.prompt_ids) + len(r.output_ids) - 1, last) for r in reqs]
            logits = step(tokens, positions)
            if len(live) < len(reqs):
                logits = logits.index_select(0, to_device(torch.tensor(live), logits.device))
            rows = None if gens is None else [gens[i] for i in live]
            picked = pick_tokens(logits, temperature, top_p, rows)
            live = commit_tokens(reqs, live, picked, eos_id, limit)


__all__ = ["GRAPH_BY_DEFAULT", "GraphCaptureWarning", "StaticStep", "WARMUP_STEPS", "adapter_routing",
           "decode_static"]

"""Block configurations per kernel and shape bucket, chosen by ``scripts/tune_kernels.py`` and stored here.

Nothing is autotuned at run time: :func:`get_config` looks the shape's bucket up in the table of this GPU's
architecture (``TUNED_BY_ARCH``: ``TUNED`` for Hopper, SM90 — filled in from measurements on an H200, see
docs/BENCHMARKS.md; an architecture without a table of its own uses none) and falls back to ``DEFAULTS``.
Under the Triton interpreter (no GPU) small tiles keep the CPU tests quick.
"""

from __future__ import annotations

import os

# Kernel names: "gemm" (X·W' + low-rank epilogue, compute-bound), "lowrank" (the low-rank term alone),
# "shrink" (S = drop(X)·Aᵀ), "ds_db" (one pass over dY), "da" (dA = dSᵀ·drop(X)), "da_dx" (dA and the
# masked dX low-rank term in one pass).
DEFAULTS: dict[str, dict] = {
    "gemm": dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3),
    "lowrank": dict(BM=64, BN=128, GROUP_M=8, num_warps=4, num_stages=1),
    "shrink": dict(BM=32, BK=128, num_warps=4, num_stages=3),
    "ds_db": dict(BM=64, BN=128, CH=1024, num_warps=4, num_stages=3),
    "da": dict(BM=64, BK=128, CH=1024, num_warps=4, num_stages=3),
    "da_dx": dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),
}

INTERPRET: dict[str, dict] = {
    "gemm": dict(BM=32, BN=32, BK=32, GROUP_M=2, num_warps=4, num_stages=1),
    "lowrank": dict(BM=32, BN=32, GROUP_M=2, num_warps=4, num_stages=1),
    "shrink": dict(BM=16, BK=32, num_warps=4, num_stages=1),
    "ds_db": dict(BM=16, BN=32, CH=32, num_warps=4, num_stages=1),
    "da": dict(BM=16, BK=32, CH=32, num_warps=4, num_stages=1),
    "da_dx": dict(BM=16, BK=32, CH=32, num_warps=4, num_stages=1),
}

# (kernel, bucket) -> config; bucket = (m rounded up to a power of two, n, k) as the kernel sees them (for
# "lowrank", k is the rank chunk of its dots, min(rank block, 64): a config tuned at one does not carry over).
# Written from scripts/tune_kernels.py output on one H200 (2026-11-22; docs/BENCHMARKS.md, "LoRA kernels");
# the comment is the tuned kernel's median time there. That tuner built the routing tables afresh for every
# timed call, so these times include host-side table building, which favours larger row blocks
# (docs/results/e2e-8b-auto-tuned-h100.json);
# it now reuses them as training does.
TUNED: dict[tuple[str, tuple[int, int, int]], dict] = {
    ("gemm", (8192, 4096, 4096)): dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8,
                                       num_stages=3),  # 426.1 us
    ("lowrank", (8192, 4096, 16)): dict(BM=64, BN=128, GROUP_M=8, num_warps=4, num_stages=1),  # 32.2 us
    ("shrink", (8192, 16, 4096)): dict(BM=32, BK=128, num_warps=4, num_stages=3),  # 42.6 us
    ("ds_db", (8192, 4096, 16)): dict(BM=64, BN=256, CH=1024, num_warps=8, num_stages=3),  # 52.1 us
    ("da", (8192, 16, 4096)): dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 53.1 us
    ("gemm", (8192, 14336, 4096)): dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8,
                                        num_stages=3),  # 1545.6 us
    ("gemm", (8192, 4096, 14336)): dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8,
                                        num_stages=4),  # 1295.0 us
    ("lowrank", (8192, 14336, 16)): dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=1),  # 101.4 us
    ("ds_db", (8192, 14336, 16)): dict(BM=64, BN=256, CH=1024, num_warps=8, num_stages=3),  # 113.1 us
    ("shrink", (8192, 16, 14336)): dict(BM=32, BK=128, num_warps=4, num_stages=3),  # 126.2 us
    ("da", (8192, 16, 14336)): dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 138.1 us
    ("gemm", (16384, 4096, 4096)): dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8,
                                        num_stages=3),  # 892.7 us
    ("lowrank", (16384, 4096, 16)): dict(BM=64, BN=256, GROUP_M=8, num_warps=4, num_stages=1),  # 59.3 us
    ("shrink", (16384, 16, 4096)): dict(BM=32, BK=128, num_warps=4, num_stages=3),  # 72.0 us
    ("ds_db", (16384, 4096, 16)): dict(BM=64, BN=256, CH=1024, num_warps=8, num_stages=3),  # 98.4 us
    ("da", (16384, 16, 4096)): dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 87.5 us
    ("gemm", (4096, 8192, 8192)): dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8,
                                       num_stages=3),  # 877.5 us
    ("lowrank", (4096, 8192, 16)): dict(BM=64, BN=256, GROUP_M=8, num_warps=4, num_stages=1),  # 32.9 us
    ("shrink", (4096, 16, 8192)): dict(BM=16, BK=128, num_warps=4, num_stages=4),  # 52.3 us
    ("ds_db", (4096, 8192, 16)): dict(BM=64, BN=128, CH=1024, num_warps=4, num_stages=3),  # 52.7 us
    ("da", (4096, 16, 8192)): dict(BM=64, BK=128, CH=512, num_warps=4, num_stages=3),  # 52.7 us
    ("shrink", (8192, 64, 4096)): dict(BM=32, BK=128, num_warps=8, num_stages=4),  # 59.9 us
    ("ds_db", (8192, 4096, 64)): dict(BM=64, BN=256, CH=1024, num_warps=8, num_stages=3),  # 101.6 us
    ("da", (8192, 64, 4096)): dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 87.3 us
    ("da_dx", (8192, 16, 4096)): dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 107.5 us
    ("da_dx", (8192, 16, 14336)): dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 348.9 us
    ("da_dx", (16384, 16, 4096)): dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 201.7 us
    ("da_dx", (4096, 16, 8192)): dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 106.5 us
    ("da_dx", (8192, 64, 4096)): dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 174.0 us
}
# The 8B's linears at 32,768 and 16,384 tokens, per-call ranks as under PEFT's layout (four r=16: q/k/v 48,
# gate/up 32, proj and fc2 16; three r=16 and one r=64: the r=64 block's rows), one H200, 2026-11-28
# (scripts/device/lora_kernels.sh; docs/BENCHMARKS.md, "LoRA kernels"): the median time of the launcher with
# this config, and with the config it had before. The low-rank term's bucket is (m, n, rank chunk).
TUNED.update({
    ("lowrank", (32768, 6144, 64)):
        dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=1),  # 334.7 us, shipped 367.7 us
    ("shrink", (32768, 48, 4096)):
        dict(BM=128, BK=64, num_warps=8, num_stages=3),  # 140.5 us, shipped 192.9 us
    ("ds_db", (32768, 6144, 48)):
        dict(BM=64, BN=256, CH=2048, num_warps=8, num_stages=4),  # 346.2 us, shipped 430.6 us
    ("da_dx", (32768, 48, 4096)):
        dict(BM=64, BK=128, CH=1024, num_warps=4, num_stages=3),  # 532.0 us, shipped 545.1 us
    ("lowrank", (32768, 4096, 16)):
        dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=1),  # 109.9 us, shipped 112.3 us
    ("shrink", (32768, 16, 4096)):
        dict(BM=64, BK=64, num_warps=4, num_stages=4),  # 128.1 us, shipped 128.8 us
    ("ds_db", (32768, 4096, 16)):
        dict(BM=64, BN=256, CH=1024, num_warps=8, num_stages=3),  # 128.4 us, shipped 153.7 us
    ("da_dx", (32768, 16, 4096)):
        dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 404.5 us, shipped 404.5 us
    ("lowrank", (32768, 28672, 32)):
        dict(BM=128, BN=256, GROUP_M=8, num_warps=8, num_stages=1),  # 995.9 us, shipped 1138.0 us
    ("shrink", (32768, 32, 4096)):
        dict(BM=128, BK=64, num_warps=8, num_stages=3),  # 136.5 us, shipped 153.1 us
    ("ds_db", (32768, 28672, 32)):
        dict(BM=32, BN=512, CH=1024, num_warps=8, num_stages=3),  # 1039.1 us, shipped 1085.5 us
    ("da_dx", (32768, 32, 4096)):
        dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 506.4 us, shipped 506.4 us
    ("shrink", (32768, 16, 14336)):
        dict(BM=64, BK=64, num_warps=4, num_stages=4),  # 422.2 us, shipped 428.4 us
    ("da_dx", (32768, 16, 14336)):
        dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 1306.0 us, shipped 1306.0 us
    ("shrink", (32768, 192, 4096)):
        dict(BM=64, BK=64, num_warps=4, num_stages=4),  # 259.6 us, shipped 261.1 us
    ("shrink", (32768, 48, 6144)):
        dict(BM=128, BK=64, num_warps=8, num_stages=3),  # 1039.2 us, shipped 1337.2 us
    ("shrink", (32768, 192, 6144)):
        dict(BM=128, BK=64, num_warps=8, num_stages=3),  # 944.1 us, shipped 1041.0 us
    ("ds_db", (32768, 6144, 192)):
        dict(BM=32, BN=512, CH=1024, num_warps=8, num_stages=3),  # 849.3 us, shipped 944.3 us
    ("da_dx", (32768, 192, 4096)):
        dict(BM=64, BK=128, CH=1024, num_warps=4, num_stages=3),  # 760.5 us, shipped 829.1 us
    ("shrink", (32768, 64, 4096)):
        dict(BM=32, BK=128, num_warps=4, num_stages=3),  # 158.4 us, shipped 158.4 us
    ("ds_db", (32768, 4096, 64)):
        dict(BM=64, BN=256, CH=2048, num_warps=8, num_stages=4),  # 341.9 us as a split pass
    ("da_dx", (32768, 64, 4096)):
        dict(BM=64, BK=128, CH=1024, num_warps=4, num_stages=3),  # 449.5 us, shipped 451.2 us
    ("shrink", (32768, 128, 4096)):
        dict(BM=128, BK=64, num_warps=8, num_stages=3),  # 195.7 us, shipped 215.9 us
    ("shrink", (32768, 32, 28672)):
        dict(BM=64, BK=128, num_warps=4, num_stages=3),  # 2002.1 us, shipped 2516.2 us
    ("shrink", (32768, 128, 28672)):
        dict(BM=64, BK=64, num_warps=4, num_stages=4),  # 1850.7 us, shipped 2000.1 us
    ("ds_db", (32768, 28672, 128)):
        dict(BM=64, BN=128, CH=1024, num_warps=4, num_stages=3),  # 1852.1 us, shipped 1852.1 us
    ("da_dx", (32768, 128, 4096)):
        dict(BM=64, BK=128, CH=1024, num_warps=4, num_stages=3),  # 559.6 us, shipped 597.6 us
    ("shrink", (32768, 64, 14336)):
        dict(BM=64, BK=64, num_warps=4, num_stages=4),  # 516.4 us, shipped 519.7 us
    ("da_dx", (32768, 64, 14336)):
        dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 1471.6 us, shipped 1471.6 us
    ("lowrank", (16384, 6144, 64)):
        dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=1),  # 169.8 us, shipped 187.8 us
    ("shrink", (16384, 48, 4096)):
        dict(BM=64, BK=64, num_warps=4, num_stages=4),  # 83.3 us, shipped 102.0 us
    ("ds_db", (16384, 6144, 48)):
        dict(BM=64, BN=256, CH=1024, num_warps=8, num_stages=3),  # 205.3 us, shipped 237.6 us
    ("da_dx", (16384, 48, 4096)):
        dict(BM=64, BK=128, CH=1024, num_warps=4, num_stages=3),  # 279.2 us, shipped 283.2 us
    ("lowrank", (16384, 4096, 16)):
        dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=1),  # 58.7 us, shipped 58.9 us
    ("shrink", (16384, 16, 4096)):
        dict(BM=32, BK=128, num_warps=4, num_stages=3),  # 71.5 us, shipped 71.5 us
    ("ds_db", (16384, 4096, 16)):
        dict(BM=64, BN=256, CH=1024, num_warps=8, num_stages=3),  # 128.3 us (split: 114.2, not kept)
    ("da_dx", (16384, 16, 4096)):
        dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 213.8 us, shipped 213.8 us
    ("lowrank", (16384, 28672, 32)):
        dict(BM=128, BN=256, GROUP_M=8, num_warps=8, num_stages=1),  # 498.8 us, shipped 571.7 us
    ("shrink", (16384, 32, 4096)):
        dict(BM=64, BK=128, num_warps=8, num_stages=4),  # 78.1 us, shipped 82.2 us
    ("ds_db", (16384, 28672, 32)):
        dict(BM=32, BN=512, CH=1024, num_warps=8, num_stages=3),  # 539.3 us, shipped 577.4 us
    ("da_dx", (16384, 32, 4096)):
        dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 263.1 us, shipped 263.1 us
    ("shrink", (16384, 16, 14336)):
        dict(BM=32, BK=128, num_warps=4, num_stages=3),  # 228.6 us, shipped 228.6 us
    ("da_dx", (16384, 16, 14336)):
        dict(BM=32, BK=256, CH=512, num_warps=4, num_stages=3),  # 671.6 us, shipped 671.6 us
})

# Main GEMM of multi_lora_linear: "triton" (one Triton GEMM with the low-rank term in its accumulator) or
# "cublas" (low-rank term by a Triton kernel, then torch.addmm adds X·Wᵀ through cuBLAS). Callers pass
# ``main_gemm`` (the LoRA layers take it from the run config); :func:`default_main_gemm` is the default when
# they pass None: LORAFUSION_MAIN_GEMM (benchmark runs), read when asked so importing this module reads no
# environment. Measured (docs/BENCHMARKS.md): cuBLAS is ~15-20% faster than this Triton GEMM on Hopper, which
# outweighs the extra write/read of the low-rank term, so "cublas" is the default.
# "cublas_fold" is "cublas" with the dX order reversed (low-rank term first, cuBLAS adds dY·W into it); on one
# H100 at the 8B's linears it was -6% to +9% per linear with no consistent sign
# (docs/results/linears-attention-8b-h100.json),
# so it is an option, not the default.
MAIN_GEMMS = ("cublas", "cublas_fold", "triton")

# Tuned tables per GPU architecture ("sm" + compute capability): another architecture keeps DEFAULTS (or a
# table of its own, added here from scripts/tune_kernels.py run on it). H100 and H200 are both SM90.
TUNED_BY_ARCH: dict[str, dict] = {"sm90": TUNED}


def default_main_gemm() -> str:
    """The main GEMM used when a caller passes none: ``$LORAFUSION_MAIN_GEMM``, else "cublas"."""
    return os.environ.get("LORAFUSION_MAIN_GEMM") or "cublas"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_ARCH: list = []


def arch() -> str:
    """This process's GPU architecture, "sm90" for Hopper ("" without CUDA); asked once."""
    if not _ARCH:
        import torch

        ok = torch.cuda.is_available()
        _ARCH.append("sm%d%d" % torch.cuda.get_device_capability() if ok else "")
    return _ARCH[0]


def tuned_table() -> dict:
    """This architecture's table of tuned configs (created empty for one without; the tuner fills it)."""
    return TUNED_BY_ARCH.setdefault(arch(), {})


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def bucket(m: int, n: int, k: int) -> tuple[int, int, int]:
    return (_pow2_at_least(m), n, k)


def _extra() -> dict:
    """Configs from the JSON file named by LORAFUSION_TUNING_FILE (tuning runs), else none."""
    path = os.environ.get("LORAFUSION_TUNING_FILE")
    if not path:
        return {}
    if _EXTRA.get("path") != path:
        import json

        with open(path) as f:
            rows = json.load(f)
        _EXTRA["path"] = path
        _EXTRA["table"] = {(r["kernel"], tuple(r["bucket"])): r["config"] for r in rows}
    return _EXTRA["table"]


_EXTRA: dict = {}


def get_config(kernel: str, m: int, n: int = 0, k: int = 0, itemsize: int = 2) -> dict:
    """Block config for ``kernel`` at this shape. The tables are for 2-byte (bf16/fp16) operands; 4-byte
    (fp32) operands get half the K block and at most two pipeline stages so the tiles fit shared memory."""
    if interpreting():
        return dict(INTERPRET[kernel])
    key = (kernel, bucket(m, n, k))
    cfg = dict(_extra().get(key) or TUNED_BY_ARCH.get(arch(), {}).get(key) or DEFAULTS[kernel])
    if itemsize > 2:
        cfg["num_stages"] = min(cfg["num_stages"], 2)
        for blk in ("BK", "BN"):
            if blk in cfg and kernel in ("gemm", "shrink", "da", "da_dx", "ds_db"):
                cfg[blk] = max(16, cfg[blk] // 2)
                break
    return cfg

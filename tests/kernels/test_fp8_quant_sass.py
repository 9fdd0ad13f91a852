"""The FP8 kernels compiled for Hopper (sm_90) on the CPU, with the ptxas and cuobjdump that Triton ships:
every default launch of the row quantization for the 8B's row lengths compiles, and its machine code has no
per-element division (an IEEE division is a MUFU.RCP plus a refinement per element; the kernel multiplies
each element by its row's reciprocal, two divisions per row); the transpose of FP8 elements is the same
machine code as of bytes (no conversion)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lorafusion.kernels import fp8_quant as fq

k = fq._quant_rows_kernel
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def sass(ck, name):
    path = os.path.join(os.environ["TRITON_CACHE_DIR"], name + ".cubin")
    with open(path, "wb") as f:
        f.write(ck.asm["cubin"])
    text = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
    lines = [line for line in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    return [re.sub(r"/\*.*?\*/", "", line).strip() for line in lines]


out = {}
for t in ("*u8", "*fp8e4nv", "*fp8e5"):
    sig = {"src_ptr": t, "dst_ptr": t, "M": "i32", "N": "i32", "stride_s": "i32", "stride_d": "i32",
           "BM": "constexpr", "BN": "constexpr"}
    src = ASTSource(fn=fq._transpose_kernel, signature=sig, constexprs={(6,): 64, (7,): 64})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    out["transpose" + t] = sass(ck, "t" + t[1:])
for n, has_cs, qtype in json.loads(sys.argv[1]):
    single, block, rows, warps = fq.launch(n, has_cs)
    sig = {"x_ptr": "*bf16", "cs_ptr": "*fp32", "q_ptr": qtype, "s_ptr": "*fp32", "M": "i32", "N": "i32",
           "stride_x": "i32"}
    const = dict(QMAX=448.0 if qtype == "*fp8e4nv" else 57344.0, EPS=1e-12, HAS_CS=has_cs, BLOCK=block,
                 SINGLE=single, ROWS=rows, DIVIDE=False)
    sig.update({name: "constexpr" for name in const})
    src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(a),): v for a, v in const.items()})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    code = sass(ck, f"q{n}{has_cs}{qtype[1:]}")
    out[f"{n}-{has_cs}-{qtype}"] = {"mufu": sum(bool(re.search(r"(^|\s)MUFU\.", i)) for i in code),
                                     "per_thread": block * rows // (32 * warps)}
print(json.dumps(out))
"""


def _tools() -> bool:
    try:
        import triton
    except ImportError:
        return False
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return (bin_dir / "ptxas").exists() and (bin_dir / "cuobjdump").exists()


@pytest.mark.skipif(not _tools(), reason="Triton's NVIDIA backend tools (ptxas, cuobjdump) are not installed")
def test_kernels_compile_for_hopper_without_a_division_per_element_or_a_conversion(tmp_path):
    # (columns, column scale?, q type): X of qkv/proj/fc1, dY of proj/fc2, dY of qkv, X of fc2, dY of fc1
    cases = [(4096, False, "*fp8e4nv"), (4096, True, "*fp8e4nv"), (6144, True, "*fp8e4nv"),
             (14336, False, "*fp8e4nv"), (28672, True, "*fp8e4nv"), (28672, True, "*fp8e5")]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(cases)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(stats) == len(cases) + 3
    # FP8 moved as bytes: the same instructions as the uint8 transpose, none of them a conversion
    moved = stats.pop("transpose*u8")
    assert len(moved) > 50 and stats.pop("transpose*fp8e4nv") == moved == stats.pop("transpose*fp8e5")
    for key, st in stats.items():
        # a division per element: at least one MUFU per element a thread holds (16-32 here, 34 and 18 MUFU
        # with the former division); per row: 2 divisions (3-6 MUFU)
        assert 2 * st["mufu"] < st["per_thread"], (key, st)

"""Every LoRA linear at TP=2 with its LoRA term on the base's collectives (no all-reduce of S or dS; the
partial factor gradients summed once) equals the same linear with the LoRA term on Megatron's path (its own
collectives): outputs, input gradients, every adapter gradient — the bf16/fp32 TP path in line and
overlapped, and the FP8 base's, with and without sequence parallelism (tp_lora_worker.py, two gloo ranks)."""

import json
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_lora_on_the_base_collectives_equals_its_own_collectives(tmp_path):
    from session_shared import launch_two_ranks

    worker = Path(__file__).with_name("tp_lora_worker.py")
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    codes = launch_two_ranks([sys.executable, str(worker), str(tmp_path)], logs, timeout=300)
    assert codes == [0, 0], "\n".join(p.read_text()[-4000:] for p in logs)
    checked = json.loads((tmp_path / "ok.json").read_text())
    kinds = {key.split(".")[1] for _, _, _, key in checked}
    assert kinds == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    assert {(p, sp, nano) for p, sp, nano, _ in checked} == {
        ("bf16", True, 0), ("bf16", True, 2), ("bf16", False, 0), ("bf16", False, 2), ("fp8", True, 0),
        ("fp8", False, 0)}

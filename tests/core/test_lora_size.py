"""The one count of an adapter's size (core.lora.lora_layer_params), against PEFT's parameter counts."""

from lorafusion.core.arch import preset
from lorafusion.core.lora import LoRASpec, lora_layer_params, lora_memory_bytes, lora_s_width


def test_peft_parameter_counts():
    arch = preset("llama3.1-8b")
    # PEFT on Llama-3-8B, r=16: all-linear 41,943,040 trainable parameters; q_proj + v_proj 6,815,744
    targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert 32 * lora_layer_params(arch, 16, targets) == 41_943_040
    assert 32 * lora_layer_params(arch, 16, ("q_proj", "v_proj")) == 6_815_744
    # one A shared by q, k, v: 16 x 4096 for the three, B unchanged
    assert lora_layer_params(arch, 16, ("linear_qkv",), shared_a=True) == 16 * 4096 + 16 * (4096 + 2 * 1024)
    assert lora_s_width(16, ("q_proj", "v_proj")) == 32
    assert lora_s_width(16, ("linear_qkv",), shared_a=True) == 16


def test_tensor_parallel_shards_b_of_column_and_a_of_row_linears():
    arch = preset("llama3.1-8b")
    assert lora_layer_params(arch, 8, ("q_proj",), tp=2) == 8 * 4096 + 8 * 4096 / 2
    assert lora_layer_params(arch, 8, ("linear_fc2",), tp=2) == 8 * 14336 / 2 + 8 * 4096


def test_memory_bytes_are_the_count_times_the_state_plus_the_activations():
    arch, spec = preset("llama3.1-8b"), LoRASpec(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    assert lora_memory_bytes(spec, arch, 4096) == 16 * 6_815_744 + 4 * 32 * 32 * 4096
    assert lora_memory_bytes(spec, arch, 0, layers=1, bytes_per_param=12) == 12 * 6_815_744 // 32

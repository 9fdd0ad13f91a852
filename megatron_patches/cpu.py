"""CPU shims for megatron-core (tested against 0.16.1). Each shim names the function it stands in for."""

from __future__ import annotations

import contextlib
import warnings

import torch

SUPPORTED_MEGATRON = ("0.16",)
_applied = False


def cpu_patches_applied() -> bool:
    return _applied


def _cpu_current_device() -> torch.device:
    # stands in for torch.cuda.current_device(): megatron uses it as the device of new tensors
    # (rotary inv_freq, p2p receive buffers, loss scalars, GlobalMemoryBuffer).
    return torch.device("cpu")


def _cpu_get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    # stands in for megatron.core.tensor_parallel.random._get_cuda_rng_state: the CPU generator's state.
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    # stands in for megatron.core.tensor_parallel.random._set_cuda_rng_state.
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # stands in for torch.cuda.manual_seed inside model_parallel_cuda_manual_seed: seeds the CPU generator.
    torch.default_generator.manual_seed(int(seed))


@contextlib.contextmanager
def _cpu_fork(self, name="model-parallel-rng"):
    # stands in for megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork: the same state
    # switching on the CPU generator, without the "CPU RNG state changed" warning, which on CPU would fire
    # every time because the tracked generator *is* the CPU generator.
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    orig_state = torch.get_rng_state()
    orig_name = self._current_state_name
    if orig_name != "default-rng":
        self.states_[orig_name] = orig_state
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        if orig_name != "default-rng":
            torch.set_rng_state(self.states_[orig_name])
        else:
            torch.set_rng_state(orig_state)
        self._current_state_name = orig_name


def apply_cpu_patches() -> bool:
    """Install the CPU shims once. Returns True if patches are (now) active, False on a CUDA machine."""
    global _applied
    if _applied:
        return True
    if torch.cuda.is_available():
        return False
    import megatron.core

    version = getattr(megatron.core, "__version__", "0.16")
    if not version.startswith(SUPPORTED_MEGATRON):
        warnings.warn(f"megatron_patches targets megatron-core {SUPPORTED_MEGATRON}, found "
                      f"{version}", stacklevel=2)

    torch.cuda.current_device = _cpu_current_device
    # torch.cuda.synchronize(): megatron timers / schedules call it; nothing to wait for on CPU.
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.manual_seed = _cpu_manual_seed
    torch.cuda.manual_seed_all = _cpu_manual_seed
    # torch.cuda.get_rng_state / set_rng_state: CudaRNGStatesTracker.add reads and restores them.
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state
    mrandom.CudaRNGStatesTracker.fork = _cpu_fork
    _patch_device_strings()
    _applied = True
    return True


class _CpuTorch:
    """A stand-in for the ``torch`` module inside a few megatron modules: tensor factories called with
    ``device="cuda"`` get the CPU instead; every other attribute is torch's own."""

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "randn", "rand")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            def factory(*args, **kwargs):
                dev = kwargs.get("device")
                if dev is not None and torch.device(dev).type == "cuda":
                    kwargs["device"] = "cpu"
                return attr(*args, **kwargs)

            return factory
        return attr


# Modules with literal device="cuda" on paths lorafusion uses:
#  - pipeline_parallel.schedules: forward_backward_no_pipelining / _pipelining_without_interleaving
#    (`total_num_tokens = torch.zeros([], ..., device="cuda")`)
#  - transformer.utils: get_default_causal_mask / get_sliding_window_causal_mask
#  - tensor_parallel.data: broadcast_data (`sizes_cuda`)
_DEVICE_STRING_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.data",
)


def _patch_device_strings() -> None:
    import importlib

    for name in _DEVICE_STRING_MODULES:
        importlib.import_module(name).torch = _CpuTorch()

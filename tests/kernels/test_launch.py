"""The launch fast path (lorafusion.kernels.launch): a cached compiled kernel is launched only for arguments
Triton specializes the same way, with the arguments ``JITFunction.run`` would pass.

On a CPU the Launcher runs around a stand-in for a JITFunction that carries Triton's real binder (the
native specialization of the CUDA backend) and records what would be compiled and launched; on a GPU the
real kernels are compared with and without the fast path."""

import itertools

import pytest
import torch

from lorafusion.kernels.launch import Launcher

_SRC = '''
import triton.language as tl


def kern(x_ptr, y_ptr, M, N, stride, flag, scale, BLOCK: tl.constexpr, MODE: tl.constexpr = "a"):
    pass
'''


class _Compiled:
    def __init__(self, key, log):
        self.key, self.log = key, log
        self.function, self.packed_metadata = object(), object()

    def run(self, *args):
        self.log.append((self.key, args))


class _FakeJIT:
    """A JITFunction as the Launcher sees it: Triton's binder for the CUDA backend, and ``run`` compiling per
    Triton's cache key (the specialization and the options) and launching."""

    def __init__(self, tmp_path):
        import importlib.util

        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

        path = tmp_path / "fake_kernel.py"
        path.write_text(_SRC)
        spec = importlib.util.spec_from_file_location("fake_kernel", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        jit = JITFunction(mod.kern, do_not_specialize=["M"])
        backend = make_backend(GPUTarget("cuda", 90, 32))
        self.params = jit.params
        self.binder = create_function_from_signature(jit.signature, jit.params, backend)
        self.device_caches = {0: ({}, {}, None, backend, self.binder)}
        self.pre_run_hooks = []
        self.kernels: dict = {}
        self.launches: list = []
        self._key = compute_cache_key

    def run(self, *args, grid, warmup, **kw):
        bound, spec, options = self.binder(*args, **kw)
        key = self._key({}, spec, options)
        ck = self.kernels.setdefault(key, _Compiled(key, self.launches))
        g = tuple(grid) + (1,) * (3 - len(grid))
        ck.run(*g, 7, ck.function, ck.packed_metadata, None, None, None, *bound.values())
        return ck

    def __getitem__(self, grid):
        return lambda *a, **kw: self.run(*a, grid=grid, warmup=False, **kw)


def _launcher(tmp_path):
    fake = _FakeJIT(tmp_path)
    return fake, Launcher(fake, device=lambda: 0, stream=lambda dev: 7)


def _argsets():
    x = torch.zeros(64)
    tensors = [x, x[1:], x[4:], x.to(torch.bfloat16), None]
    ints = [0, 1, 2, 16, 17, 32, -16, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63]
    for t, m, n, stride in itertools.product(tensors, [1, 5, 16, 2**31], ints, [1, 3, 48]):
        yield (x, t, m, n, stride, True, 0.5), dict(BLOCK=16, num_warps=4)
    yield (x, x, 5, 7, 1, False, 1.0), dict(BLOCK=32, num_warps=4)
    yield (x, x, 5, 7, 1, False, 1.0), dict(BLOCK=16, num_warps=8)
    yield (x, x, 5, 7, 1, False, 1.0), dict(BLOCK=16, num_warps=4, MODE="b")
    yield (x, x, 5, 7, 1, True, 1.0), dict(BLOCK=16, num_warps=4, num_stages=2)


def test_fast_path_launches_what_run_would_launch(tmp_path):
    """Each call, in an order that revisits specializations: the kernel launched and its arguments are those
    of JITFunction.run (every new specialization compiled once, every known one launched directly)."""
    fake, launcher = _launcher(tmp_path)
    calls = list(_argsets())
    calls = calls + calls[::-1] + calls[::7]
    for args, kw in calls:
        fake.launches.clear()
        want = fake.run(*args, grid=(3, 2), warmup=False, **kw)
        want_log = list(fake.launches)
        fake.launches.clear()
        got = launcher.launch((3, 2), *args, **kw)
        assert got is want, (args, kw)
        assert fake.launches == want_log, (args, kw)
    # each key once through JITFunction.run (a key is at least as fine as Triton's specialization), then
    # every launch direct
    assert len(fake.kernels) <= launcher.slow_launches < len(calls)
    slow = launcher.slow_launches
    for args, kw in calls:
        launcher.launch((3, 2), *args, **kw)
    assert launcher.slow_launches == slow


def test_a_new_specialization_is_never_served_from_the_cache(tmp_path):
    """An int that becomes 1 or a multiple of 16, a pointer that loses its 16-byte alignment, another dtype
    or constexpr: a new compiled kernel, not the cached one."""
    fake, launcher = _launcher(tmp_path)
    x = torch.zeros(64)
    base = (x, x, 5, 7, 3, True, 0.5)
    launcher.launch((1,), *base, BLOCK=16)
    first = launcher.launch((1,), *base, BLOCK=16)
    assert launcher.slow_launches == 1
    changes = [(x, x, 5, 1, 3, True, 0.5), (x, x, 5, 32, 3, True, 0.5), (x, x[1:], 5, 7, 3, True, 0.5),
               (x, x.double(), 5, 7, 3, True, 0.5), (x, None, 5, 7, 3, True, 0.5),
               (x, x, 5, 2**40, 3, True, 0.5)]
    for args in changes:
        assert launcher.launch((1,), *args, BLOCK=16) is not first, args
    assert launcher.launch((1,), *base, BLOCK=64) is not first
    assert launcher.launch((1,), *base, BLOCK=16, num_warps=8) is not first
    assert launcher.slow_launches == 1 + len(changes) + 2
    # an argument the key does not describe: the normal path, every time
    slow = launcher.slow_launches
    class Width(int):
        pass

    for _ in range(2):
        assert launcher.launch((1,), x, x, 5, Width(7), 3, True, 0.5, BLOCK=16) is first
    assert launcher.slow_launches == slow + 2
    # M is not specialized on its value: another row count launches the same kernel
    assert launcher.launch((1,), x, x, 16, 7, 3, True, 0.5, BLOCK=16) is first
    assert launcher.launch((1,), x, x, 1, 7, 3, True, 0.5, BLOCK=16) is first
    assert launcher.launch((1,), x, x, 3, 7, 3, True, 0.5, BLOCK=16) is first


def test_launch_hooks_and_interpreter_take_the_normal_path(tmp_path, monkeypatch):
    from triton import knobs

    fake, launcher = _launcher(tmp_path)
    x = torch.zeros(64)
    launcher.launch((1,), x, x, 5, 7, 3, True, 0.5, BLOCK=16)
    monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [lambda *a: None])
    launcher.launch((1,), x, x, 5, 7, 3, True, 0.5, BLOCK=16)
    assert launcher.slow_launches == 2
    calls = []

    class Interpreted:  # no device caches: launched as kernel[grid](...)
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    Launcher(Interpreted()).launch((2,), 1, BLOCK=4)
    assert calls == [((2,), (1,), {"BLOCK": 4})]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fast_path_equals_normal_launch_and_compiles_once():
    from lorafusion.core.routing import Routing
    from lorafusion.kernels import fused_multi_lora as K
    from lorafusion.kernels.fused_lora import _shrink_kernel
    from lorafusion.ops.tables import TableCache

    dev = "cuda"
    tc = TableCache()
    st = tc.slot_tables([8, 16], [1.0, 2.0], [0.1, 0.2], [3, 4], dev)
    A = torch.randn(24, 96, device=dev, dtype=torch.bfloat16)
    outs = []
    for m in (40, 41, 48, 40):
        routing = Routing.from_lengths([0, 1], [m // 2, m - m // 2])
        ids = tc.row_ids(routing, dev)
        for off in (0, 1):  # 16-byte aligned and not: different specializations
            x = torch.randn(m * 96 + off, device=dev, dtype=torch.bfloat16)[off:].view(m, 96)
            S = K.lora_shrink(x, A, st, routing, ids, k_total=96, cache=tc)
            launcher = K._SHRINK
            K._SHRINK = Launcher(_shrink_kernel)
            K._SHRINK._fast = False  # the plain kernel[grid](...) launch
            try:
                ref = K.lora_shrink(x, A, st, routing, ids, k_total=96, cache=tc)
            finally:
                K._SHRINK = launcher
            assert torch.equal(S, ref)
            outs.append(S)
    torch.cuda.synchronize()
    slow = K._SHRINK.slow_launches
    K.lora_shrink(x, A, st, routing, ids, k_total=96, cache=tc)
    assert K._SHRINK.slow_launches == slow  # known specialization: launched directly


def test_a_constexpr_given_by_position_is_never_cached(tmp_path):
    """The key describes a positional argument by its value class (an int's being 1, divisible by 16): a
    constexpr given by position (BLOCK=16 and BLOCK=64 alike) would share a key, so such launches always go
    through JITFunction.run."""
    fake, launcher = _launcher(tmp_path)
    x = torch.zeros(64)
    base = (x, x, 5, 7, 3, True, 0.5)
    first = launcher.launch((1,), *base, 16)
    assert launcher.launch((1,), *base, 64) is not first
    launcher.launch((1,), *base, 16)
    assert launcher.slow_launches == 3

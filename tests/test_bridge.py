"""moestream.moe.bridge: the CPU worker answers each layer's posted request with exactly the pair outputs
the pair kernels' reference computes, leaves the GPU's pairs alone, and a failure fails one step only.

The torch side (CPU device) runs in process; the Triton post/collect kernels run in a subprocess under
TRITON_INTERPRET=1 (the worker thread answers while the interpreted collect kernel polls), and compile
for sm_90 with the real compiler. On CUDA the whole path runs in tests/test_cuda_graphs.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moestream.moe.formats import dense_format

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moestream.moe.bridge import CpuBridge  # noqa: E402
from moestream.moe.pairs import _pair_outputs_torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_harness import HAS_TRITON, compile_sm90  # noqa: E402

E, H, I, K = 10, 32, 16, 3


class FakeStore:
    fmt = dense_format(torch.float32)

    def __init__(self, layers, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.moe_layers, self.hidden = layers, H
        self.banks = {layer: {"gate_up": torch.randn(E, 2 * I, H, generator=g) * 0.2,
                              "down": torch.randn(E, H, I, generator=g) * 0.2} for layer in layers}

    def bank(self, layer):
        return self.banks[layer]


def one_step(bridge: CpuBridge, store: FakeStore, T: int, seed: int, keep: int = 0, finish: bool = True):
    """A step over every layer: the CPU's rows equal the reference, the GPU's rows keep their sentinel. keep=1: begun
    while the step before it is still pending (overlapped decode); finish=False: left pending, its checks returned."""
    g = torch.Generator().manual_seed(seed)
    bridge.begin_step(keep=keep)
    checks = []
    for layer in store.moe_layers:
        x = torch.randn(T, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        w = torch.rand(T, K, generator=g)
        cpu = torch.rand(T * K, generator=g) < 0.6
        bridge.post(layer, x, ids, w, cpu)
        y = torch.full((T * K, H), 7.0)
        bridge.collect(layer, y, cpu)
        checks.append((layer, x, ids, w, cpu, y))
    bridge.end_step()
    if not finish:
        return checks
    bridge.finish_step()
    check_rows(store, checks)


def check_rows(store: FakeStore, checks) -> None:
    for layer, x, ids, w, cpu, y in checks:
        want = _pair_outputs_torch(x, w, ids.reshape(-1), store.bank(layer))
        torch.testing.assert_close(y[cpu], want[cpu], rtol=1e-5, atol=1e-6)
        assert torch.all(y[~cpu] == 7.0)


def check_protocol(kernels: bool) -> None:
    store = FakeStore([0, 2, 3])
    bridge = CpuBridge(store, torch.device("cpu"), max_pairs=4 * K)
    bridge.kernels = kernels
    try:
        for step, T in enumerate((1, 4, 2, 4)):
            one_step(bridge, store, T, step)
        assert bridge.seq == 4 and sum(bridge.cpu_experts) > 0
        # overlapped: each step begun while the one before is pending; finish_step finishes the oldest, in order
        first = one_step(bridge, store, 2, 20, finish=False)
        for seed in (21, 22):
            nxt = one_step(bridge, store, 3, seed, keep=1, finish=False)
            assert len(bridge._pending) == 2 and bridge.finish_step()
            assert [s for s, _ in bridge._pending] == [bridge.seq]  # the newest still pending
            check_rows(store, first)
            first = nxt
        assert bridge.finish_step() and not bridge.finish_step()
        check_rows(store, first)
        assert bridge.seq == 7
        # a worker exception fails that step (the collects still return) and the next step is whole again
        real = bridge._compute
        bridge._compute = lambda i, layer: (_ for _ in ()).throw(ValueError("injected"))
        with pytest.raises(RuntimeError, match="CPU experts failed.*injected"):
            one_step(bridge, store, 2, 10)
        # end_step does not wait (the caller queues its sampling behind the step): the failure is raised by
        # finish_step, or by the next begin_step where nobody called it
        bridge.begin_step()
        bridge.post(0, torch.randn(1, H), torch.tensor([[1, 2, 3]]), torch.rand(1, K), torch.ones(K, dtype=torch.bool))
        bridge.collect(0, torch.zeros(K, H), torch.ones(K, dtype=torch.bool))
        for layer in store.moe_layers[1:]:
            bridge.post(layer, torch.randn(1, H), torch.tensor([[1, 2, 3]]), torch.rand(1, K),
                        torch.zeros(K, dtype=torch.bool))
        bridge.end_step()
        with pytest.raises(RuntimeError, match="CPU experts failed.*injected"):
            bridge.begin_step()
        bridge._compute = real
        one_step(bridge, store, 3, 11)
        # a step that raised after its first layer: the worker gives up on the others, nothing is reported
        bridge.begin_step()
        bridge.post(0, torch.randn(1, H), torch.tensor([[1, 2, 3]]), torch.rand(1, K), torch.ones(K, dtype=torch.bool))
        bridge.end_step()
        one_step(bridge, store, 1, 12)
    finally:
        bridge.close()


def test_torch_protocol():
    check_protocol(kernels=False)


def test_request_too_large():
    bridge = CpuBridge(FakeStore([0]), torch.device("cpu"), max_pairs=K)
    try:
        bridge.begin_step()
        with pytest.raises(RuntimeError, match="exceeds"):
            bridge.post(0, torch.randn(2, H), torch.zeros(2, K, dtype=torch.long), torch.rand(2, K),
                        torch.ones(2 * K, dtype=torch.bool))
        bridge.end_step()
    finally:
        bridge.close()


@pytest.mark.parametrize("env,cpu_backend,hybrid", [(None, True, False), ("1", True, False), ("0", False, False),
                                                     ("all", True, True), ("bogus", True, False)])
def test_pool_held_by_setting(env, cpu_backend, hybrid, monkeypatch):
    """MOESTREAM_BRIDGE_POOL: by default the `cpu` backend's bridge (hold=True) holds the kernels' pool for the step and
    hybrid's (hold=False) does not; 0 holds neither, all holds both; an unknown value is the default; never on a CPU."""
    if env is None:
        monkeypatch.delenv("MOESTREAM_BRIDGE_POOL", raising=False)
    else:
        monkeypatch.setenv("MOESTREAM_BRIDGE_POOL", env)
    store = FakeStore([0])
    for hold, want in ((True, cpu_backend), (False, hybrid)):
        bridge = CpuBridge(store, torch.device("cpu"), max_pairs=K, hold=hold)
        try:
            assert not bridge.holds_pool()  # a CPU device never holds it
            bridge.device = torch.device("cuda")  # the decision only (nothing runs on it)
            assert bridge.holds_pool() is want
        finally:
            bridge.device = torch.device("cpu")
            bridge.close()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_interpreted_kernels_protocol():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "protocol ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("atomic", [True, False])
def test_kernels_compile_for_sm90(atomic):
    from moestream.moe import bridge

    sig = {"x_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": "*fp32", "cpu_ptr": "*i1", "hx_ptr": "*bf16",
           "hids_ptr": "*i64", "hw_ptr": "*fp32", "meta_ptr": "*i64", "req_ptr": "*i64", "seq_ptr": "*i64",
           "T": "i32", "TH": "i32", "P": "i32", "BLOCK": "constexpr", "NB": "constexpr", "BLOCK_P": "constexpr",
           "ATOMIC": "constexpr"}
    post = compile_sm90(bridge._post_kernel, sig, {"BLOCK": 1024, "NB": 4, "BLOCK_P": 64, "ATOMIC": atomic})
    ptx = post.asm["ptx"]
    assert ("atom.global.sys.release.exch" in ptx) if atomic else ("fence.sc.sys" in ptx)
    sig = {"y_ptr": "*fp32", "cpu_ptr": "*i1", "hy_ptr": "*fp32", "done_ptr": "*i64", "seq_ptr": "*i64",
           "err_ptr": "*i32", "H": "i32", "SPIN": "i32", "BLOCK": "constexpr", "NB": "constexpr"}
    collect = compile_sm90(bridge._collect_kernel, sig, {"BLOCK": 1024, "NB": 2})
    assert "ld.volatile.global" in collect.asm["ptx"]


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    check_protocol(kernels=True)
    print("protocol ok")


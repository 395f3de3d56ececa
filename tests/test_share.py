"""moestream.moe.share: hybrid's live fetch share follows the CPU rate measured in running steps."""
from __future__ import annotations

import pytest
import torch

from moestream.moe.share import MAX_SHARE, PROBE, LiveShare, split


def test_split_balances_the_two_buses():
    assert split(50.0, 50.0) == pytest.approx(0.5)
    assert split(48.0, 16.0) == pytest.approx(0.75)
    assert split(50.0, 0.0) == MAX_SHARE  # a CPU that computes nothing still gets measured
    assert split(0.0, 0.0) == 0.5


def test_share_moves_toward_the_measured_split_and_lives_on_the_device():
    s = LiveShare(torch.device("cpu"), initial=0.5, pcie_gbs=48.0, every=4)
    cpu_bytes = cpu_s = 0.0
    for _ in range(40):  # the CPU worker computes at 16 GB/s: the balanced share is 48 / 64
        cpu_bytes += 16e9 * 0.001
        cpu_s += 0.001
        s.observe(cpu_bytes, cpu_s)
    assert s.cpu_gbs == pytest.approx(16.0)
    assert s.value == pytest.approx(0.75, abs=0.01)
    assert float(s.tensor) == pytest.approx(s.value)  # what the route kernel reads
    assert s.as_dict()["fetch_share"] == pytest.approx(s.value, abs=1e-4)


def test_an_idle_cpu_is_probed_with_a_little_work():
    s = LiveShare(torch.device("cpu"), initial=0.9, pcie_gbs=48.0, every=2)
    for _ in range(4):
        s.observe(0.0, 0.0)  # no CPU pairs in these windows
    assert s.value == pytest.approx(0.9 - 2 * PROBE)


def test_a_measured_share_is_kept_through_windows_without_cpu_work():
    s = LiveShare(torch.device("cpu"), initial=0.5, pcie_gbs=48.0, every=1)
    s.observe(16e9 * 0.004, 0.004)  # one measured window: 16 GB/s
    measured = s.value
    for _ in range(5):
        s.observe(16e9 * 0.004, 0.004)  # no new CPU work (e.g. every miss fetched, or no misses)
    assert s.value == measured and s.cpu_gbs == pytest.approx(16.0)


def test_a_cpu_call_slower_than_fetching_the_rest_gets_no_share():
    """The fixed cost of a CPU layer call: one expert on the CPU taking longer than PCIe needs for the rest of
    a call's misses makes any CPU share a loss, so the share goes to 1 (hybrid = offload) and stays."""
    e = 3.3e6  # bytes of one Q8_0 expert of the Qwen3.6 shape; 48 GB/s: 69 us each
    s = LiveShare(torch.device("cpu"), initial=0.7, pcie_gbs=48.0, every=1)
    # window: 40 layer calls, 2 misses each, 30 single-expert CPU calls of 300 us, CPU at 20 GB/s in-step
    s.observe(20e9 * 0.009, 0.009, single_calls=30, single_s=30 * 300e-6, misses=80, layer_calls=40, expert_bytes=e)
    assert s.misses_per_call == pytest.approx(2.0) and s.one_expert_s == pytest.approx(300e-6)
    assert s.value == 1.0 and float(s.tensor) == 1.0 and s.cpu_unhelpful and s.as_dict()["cpu_unhelpful"]
    s.observe(20e9 * 0.02, 0.02, 60, 60 * 50e-6, 400, 80, e)  # later windows do not move it
    assert s.value == 1.0


def test_a_cheap_cpu_call_keeps_the_bandwidth_split():
    e = 3.3e6
    s = LiveShare(torch.device("cpu"), initial=0.5, pcie_gbs=48.0, every=1)
    # 6 misses a call: PCIe needs 5 x 69 us for the rest, one CPU expert takes 50 us: the CPU helps
    s.observe(16e9 * 0.004, 0.004, single_calls=10, single_s=10 * 50e-6, misses=240, layer_calls=40, expert_bytes=e)
    assert not s.cpu_unhelpful and s.value == pytest.approx(0.5 * 0.5 + 0.5 * 0.75)

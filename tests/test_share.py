"""moestream.moe.share: hybrid's live split follows the CPU worker's calls measured in running steps: a line
(seconds per expert, fixed seconds per call) fitted to them, against one expert's time over PCIe."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream.moe.device_cache import device_fetch_count
from moestream.moe.share import PRIOR_FIXED_S, LiveShare, fit_line

E = 3.3e6  # bytes of one Q8_0 expert of the Qwen3.6 shape: 68.75 us over 48 GB/s


def calls(pairs) -> np.ndarray:
    """The fit sums of calls [(experts, seconds), ...]."""
    c = np.array([p[0] for p in pairs], dtype=np.float64)
    t = np.array([p[1] for p in pairs], dtype=np.float64)
    return np.array([len(c), c.sum(), t.sum(), (c * c).sum(), (c * t).sum()])


def test_fit_line_recovers_cost_per_expert_and_fixed_cost():
    slope, fixed = fit_line(calls([(1, 90e-6), (2, 150e-6), (3, 210e-6), (1, 90e-6)]), slope=1.0)
    assert slope == pytest.approx(60e-6) and fixed == pytest.approx(30e-6)
    slope, fixed = fit_line(calls([(2, 150e-6), (2, 170e-6)]), slope=50e-6)  # one count: the slope is kept
    assert slope == 50e-6 and fixed == pytest.approx(60e-6)


def test_the_prior_is_the_planners_split_and_lives_on_the_device():
    s = LiveShare(torch.device("cpu"), initial=0.6, pcie_gbs=48.0, expert_bytes=E)
    assert s.value == pytest.approx(0.6) and s.fixed_s == PRIOR_FIXED_S
    assert float(s.tensor[0]) == pytest.approx(s.value) and float(s.tensor[1]) == pytest.approx(s.fixed, rel=1e-6)
    assert s.as_dict()["measured_windows"] == 0


def test_the_share_follows_the_measured_calls():
    """The worker's calls take 40 us + 80 us an expert: t_c = 80, a = 40 against t_p = 68.75 us."""
    s = LiveShare(torch.device("cpu"), initial=0.5, pcie_gbs=48.0, expert_bytes=E, every=2)
    fit = np.zeros(5)
    for _ in range(40):
        fit = fit + calls([(c, 40e-6 + c * 80e-6) for c in (1, 2, 3, 1, 2)])
        s.observe(fit)
    assert s.t_cpu == pytest.approx(80e-6, rel=1e-3) and s.fixed_s == pytest.approx(40e-6, rel=1e-2)
    unit = s.t_pcie + s.t_cpu
    assert s.value == pytest.approx(80e-6 / unit, rel=1e-3) and s.fixed == pytest.approx(40e-6 / unit, rel=1e-2)
    assert s.as_dict()["cpu_call_fixed_us"] == pytest.approx(40.0, abs=0.5)
    # what the route does with it: one miss is fetched (a CPU call takes 120 us, PCIe 69), 2 to 8 are split
    got = {n: int(device_fetch_count(torch.tensor(n), s.tensor)) for n in (1, 2, 4, 8)}
    assert got == {1: 1, 2: 1, 4: 2, 8: 5}


def test_a_slow_cpu_call_takes_no_misses():
    """A CPU whose calls cost 500 us plus 150 us an expert never beats PCIe for a handful of misses."""
    s = LiveShare(torch.device("cpu"), initial=0.5, pcie_gbs=48.0, expert_bytes=E, every=1)
    fit = np.zeros(5)
    for _ in range(12):
        fit = fit + calls([(1, 650e-6), (2, 800e-6)])
        s.observe(fit)
    assert all(int(device_fetch_count(torch.tensor(n), s.tensor)) == n for n in range(0, 9))


def test_windows_without_cpu_calls_drift_back_to_the_prior():
    """After a slow window the CPU gets nothing, so nothing new is measured: the estimates move back toward the
    prior a quarter at a time, and the CPU is tried again."""
    s = LiveShare(torch.device("cpu"), initial=0.5, pcie_gbs=48.0, expert_bytes=E, every=1)
    fit = calls([(1, 2e-3), (2, 2.1e-3)])  # one noisy window: 1.9 ms fixed
    s.observe(fit)
    slow = s.fixed_s
    assert slow > 10 * PRIOR_FIXED_S
    for _ in range(20):
        s.observe(fit)  # no new calls
    assert s.fixed_s < 2 * PRIOR_FIXED_S < slow and s.windows == 1
    assert int(device_fetch_count(torch.tensor(8), s.tensor)) < 8


# ---- the arms: the live split or offload's step, by measured step times ----------------------------
def drive(arms, rows, times: dict, steps: int):
    """Run `steps` decode steps of `rows` rows, each taking times[arm] seconds; the arms picked, in order."""
    picked = []
    for _ in range(steps):
        arm = arms.pick(rows)
        picked.append(arm)
        arms.observe(rows, arm, times[arm])
    return picked


def test_arms_explore_in_alternating_blocks_then_hold_the_faster():
    from moestream.moe.share import FETCH, SPLIT, Arms

    arms = Arms(block=2, trials=2, hold=6, warmup=0)
    picked = drive(arms, 1, {SPLIT: 0.012, FETCH: 0.010}, 8 + 6)
    assert picked[:8] == [SPLIT, SPLIT, FETCH, FETCH] * 2  # the exploration
    assert picked[8:] == [FETCH] * 6  # offload's step was faster: held
    d = arms.as_dict()["1"]
    assert d["step_ms"] == {SPLIT: 12.0, FETCH: 10.0} and d["explorations"] == 1
    assert d["steps"] == {SPLIT: 4, FETCH: 10}
    assert d["chosen"] is None  # the hold ran out: exploring again
    picked = drive(arms, 1, {SPLIT: 0.008, FETCH: 0.010}, 8 + 1)  # now the split is faster
    assert picked[:8] == [SPLIT, SPLIT, FETCH, FETCH] * 2 and picked[8] == SPLIT
    assert arms.as_dict()["1"]["explorations"] == 2


def test_arms_per_batch_size_and_robust_to_one_slow_step():
    from moestream.moe.share import FETCH, SPLIT, Arms

    arms = Arms(block=3, trials=2, hold=100, warmup=0)
    drive(arms, 4, {SPLIT: 0.02, FETCH: 0.03}, 12)
    assert arms.pick(4) == SPLIT and arms.pick(1) == SPLIT  # batch 1 has not explored yet
    # batch 1: the split's blocks each start with a 0.5 s step (a CUDA graph recorded): medians ignore it
    for _ in range(2):
        for arm, t in ((SPLIT, [0.5, 0.010, 0.010]), (FETCH, [0.012] * 3)):
            for x in t:
                assert arms.pick(1) == arm
                arms.observe(1, arm, x)
    assert arms.pick(1) == SPLIT and arms.pick(4) == SPLIT
    arms.observe(1, FETCH, 9.0)  # a step picked before a switch does not count for the held arm's block
    assert arms.pick(1) == SPLIT


def test_arms_time_the_split_only_after_its_share_warmed_up():
    """Each exploration starts with `warmup` untimed split steps (the live share converging): a slow split
    during them does not decide; after a hold on offload's step, the next exploration warms up again."""
    from moestream.moe.share import FETCH, SPLIT, Arms

    arms = Arms(block=2, trials=1, hold=3, warmup=5)
    picked = drive(arms, 1, {SPLIT: 9.0, FETCH: 0.010}, 5)  # the share at its prior: a very slow split
    assert picked == [SPLIT] * 5 and arms.as_dict()["1"]["explorations"] == 0
    picked = drive(arms, 1, {SPLIT: 0.008, FETCH: 0.010}, 4 + 2)  # converged: faster than offload's step
    assert picked == [SPLIT, SPLIT, FETCH, FETCH, SPLIT, SPLIT]
    assert arms.as_dict()["1"]["step_ms"] == {SPLIT: 8.0, FETCH: 10.0}
    assert arms.as_dict()["1"]["held_ms"] == 8.0  # the two held steps' mean
    arms = Arms(block=1, trials=1, hold=2, warmup=2)
    picked = drive(arms, 1, {SPLIT: 0.012, FETCH: 0.010}, 2 + 2 + 2 + 2)
    assert picked == [SPLIT, SPLIT, SPLIT, FETCH, FETCH, FETCH, SPLIT, SPLIT]  # hold ran out: warms up again
    assert arms.as_dict()["1"]["explorations"] == 1


def test_held_split_share_tuned_by_step_time():
    """While the split is held its share is tuned by step time, from the fitted share at the choice: the centre moves
    to a faster neighbour (by more than the margin), the step halves when neither is; shares stay in [0, SHARE_MAX].
    Step time here is a V around a share of 0.35 (what the H100's batch 4 showed: the fit drifted to 0.67 and the
    held steps slowed by half); the tuner walks from 0.67 down to within a step of it."""
    from moestream.moe.share import SPLIT, Arms

    arms = Arms(block=2, trials=1, hold=10_000, warmup=0, tune_step=0.1, tune_min=0.025, margin=0.03)
    drive(arms, 4, {SPLIT: 0.040, "fetch": 0.058}, 4)  # explored: the split chosen
    assert arms.pick(4) == SPLIT and arms.share_for(1, (0.5, 1.0)) is None  # batch 1 never explored
    seen = []
    for _ in range(200):
        frac, fixed = arms.share_for(4, (0.67, 1.7))  # the fit keeps saying 0.67: only the first call counts
        assert (fixed == 1.7 or (frac, fixed) == (0.0, 0.0)) and 0.0 <= frac <= Arms.SHARE_MAX
        seen.append(frac)
        arms.observe(4, SPLIT, 0.040 * (1 + abs(frac - 0.35)))
    d = arms.as_dict()["4"]
    # centre, +d, -d, then every miss on the CPU (share 0, fixed 0), in blocks of 2
    assert seen[:8] == pytest.approx([0.67, 0.67, 0.77, 0.77, 0.57, 0.57, 0.0, 0.0])
    assert abs(d["tuned_share"] - 0.35) <= 0.05 and d["tune_moves"] >= 3 and d["tune_step"] == 0.025
    # converged (a round at the finest step without a move): the centre alone runs until the next exploration
    assert d["tune_converged"] and len(set(seen[-40:])) == 1 and seen[-1] == pytest.approx(d["tuned_share"], abs=1e-4)
    # at the top bound the clamped candidate (the centre itself) is skipped
    arms = Arms(block=1, trials=1, hold=10_000, warmup=0)
    drive(arms, 1, {SPLIT: 0.01, "fetch": 0.02}, 2)
    seen = []
    for _ in range(3):
        frac, _ = arms.share_for(1, (0.99, 0.5))
        seen.append(frac)
        arms.observe(1, SPLIT, 0.01)
    assert seen == pytest.approx([0.95, 0.85, 0.0])  # centre (clamped), -d, all-CPU; +d skipped
    # where every miss on the CPU is fastest (the H100 host at 4.16 GiB: the split at 0.39 took 23.3 ms a step, the
    # `cpu` backend 19.4) the tuner moves there, though no local step from the fitted share would find it
    arms = Arms(block=2, trials=1, hold=10_000, warmup=0, margin=0.03)
    drive(arms, 1, {SPLIT: 0.023, "fetch": 0.029}, 4)
    for _ in range(40):
        frac, fixed = arms.share_for(1, (0.39, 2.7))
        cpu_only = (frac, fixed) == (0.0, 0.0)
        arms.observe(1, SPLIT, 0.0194 if cpu_only else 0.0233 + 0.01 * abs(frac - 0.39))
    d = arms.as_dict()["1"]
    assert d["tuned_share"] == 0.0 and d["tune_moves"] >= 1 and arms.share_for(1, (0.39, 2.7)) in ((0.0, 0.0),
                                                                                                   (0.1, 0.0))
    # a new exploration (the hold ran out) starts the tuner again from the fit of that time
    arms = Arms(block=1, trials=1, hold=3, warmup=0)
    drive(arms, 1, {SPLIT: 0.01, "fetch": 0.02}, 2)
    for _ in range(3):
        arms.share_for(1, (0.4, 0.0))
        arms.observe(1, SPLIT, 0.01)
    assert arms.share_for(1, (0.3, 0.0)) is None  # exploring again: the fit's share runs
    assert "tuned_share" not in arms.as_dict()["1"]


def test_a_tuned_share_slower_than_the_exploration_is_undone():
    """The converged centre's first block x trials steps are timed against the exploration's arms. Slower than the
    faster arm by the margin: where the split explored faster (the H100 host at 7.79 GiB: split 11.1 ms, offload's
    step 11.9, the tuned centre 14.1) the exploration's share runs again and is checked in its turn; where offload's
    step explored faster than the steps checked, it is held. Keeping up, the centre stays."""
    from moestream.moe.share import FETCH, SPLIT, Arms

    def run(explored, held, tuning=None, start=(0.4, 1.2), block=2, trials=1, steps=60):
        """tuning(frac) / held(frac): a split step's seconds while the share is tuned / once the tuner converged."""
        arms = Arms(block=block, trials=trials, hold=10_000, warmup=0, tune_step=0.1, tune_min=0.1, margin=0.03)
        drive(arms, 1, explored, 2 * block * trials)
        assert arms.pick(1) == SPLIT
        seen = []
        for _ in range(steps):
            if arms.pick(1) != SPLIT:
                seen.append(FETCH)
                arms.observe(1, FETCH, explored[FETCH])
                continue
            converged = arms.as_dict()["1"].get("tune_converged")
            frac, fixed = arms.share_for(1, start)
            seen.append((round(frac, 3), fixed))
            arms.observe(1, SPLIT, held(frac) if converged else (tuning or held)(frac))
        return seen, arms.as_dict()["1"]

    split_first = {SPLIT: 0.0111, FETCH: 0.0119}
    # the tuner walks from 0.4 to 0.3 (faster while tuned), which then holds at 14.1 ms: the exploration's share again,
    # which keeps up -> held there
    v = lambda frac: 0.0100 + 0.01 * abs(frac - 0.3) if frac else 0.05  # noqa: E731  (all-CPU: slow)
    seen, d = run(split_first, lambda frac: 0.0111 if frac == 0.4 else 0.0141, tuning=v)
    assert d["tune_moves"] >= 1 and d["reverted"] == "share" and d["chosen"] == SPLIT and d["checked_ms"] == 11.1
    assert seen[-1] == (0.4, 1.2) and FETCH not in seen
    # ... and where the exploration's share is slow too: offload's step, which explored faster
    seen, d = run(split_first, lambda frac: 0.0141, tuning=v)
    assert d["reverted"] == "fetch" and d["chosen"] == FETCH and seen[-1] == FETCH
    # the centre never moved (a flat valley) and holds slower than both arms explored: offload's step
    seen, d = run(split_first, lambda frac: 0.0141)
    assert d["tune_moves"] == 0 and d["reverted"] == "fetch" and d["chosen"] == FETCH
    # offload's step explored slower than the held steps: the split stays
    seen, d = run({SPLIT: 0.0111, FETCH: 0.0200}, lambda frac: 0.0141)
    assert "reverted" not in d and d["chosen"] == SPLIT and d["checked_ms"] == 14.1
    # keeping up (within the margin of the faster arm): nothing undone
    seen, d = run(split_first, lambda frac: 0.0112)
    assert d["chosen"] == SPLIT and "reverted" not in d and d["checked_ms"] == 11.2
    # a centre that decays after its first window (every miss on the CPU: the cache stops following the routing; the
    # H100 host at 11.3 GiB checked 8.3 ms a step, then ~20) is caught by a later window: the exploration's share
    n = [0]

    def decaying(frac):
        n[0] += 1
        return 0.0111 if frac == 0.4 else (0.0100 if n[0] <= 2 else 0.0200)

    seen, d = run(split_first, decaying, tuning=v)
    assert d["reverted"] == "share" and d["chosen"] == SPLIT and seen[-1] == (0.4, 1.2) and d["checked_ms"] == 11.1
    # drift within `recheck` after the first window: nothing undone
    n[0] = 0
    seen, d = run(split_first, lambda frac: 0.0111 if n.__setitem__(0, n[0] + 1) or n[0] <= 2 else 0.0118)
    assert "reverted" not in d and d["checked_ms"] == 11.8
    # a centre whose median keeps up but whose steps have a tail (every third step 30 ms: the mean is what tok/s sees)
    # is undone (offload's step, which explored faster than that); one slow step in a window is not
    k = [0]

    def tail(every):
        k[0] += 1
        return 0.0300 if k[0] % every == 0 else 0.0111

    for every, undone in ((3, True), (8, False)):
        k[0] = 0
        seen, d = run(split_first, lambda frac: tail(every), tuning=lambda frac: 0.0111, block=4, trials=2, steps=120)
        assert d["tune_converged"] and d.get("reverted") == ("fetch" if undone else None), (every, d)
    assert Arms._window([0.0111] * 7 + [0.0300]) == 0.0111 and Arms._window([0.0111, 0.0111, 0.0300]) > 0.017


def test_a_decaying_split_ends_its_tuning_early():
    """A held split whose centre block runs slower than offload's step explored (the split's cache decaying: the H100
    host at 11.68 GiB explored the split at 11.1 ms and offload's step at 14.6, then held split steps of ~20 ms) stops
    tuning at that block and goes to the check, which holds offload's step one window later — not after three tuning
    rounds (each with an all-CPU candidate) and a window. A centre slower than the explored split but faster than
    offload's step keeps tuning (the fit's share drifting: test_held_split_share_tuned_by_step_time)."""
    from moestream.moe.share import FETCH, SPLIT, Arms

    def run(held_s):
        arms = Arms(block=4, trials=3, hold=10_000, warmup=0)
        drive(arms, 1, {SPLIT: 0.0111, FETCH: 0.0146}, 24)  # the exploration: the split chosen
        assert arms.pick(1) == SPLIT
        for step in range(200):
            arm = arms.pick(1)
            if arm == FETCH:
                return step, arms.as_dict()["1"]
            arms.share_for(1, (0.35, 0.4))
            arms.observe(1, SPLIT, held_s)
        return None, arms.as_dict()["1"]

    step, d = run(0.0205)
    assert step == 4 + 12 and d["cut"] and d["reverted"] == "fetch" and d["chosen"] == FETCH, (step, d)
    step, d = run(0.0140)  # slower than the explored split, not than offload's step: tuned, then checked
    assert step is None or step > 4 + 12
    assert "cut" not in d


def test_holds_on_offloads_step_grow_until_the_split_wins_again():
    """Each hold that ends on offload's step doubles the next (up to HOLD_GROWTH holds): fewer explorations of a split
    that keeps losing; a hold that ends on the split resets it."""
    from moestream.moe.share import FETCH, SPLIT, Arms

    arms = Arms(block=1, trials=1, hold=4, warmup=0)
    picked = drive(arms, 1, {SPLIT: 0.020, FETCH: 0.015}, 2 + 4 + 2 + 8 + 2 + 16 + 2 + 32 + 2 + 32 + 2)
    explorations = [i for i in range(1, len(picked)) if picked[i] == SPLIT]
    assert explorations == [2 + 4, 2 + 4 + 2 + 8, 2 + 4 + 2 + 8 + 2 + 16, 2 + 4 + 2 + 8 + 2 + 16 + 2 + 32,
                            2 + 4 + 2 + 8 + 2 + 16 + 2 + 32 + 2 + 32]  # holds 4, 8, 16, 32, 32 (8 x 4 at most)
    assert arms.as_dict()["1"]["hold"] == 32
    # the last exploration above chose offload's step for 32 steps; then the split wins the next one and is held ...
    picked = drive(arms, 1, {SPLIT: 0.010, FETCH: 0.015}, 32 + 2 + 32)
    assert picked == [FETCH] * 32 + [SPLIT, FETCH] + [SPLIT] * 32
    d = arms.as_dict()["1"]
    assert d["chosen"] is None and d["hold"] == 4  # ... and after that hold the exploration is followed by the base

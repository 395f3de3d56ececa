"""hybrid's fetch share, live: how each decode layer call's misses are split between PCIe copies and the CPU
worker, set from the rates measured in the running decode steps.

A layer call with n misses fetches f of them and leaves n - f to the CPU. Fetching takes f t_p (t_p: one
expert's bytes over pinned PCIe); the CPU's call takes a + (n - f) t_c when it gets any (t_c: one more expert
on the CPU, a: the call's fixed cost: waking the threads, grouping the pairs, the barrier, the answer). Both
run at once, so the call's experts are ready after max(f t_p, a + (n - f) t_c), least at the f the route kernel
picks (device_cache.device_fetch_count) from the two numbers it reads at every call, a float32 device tensor
[frac, fixed] = [t_c, a] / (t_p + t_c): recorded CUDA graphs follow it with no re-recording. A few misses then
all go over PCIe (a CPU call for one expert costs more than fetching it), more are split.

t_c and a are what the CPU worker achieves inside the steps, a line fitted to its calls' (experts, seconds)
(CpuBridge.fit: the worker shares the machine with the launching thread and waits on every layer's request,
which an isolated benchmark misjudges); t_p comes from the pinned host-to-device rate (`moestream bench bw`, or
a short copy measured here). Before the first measurement the prior is the planner's split (`initial`, no CPU
fixed cost known: PRIOR_FIXED_S); each window of `every` steps with CPU calls moves the estimates halfway to its
fit; a window without any moves them a quarter of the way back to the prior, so a CPU once measured slow (a
noisy window) is tried again.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .device_cache import live_share

PRIOR_FIXED_S = 30e-6  # a CPU layer call's fixed cost until one is measured
MAX_CPU_GBS = 200.0  # no CPU computes an expert faster than this: bounds a fitted slope from below


def fit_line(window: np.ndarray, slope: float) -> tuple[float, float]:
    """(seconds per expert, fixed seconds) of the calls summed in window = [calls, sum c, sum t, sum c^2, sum ct];
    with a single expert count among them the slope cannot be fitted: `slope` is kept, the intercept fitted."""
    n, sc, st, scc, sct = (float(v) for v in window)
    mc, mt = sc / n, st / n
    var = scc / n - mc * mc
    if var > 1e-3:
        slope = (sct / n - mc * mt) / var
    return slope, mt - slope * mc


class LiveShare:
    def __init__(self, device: torch.device, initial: float, pcie_gbs: float, expert_bytes: float, every: int = 4):
        """initial: the planner's bandwidth split (the prior); expert_bytes: one expert's bytes (the layers'
        mean)."""
        self.pcie_gbs = pcie_gbs or measure_pcie_gbs(device)
        self.t_pcie = expert_bytes / (self.pcie_gbs * 1e9) if self.pcie_gbs > 0 else 1e-4
        initial = min(max(initial, 0.05), 0.95)
        self.prior = (self.t_pcie * initial / (1 - initial), PRIOR_FIXED_S)
        self.t_cpu, self.fixed_s = self.prior
        self.min_t_cpu = expert_bytes / (MAX_CPU_GBS * 1e9)
        self.tensor = live_share(0.0, 0.0, device)
        self._written: tuple | None = None  # the (frac, fixed) the tensor holds
        self.every, self.steps, self.windows = every, 0, 0
        self._mark = np.zeros(5)  # the worker's cumulative fit sums at the last window
        self._set()

    def observe(self, fit: np.ndarray) -> None:
        """After a decode step: the worker's cumulative per-call sums [calls, sum experts, sum seconds,
        sum experts^2, sum experts*seconds] (CpuBridge.fit); read once per window of `every` steps."""
        self.steps += 1
        if self.steps % self.every:
            return
        window, self._mark = np.asarray(fit, dtype=np.float64) - self._mark, np.array(fit, dtype=np.float64)
        if window[0] < 1:  # no CPU call in the window: a quarter of the way back to the prior
            self.t_cpu += 0.25 * (self.prior[0] - self.t_cpu)
            self.fixed_s += 0.25 * (self.prior[1] - self.fixed_s)
        else:
            slope, fixed = fit_line(window, self.t_cpu)
            self.t_cpu = 0.5 * self.t_cpu + 0.5 * max(slope, self.min_t_cpu)
            self.fixed_s = 0.5 * self.fixed_s + 0.5 * max(fixed, 0.0)
            self.windows += 1
        self._set()

    def _set(self) -> None:
        unit = self.t_pcie + self.t_cpu
        self.value, self.fixed = self.t_cpu / unit, self.fixed_s / unit
        self.use(self.value, self.fixed)

    def use(self, value: float, fixed: float) -> None:
        """The share the next steps' routes read: the fitted one, or the arms' tuned one (Arms.share_for); written
        to the device only when it changes, before a step is launched (a recorded graph reads it at replay)."""
        if self._written != (value, fixed):
            self.tensor.copy_(live_share(value, fixed))
            self._written = (value, fixed)

    def as_dict(self) -> dict:
        return {"fetch_share": round(self.value, 4), "fixed": round(self.fixed, 4), "pcie_gbs": round(self.pcie_gbs, 2),
                "pcie_expert_us": round(self.t_pcie * 1e6, 1), "cpu_expert_us": round(self.t_cpu * 1e6, 1),
                "cpu_call_fixed_us": round(self.fixed_s * 1e6, 1), "measured_windows": self.windows}


def measure_pcie_gbs(device: torch.device, chunk: int = 16 << 20, n: int = 4, rounds: int = 3) -> float:
    """Pinned host-to-device GB/s (0 off CUDA): the best of `rounds` timings of n chunk copies, ~4 ms on a
    PCIe 4/5 card. The best, not the mean: a copy can only be slowed by what else runs (on the H200 one
    single timing at a runtime's start read 23.9 GB/s where the bus does 54, and that split sent twice the
    misses it should to the CPU)."""
    if device.type != "cuda":
        return 0.0
    src = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(chunk, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    best = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        best = max(best, n * chunk / (time.perf_counter() - t) / 1e9)
    return best


SPLIT, FETCH = "split", "fetch"


class Arms:
    """hybrid's guard: for each decode batch size (rows), which of its two forms runs a step — SPLIT (the live
    split above: PCIe copies and CPU calls) or FETCH (every miss over PCIe, the CPU bridge out of the step:
    offload's step) — chosen by measured step times, so hybrid is never slower than offload for long. The line
    fitted to the worker's calls predicts a CPU call's own time, not what it costs the GPU's critical path (the
    post, the worker's wake-up, the polls over PCIe), which the step time does.

    Per rows: an exploration first runs `warmup` untimed steps on the split, so the live share (fitted once a
    window of LiveShare.every steps, and drifted back to its prior while offload's step held) has converged before
    the split is judged (on the H100, 2026-12-05, the split timed at its prior lost to offload's step at every cap
    while the converged split won by 9% at batch 1 and 28-36% at batch 4); then it runs the arms in alternating
    blocks of `block` steps until each has `trials` blocks (alternation cancels the slow drift of step times as
    contexts grow); an arm's time is the median of its blocks' medians (a block's first step may record a CUDA
    graph); the faster arm then runs `hold` steps, after which the exploration starts again (the rates change with
    contexts, batch mix and cache state). Each hold that ends on offload's step doubles the next one (up to
    HOLD_GROWTH x `hold`; one that ends on the split resets it): an exploration runs ~36 split steps, which cost most
    where the split loses — its held steps decaying as its cache stops following the routing (H100 host, 11.68 GiB,
    2026-12-07: explored at 11.1 ms a step, then ~20 against offload's 14.6) — so a long decode there explores less
    often.

    While the split is held its share is tuned by step time (`share_for`): the line fitted to the worker's calls
    misjudges the CPU's rate where its calls and the PCIe copies share the host's memory bandwidth (on the H100 host,
    2026-12-05, batch 4 explored the split at 40 ms a step, then the fit moved the share from 0.39 to 0.67 of the
    misses fetched and the held steps took 59 ms, slower than offload's 58). From the fitted share at the choice,
    blocks of `block` steps run the share, the share + d and the share - d; the centre moves to a neighbour that
    was faster by more than `margin`, else d halves (down to `tune_min`; a round there without a move ends the tuning:
    the centre is held alone until the next exploration, since every round also runs three other shares, one of them
    possibly far slower — on the H100 host at 7.79 GiB the tuned split held 12.6 ms a step where it was explored at
    10.9); shares stay in [0, SHARE_MAX]. The converged centre must then keep up: each block x trials of its steps
    are timed against the exploration's arms (`_check`), and where they are slower than the faster of them by the
    margin (the first window) or by `recheck` (the later ones) the tuning is undone: the exploration's share runs
    again where the split explored faster, and is checked in its turn; offload's step is held where it explored
    faster than what was checked. Each round
    also runs one block with every miss on the CPU (share 0 and no CPU fixed cost in the route's sum: `cpu` backend's
    step over hybrid's cache), which a local search from the fitted share need not reach: on the H100 host at 4.16 GiB
    (2026-12-06) the split held 0.39 of the misses fetched at 23.3 ms a step while the `cpu` backend took 19.4 ms. When
    it wins by the margin the centre moves there (share 0, fixed 0); its neighbours are then small fetch shares."""

    SHARE_MAX = 0.95  # a fetch fraction above this sends the CPU too few misses to pay for its call
    HOLD_GROWTH = 8  # the longest hold, in `hold`s, after explorations that kept ending on offload's step

    def __init__(self, block: int = 4, trials: int = 3, hold: int = 256, warmup: int = 24, tune_step: float = 0.1,
                 tune_min: float = 0.025, margin: float = 0.03, recheck: float = 0.10):
        self.block, self.trials, self.hold, self.warmup = block, trials, hold, warmup
        self.tune_step, self.tune_min, self.margin, self.recheck = tune_step, tune_min, margin, recheck
        self._rows: dict[int, dict] = {}

    def _state(self, rows: int) -> dict:
        st = self._rows.get(rows)
        if st is None:
            st = self._rows[rows] = {"times": {SPLIT: [], FETCH: []}, "block": [], "arm": SPLIT,
                                     "chosen": None, "held": 0, "held_s": 0.0, "warm": 0, "explorations": 0,
                                     "steps": {SPLIT: 0, FETCH: 0}, "tune": None, "hold": self.hold}
        return st

    def share_for(self, rows: int, fitted: tuple[float, float]) -> tuple[float, float] | None:
        """The (frac, fixed) share of the next split step of `rows` rows while the split is held (the tuner's
        candidate, starting from `fitted`, the live share's own at the choice); None while exploring (the fitted
        share runs)."""
        st = self._rows.get(rows)
        if st is None or st["chosen"] != SPLIT:
            return None
        if st["tune"] is None:
            st["tune"] = {"centre": min(max(fitted[0], 0.0), self.SHARE_MAX), "fixed": fitted[1],
                          "d": self.tune_step, "i": 0, "block": [], "t": {}, "moves": 0, "converged": False}
            st["tune"]["start"] = st["tune"]["centre"], fitted[1]
        tu = st["tune"]
        if tu["converged"]:
            return tu["centre"], tu["fixed"]
        c = self._CANDS[tu["i"]]
        return (0.0, 0.0) if c == "cpu" else (self._candidate(tu, c), tu["fixed"])

    _CANDS = (0, 1, -1, "cpu")  # the centre, its neighbours, every miss on the CPU

    def _candidate(self, tu: dict, sign: int) -> float:
        return min(max(tu["centre"] + sign * tu["d"], 0.0), self.SHARE_MAX)

    def _skipped(self, tu: dict, c) -> bool:
        """A candidate that would rerun the centre: a neighbour clamped to it, or all-CPU where the centre is."""
        if c == "cpu":
            return tu["centre"] == 0.0 and tu["fixed"] == 0.0
        return self._candidate(tu, c) == tu["centre"]

    def _check(self, st: dict, seconds: float) -> None:
        """A step of the converged centre: every block x trials of them, their median against the exploration's
        medians. Slower than the faster arm explored by more than the margin (the centre's first window; `recheck`
        for the windows after it, which step times drifting up with longer contexts must not trip), the centre is
        not what the exploration timed: the tuner walked somewhere worse (a block of a few steps is noisier than the
        margin, so a round can move the centre on noise; on the H100 host at 7.79 GiB, 2026-12-06, the split explored
        at 11.1 ms a step and offload's step at 11.9, then the tuned centre held 14.1), or the centre decays (every
        miss on the CPU fetches nothing, so the cache stops following the routing: at 11.3 GiB the all-CPU centre
        checked 8.3 ms a step, then slowed to ~20 as its hits fell from 0.69 to 0.34). The share the exploration ran
        (the fit's at the choice) then runs again where the split explored faster, and is checked the same way;
        offload's step is held where it explored faster than the steps checked; either until the next exploration."""
        tu = st["tune"]
        tu["check"].append(seconds)
        if len(tu["check"]) < self.block * self.trials:
            return
        held, tu["check"] = self._window(tu["check"]), []
        tu["checked_ms"] = round(held * 1e3, 3)
        margin = self.margin if not tu.get("windows") else self.recheck
        tu["windows"] = tu.get("windows", 0) + 1
        t = {a: float(np.median(v)) for a, v in st["times"].items() if v}
        if SPLIT not in t or FETCH not in t or held <= min(t.values()) * (1 + margin):
            return
        if not tu.get("reverted") and t[SPLIT] <= t[FETCH] and (tu["centre"], tu["fixed"]) != tu["start"]:
            tu["centre"], tu["fixed"] = tu["start"]  # the exploration's share, checked in its turn
            tu["reverted"], tu["windows"] = "share", 0
        elif t[FETCH] < held:
            st["chosen"], tu["reverted"] = FETCH, "fetch"

    @staticmethod
    def _window(steps: list[float]) -> float:
        """A checked window's step time: the larger of its median and its mean without its slowest step (a window of 4
        or more). The median alone misses a tail that tok/s sees — the H100 host at 7.79 GiB, 2026-12-06: the all-CPU
        centre's windows checked at a median of 13.96 ms against 13.67 explored while its held steps averaged 16.1 —
        and the plain mean would let one slow step (a collection, a page fault) undo a share that keeps up."""
        w = np.sort(np.asarray(steps, dtype=float))
        return float(max(np.median(w), (w[:-1] if len(w) >= 4 else w).mean()))

    def _tune(self, st: dict, seconds: float) -> None:
        """A held split step's time, for the tuner's current candidate. A centre block slower than offload's step
        explored (by the margin) ends the tuning there: the centre goes to `_check`, which undoes it within a window.
        The split's held steps can decay — its CPU-computed misses stay out of the cache, so its hits fall — faster
        than a tuning round shows (the H100 host at 11.68 GiB, 2026-12-07: the split explored at 11.1 ms a step,
        offload's step at 14.6; the held split's steps were checked at 20.5 ms only after three tuning rounds, and
        hybrid decoded 58.5 tok/s where offload decoded 67.0)."""
        tu = st["tune"]
        if tu["converged"]:
            return
        tu["block"].append(seconds)
        if len(tu["block"]) < self.block:
            return
        cand, med = self._CANDS[tu["i"]], float(np.median(tu["block"]))
        tu["t"][cand] = med
        tu["block"] = []
        fetch = st["times"][FETCH]
        if cand == 0 and fetch and med > float(np.median(fetch)) * (1 + self.margin):
            tu["converged"], tu["check"], tu["i"], tu["t"] = True, [], 0, {}
            tu["cut"] = True  # (reported: the tuning ended on a slow centre)
            return
        tu["i"] += 1
        while tu["i"] < len(self._CANDS) and self._skipped(tu, self._CANDS[tu["i"]]):
            tu["i"] += 1
        if tu["i"] < len(self._CANDS):
            return
        t = tu["t"]
        best = min(t, key=t.get)
        if best != 0 and t[best] < t[0] * (1 - self.margin):
            if best == "cpu":
                tu["centre"], tu["fixed"] = 0.0, 0.0
            else:
                tu["centre"] = self._candidate(tu, best)
            tu["moves"] += 1
        elif tu["d"] <= self.tune_min:  # no neighbour at the finest step beat the centre: hold it until the next
            tu["converged"] = True      # exploration (each round runs three other shares, one possibly far slower)
            tu["check"] = []            # ... once its steps have shown it keeps up with the exploration (_check)
        else:
            tu["d"] = max(tu["d"] / 2, self.tune_min)
        tu["i"], tu["t"] = 0, {}

    def held(self, rows: int) -> str | None:
        """The arm held for `rows` rows (None while exploring, or before any step of that size)."""
        st = self._rows.get(rows)
        return st["chosen"] if st is not None else None

    def pick(self, rows: int) -> str:
        """The arm of the next decode step of `rows` rows."""
        st = self._state(rows)
        if st["chosen"] is not None:
            return st["chosen"]
        return st["arm"]

    def observe(self, rows: int, arm: str, seconds: float) -> None:
        """A decode step of `rows` rows ran `arm` in `seconds` (launch to results)."""
        st = self._state(rows)
        st["steps"][arm] += 1
        if st["chosen"] is not None:
            st["held"] += 1
            st["held_s"] += seconds
            if st["tune"] is not None and arm == SPLIT:
                if st["tune"]["converged"]:
                    self._check(st, seconds)
                else:
                    self._tune(st, seconds)
            if st["held"] >= st["hold"]:  # explore again (sooner after a hold on the split)
                grown = min(2 * st["hold"], self.HOLD_GROWTH * self.hold)
                st.update(chosen=None, held=0, held_s=0.0, warm=0, arm=SPLIT, block=[], times={SPLIT: [], FETCH: []},
                          tune=None, hold=grown if st["chosen"] == FETCH else self.hold)
            return
        if st["warm"] < self.warmup:  # the split's share converging: not timed
            st["warm"] += arm == SPLIT
            return
        if arm != st["arm"]:  # a step picked before a switch: not this block's
            return
        st["block"].append(seconds)
        if len(st["block"]) < self.block:
            return
        st["times"][arm].append(float(np.median(st["block"])))
        st["block"] = []
        st["arm"] = FETCH if arm == SPLIT else SPLIT
        t = st["times"]
        if len(t[SPLIT]) >= self.trials and len(t[FETCH]) >= self.trials:
            st["chosen"] = min((SPLIT, FETCH), key=lambda a: float(np.median(t[a])))
            st["explorations"] += 1
            st["last"] = {a: round(float(np.median(t[a])) * 1e3, 3) for a in t}

    def as_dict(self) -> dict:  # (HeldFetch's too)
        """Per rows: the arm held (None: exploring), the last exploration's median step ms per arm, the steps a hold
        lasts, the mean step ms of the steps held since (does the chosen arm keep its exploration's time?),
        explorations, steps run by each arm."""
        return {str(r): {"chosen": st["chosen"], "step_ms": st.get("last"), "hold": st["hold"],
                         "held_ms": round(st["held_s"] / st["held"] * 1e3, 3) if st["held"] else None,
                         "explorations": st["explorations"], "steps": dict(st["steps"]),
                         **({"tuned_share": round(st["tune"]["centre"], 4), "tune_step": st["tune"]["d"],
                             "tune_moves": st["tune"]["moves"], "tune_converged": st["tune"]["converged"],
                             **{k: st["tune"][k] for k in ("checked_ms", "reverted", "cut") if k in st["tune"]}}
                            if st["tune"] else {})}
                for r, st in sorted(self._rows.items())}


class HeldFetch(Arms):
    """hybrid's arms where its cache holds most of the experts (over planner.HYBRID_MAX_RESIDENCY): offload's step in
    every decode step, the split never explored. A batch-1 call there misses one or two experts, fewer than a CPU
    call's fixed cost pays for, and every miss the split leaves to the CPU stays out of the cache, so the split's steps
    degrade the cache both arms run on — which alternating blocks cannot see (H100 host, Qwen3.6 Q8_0 at 22.84 GiB,
    57 % cached, 2026-12-07: the arms explored the split at 10.15 ms and offload's step at 10.50, held the latter at
    11.8, with hits 0.62; offload alone stepped 8.4 ms with hits 0.80)."""

    def pick(self, rows: int) -> str:
        self._state(rows)["chosen"] = FETCH
        return FETCH

    def held(self, rows: int) -> str | None:
        return FETCH

    def share_for(self, rows: int, fitted: tuple[float, float]) -> tuple[float, float] | None:
        return None

    def observe(self, rows: int, arm: str, seconds: float) -> None:
        st = self._state(rows)
        st["chosen"] = FETCH
        st["steps"][arm] += 1
        st["held"] += 1
        st["held_s"] += seconds

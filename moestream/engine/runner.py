"""The model side of a step: what the scheduler scheduled -> a ForwardBatch -> the engine's forward pass
-> sampled tokens.

`ModelRunner.run(ScheduledBatch) -> StepResult`: builds the flat batch (ids, positions, KV indices, the
rows whose logits are needed), runs the engine (one rank, or rank 0 of a tensor-parallel group), takes
prompt logprobs, verifies speculative drafts (rolling the linear state back to the last kept row), copies
an n > 1 parent's prompt caches into its children and samples one token per request that reached its
newest token. `draft` runs the MTP block after a step (--speculative mtp). The runner keeps each request's
sampling state: generator, grammar matcher, reasoning block and its budget, forced tokens, drafts; the
scheduler keeps its pages, slots and progress. A request whose own part of the step raises (its mask,
penalties, grammar, verification) is reported in `StepResult.failed` and the others go on (`_guarded`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch

from ..batch import DecodeArrays, ForwardBatch, SeqMeta
from ..core import RequestError
from ..kvcache import raw
from ..scheduler.batch import ScheduledBatch, StepResult
from ..scheduler.request import Request, Status
from .sampler import (PenaltyState, apply_bitmask, apply_penalties, logprobs_of, sample, sample_device,
                      verify_drafts)

log = logging.getLogger("moestream.engine")


@dataclass
class _Rows:
    """Where each logits row of a step goes (rows are in the order the batch asked for them)."""

    logits: list[int] = field(default_factory=list)  # flat batch rows whose logits are computed
    prompt: list[tuple[Request, int, int]] = field(default_factory=list)  # (req, prompt token, logits row)
    sample: list[int] = field(default_factory=list)  # logits rows that sample, one per sampling request
    verify: list[tuple[Request, int, int, list[int]]] = field(default_factory=list)  # (req, 1st row, n, slots)

    @property
    def split(self) -> bool:
        """Rows other than the sampling ones were asked for (prompt logprobs, verify steps)."""
        return bool(self.prompt or self.verify)


def _guarded(failed: list, req: Request, fn, *args) -> bool:
    """fn(*args), a piece of req's own work in this step (its grammar, its drafts' verification, its row's
    mask and penalties): an exception there is req's alone, so it is logged, (req, why) goes to `failed`
    (the scheduler ends req with an error) and False comes back. Raising instead would fail the whole
    step: the server would recompute every request in it, LLM.generate would fail for all of them."""
    try:
        fn(*args)
        return True
    except RequestError as e:  # the request's own input cannot go on (e.g. its grammar has no way forward)
        log.warning("request %s ended: %s", req.id, e)
        failed.append((req, str(e), True))
        return False
    except Exception as e:
        log.exception("request %s failed in this step; the others in it go on", req.id)
        failed.append((req, f"internal error: {type(e).__name__}: {e}", False))
        return False


@dataclass
class Inflight:
    """An overlapped decode step (LLMEngine): launched, its tokens sampled on the device (`tokens`, one per
    sequence in `sched`'s order), copied to `host` behind an `event`; read by ModelRunner.read."""

    sched: ScheduledBatch
    tokens: torch.Tensor
    host: torch.Tensor
    event: object = None
    rows: dict = field(default_factory=dict)  # request id -> its row in tokens

    def live(self) -> bool:
        """Some request of this step still runs (its token is wanted)."""
        return any(s.req.status == Status.RUNNING for s in self.sched.seqs)


class ModelRunner:
    def __init__(self, engine, eos: set[int], tokenizer=None):
        """engine: an Engine (or parallel.TPEngine); eos: the stop token ids, shared with the scheduler."""
        self.engine = engine
        self.eos = eos
        tok = tokenizer
        self.think_start = tok.token_to_id("<think>") if tok is not None else None
        self.think_end = tok.token_to_id("</think>") if tok is not None else None
        # what a spent thinking budget forces: the end of the block, as the chat templates write it
        self.think_close = tok.encode("\n</think>\n\n") if tok is not None and self.think_end is not None else []
        # --speculative mtp: K drafts per decoding request and step, verified in the next forward pass
        self.spec_k = engine.ecfg.num_speculative_tokens if getattr(engine, "use_mtp", False) else 0
        self.spec_totals = {"verify_steps": 0, "drafted": 0, "accepted": 0, "emitted": 0,
                            "drafted_at": [0] * self.spec_k, "accepted_at": [0] * self.spec_k}
        self._batch: ForwardBatch | None = None  # the last step's, for the drafter (speculating only)

    # ---- one step ------------------------------------------------------------------------------
    def run(self, sched: ScheduledBatch) -> StepResult:
        batch, rows = self.build(sched)
        try:
            return self._run(sched, batch, rows)
        finally:  # the step's results are on the host (or it raised): what worked beside the GPU is waited
            self.engine.finish_step()  # for, and its failure fails this step before any token is emitted

    def _run(self, sched: ScheduledBatch, batch: ForwardBatch, rows: _Rows) -> StepResult:
        logits = self.engine.forward(batch)
        self.engine.wait_forward()  # (cpu / hybrid on a GPU: asleep while the CPU worker computes)
        if self.spec_k:
            self._batch = batch
        failed: list[tuple[Request, str]] = []  # requests whose own work raised (_guarded): they alone fail
        if not rows.split:
            return StepResult([], self._sample(sched, logits, failed), failed)
        if rows.prompt:  # prompt_logprobs or verify steps asked for extra rows: split them off
            self._prompt_logprobs(logits, rows.prompt)
        # sampled before verified: sampling is what can still fail the whole step, and it then fails before
        # any request's verification cleared its drafts, rolled its state back and advanced its reasoning
        sampled = self._sample(sched, logits[torch.tensor(rows.sample, dtype=torch.long, device=logits.device)],
                               failed)
        return StepResult(self._verify(logits, rows.verify, failed), sampled, failed)

    def build(self, sched: ScheduledBatch, prev: "Inflight | None" = None) -> tuple[ForwardBatch, _Rows]:
        """The ForwardBatch of a scheduled step, and where its logits rows go. prev: the overlapped step in flight
        whose tokens this step's pending rows read (a CUDA decode step then carries their rows in prev's tokens,
        extra "prev_rows")."""
        dev, kv = self.engine.device, self.engine.caches.kv
        if not self.spec_k and all(s.n == 1 and s.samples for s in sched.seqs) and not sched.prompt:
            if dev.type == "cpu":
                return self._build_decode(sched, kv)
            if dev.type == "cuda":
                return self._build_decode_cuda(sched, kv, prev)
        return self._build_general(sched)

    def _build_general(self, sched: ScheduledBatch) -> tuple[ForwardBatch, _Rows]:
        """build() of any step."""
        dev, kv = self.engine.device, self.engine.caches.kv
        ids, pos, seqs, rows, start = [], [], [], _Rows(), 0
        ckpt = self.engine.caches.state.checkpoint_slots if self.spec_k else []
        for s in sched.seqs:
            req, c, n = s.req, s.cached, s.n
            kv_index = kv.flat_index(req.pages, 0, c + n, dev)
            pos += range(c, c + n)
            if s.verify:  # the newest token and its drafts, every row's logits
                j = len(rows.verify) * self.spec_k
                slots = ckpt[j:j + n - 1] if ckpt else None  # the state after each position but the last
                ids += req.all_ids[c:c + 1] + req.drafts[:n - 1]
                seqs.append(SeqMeta(start=start, length=n, cached=c, state_slot=req.state_slot, kv_index=kv_index,
                                    checkpoints=slots))
                rows.verify.append((req, len(rows.logits), n, slots or []))
                rows.logits += range(start, start + n)
            else:
                ids += req.all_ids[c:c + n]
                seqs.append(SeqMeta(start=start, length=n, cached=c, state_slot=req.state_slot, kv_index=kv_index,
                                    snapshots=s.snapshots))
                self._logit_rows(s, start, rows)
            start += n
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            seqs=seqs, kv_write_index=torch.cat([q.kv_index[q.cached:] for q in seqs]),
            logits_index=torch.tensor(rows.logits, dtype=torch.long, device=dev),
            state_slots=torch.tensor([q.state_slot for q in seqs], dtype=torch.long, device=dev),
            state_resets=sched.state_resets, state_loads=sched.state_loads, state_saves=sched.state_saves,
            kv_copies=sched.kv_copies, host_copies=sched.host_copies, prompt=sched.prompt)
        if self.spec_k:
            batch.extra["keep_hidden"] = True  # the drafter reads every row's final hidden state
            if rows.verify and len(rows.verify) + sum(1 for q in seqs if q.length == 1) == len(seqs):
                batch.extra["decode_like"] = True  # decode and verify rows only: decode's kernels (engine)
        return batch, rows

    @staticmethod
    def _decode_fields(sched: ScheduledBatch, kv, buf: np.ndarray, rows_at: int) -> None:
        """The decode builders' shared layout: each sequence's KV rows back to back from buf[rows_at], and the first
        5 B values B token ids, B positions, B KV write slots (each sequence's last row), B state slots, the B
        logits rows 0..B-1 (every row samples)."""
        seqs = sched.seqs
        o, writes = rows_at, []
        for s in seqs:
            n = s.cached + 1
            buf[o:o + n] = kv.flat_rows(s.req.pages, n)
            writes.append(int(buf[o + n - 1]))
            o += n
        B = len(seqs)
        buf[:5 * B] = ([s.req.token_at(s.cached) for s in seqs] + [s.cached for s in seqs] + writes
                       + [s.req.state_slot for s in seqs] + list(range(B)))

    @staticmethod
    def _decode_batch(sched: ScheduledBatch, t: torch.Tensor, rows_at: int) -> tuple[ForwardBatch, _Rows]:
        """The ForwardBatch whose tensors are views of t, laid out by _decode_fields."""
        seqs = sched.seqs
        B = len(seqs)
        metas, o = [], rows_at
        for i, s in enumerate(seqs):
            n = s.cached + 1
            metas.append(SeqMeta(start=i, length=1, cached=s.cached, state_slot=s.req.state_slot,
                                 kv_index=t[o:o + n], snapshots=s.snapshots))
            o += n
        batch = ForwardBatch(
            input_ids=t[:B], positions=t[B:2 * B], seqs=metas, kv_write_index=t[2 * B:3 * B],
            logits_index=t[4 * B:5 * B], state_slots=t[3 * B:4 * B], state_resets=sched.state_resets,
            state_loads=sched.state_loads, state_saves=sched.state_saves, kv_copies=sched.kv_copies,
            host_copies=sched.host_copies, prompt=False)
        rows = list(range(B))
        return batch, _Rows(logits=rows, sample=list(rows))

    @staticmethod
    def _build_decode(sched: ScheduledBatch, kv) -> tuple[ForwardBatch, _Rows]:
        """build() of a CPU step where every sequence decodes its newest token and samples after it (no prompt
        rows, no drafts): the same batch, its indices written into one int64 buffer (DecodeArrays: _decode_fields,
        then the B + 1 offsets of each sequence's KV rows) whose views are the batch's tensors, and which the
        compiled decode step reads by address. Fewer host operations than the general build, whose cost a small
        model's decode step pays every token."""
        B = len(sched.seqs)
        totals = [s.cached + 1 for s in sched.seqs]
        buf = np.empty(6 * B + 1 + sum(totals), dtype=np.int64)
        ModelRunner._decode_fields(sched, kv, buf, 6 * B + 1)
        buf[5 * B:6 * B + 1] = [0, *accumulate(totals)]
        batch, rows = ModelRunner._decode_batch(sched, torch.from_numpy(buf), 6 * B + 1)
        batch.extra["host"] = DecodeArrays(buf, B, buf.ctypes.data)
        return batch, rows

    def _build_decode_cuda(self, sched: ScheduledBatch, kv, prev) -> tuple[ForwardBatch, _Rows]:
        """build() of a CUDA step where every sequence decodes its newest token and samples after it: the step's
        indices (_decode_fields, then the B KV lengths and the B rows in prev's tokens) written into one pinned int64
        host buffer and copied to the device with ONE asynchronous copy; the batch's tensors are views of the device
        copy. A copy from pageable memory (what torch.tensor(..., device=) does) first waits for everything queued on
        the stream, which would make an overlapped step wait for the step in flight."""
        seqs = sched.seqs
        B = len(seqs)
        totals = [s.cached + 1 for s in seqs]
        n = 7 * B + sum(totals)
        host = self._pinned_batch(n)
        buf = host.numpy()
        self._decode_fields(sched, kv, buf, 7 * B)
        buf[5 * B:6 * B] = totals
        buf[6 * B:7 * B] = [prev.rows[s.req.id] for s in seqs] if prev is not None else 0
        t = host[:n].to(self.engine.device, non_blocking=True)
        batch, rows = self._decode_batch(sched, t, 7 * B)
        batch.extra["decode_lengths"] = t[5 * B:6 * B]
        if prev is not None:
            batch.extra["prev_rows"] = t[6 * B:7 * B]
        return batch, rows

    def _pinned_batch(self, n: int) -> torch.Tensor:
        """A pinned int64 host buffer of at least n values for _build_decode_cuda: two in turn, so the one written
        now is not the one a copy still queued behind the step in flight reads (that copy was queued before the
        event the last read waited for)."""
        bufs = getattr(self, "_batch_bufs", None)
        if bufs is None or bufs[0].shape[0] < n:
            size = max(n, 4096, 2 * (bufs[0].shape[0] if bufs else 0))
            pin = self.engine.device.type == "cuda"
            bufs = self._batch_bufs = [torch.empty(size, dtype=torch.long, pin_memory=pin) for _ in range(2)]
            self._batch_turn = 0
        self._batch_turn ^= 1
        return bufs[self._batch_turn]

    @staticmethod
    def _logit_rows(s, start: int, rows: _Rows) -> None:
        """The logits rows of a prefill chunk or decode token: its prompt logprob rows, and its last row
        when it samples."""
        req, c, n = s.req, s.cached, s.n
        if req.prompt_lps:  # the row at position j predicts prompt token j + 1
            for j in range(max(c, len(req.prompt_lps) - 1), min(c + n, len(req.prompt_ids) - 1)):
                rows.prompt.append((req, j + 1, len(rows.logits)))
                rows.logits.append(start + j - c)
        if s.samples:  # the chunk reaches the newest token: sample the next one
            if not rows.logits or rows.logits[-1] != start + n - 1:
                rows.logits.append(start + n - 1)
            rows.sample.append(len(rows.logits) - 1)

    # ---- overlapped decode -------------------------------------------------------------------------
    @staticmethod
    def overlappable(req: Request) -> bool:
        """A request whose tokens may be sampled on the device and read a step later (sampler.sample_device: greedy
        or drawn with its generator): nothing read or changed on the host between its logits and its token
        (penalties, bias, min_tokens, grammar, logprobs, forced tokens, a thinking budget, drafts)."""
        p = req.params
        return (not p.needs_processing and req.matcher is None and p.logprobs is None
                and not req.forced and not (req.thinking and p.max_thinking_tokens is not None) and not req.drafts)

    def launch(self, sched: ScheduledBatch, prev: Inflight | None = None) -> Inflight:
        """Launch a decode step (one token of every sequence, all overlappable) without waiting for it: rows whose
        newest token is still pending take it from `prev`'s device tokens; the step's tokens are sampled on the
        device (sampler.sample_device) and copied to host memory behind an event (read: `read`)."""
        batch, _ = self.build(sched, prev)
        batch.extra["overlapped"] = prev is not None  # prev is still pending (the expert runtime keeps its job)
        if prev is not None:
            idx = batch.extra.get("prev_rows")
            if idx is None:
                idx = torch.tensor([prev.rows[s.req.id] for s in sched.seqs], dtype=torch.long)
            batch.input_ids.copy_(prev.tokens.index_select(0, idx))  # in place: a CPU step reads the ids by address
        logits = self.engine.forward(batch)
        reqs = [s.req for s in sched.seqs]
        tokens = sample_device(logits, [r.params for r in reqs], [r.generator for r in reqs])
        B = len(sched.seqs)
        event = None
        if tokens.is_cuda:
            host = self._host_tokens(B)
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = tokens
        return Inflight(sched, tokens, host, event, {s.req.id: i for i, s in enumerate(sched.seqs)})

    def _host_tokens(self, B: int) -> torch.Tensor:
        """A pinned host buffer for B tokens: two in turn (the step in flight and the one being read)."""
        bufs = getattr(self, "_pinned", None)
        if bufs is None or bufs[0].shape[0] < B:
            n = max(B, self.engine.ecfg.max_running_requests)
            bufs = self._pinned = [torch.empty(n, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self._turn = 0
        self._turn ^= 1
        return bufs[self._turn][:B]

    def read(self, inf: Inflight) -> list[tuple[Request, int]]:
        """Wait for an overlapped step's tokens: (request, token) in its order, the reasoning bookkeeping done."""
        try:
            if inf.event is not None:
                self.engine.wait_forward()
                inf.event.synchronize()
            toks = inf.host.tolist()
        finally:
            self.engine.finish_step()
        out = []
        for s, tok in zip(inf.sched.seqs, toks):
            if s.req.status == Status.RUNNING:
                self._track(s.req, tok)
            out.append((s.req, tok))
        return out

    # ---- sampling ------------------------------------------------------------------------------
    def _sample(self, sched: ScheduledBatch, logits: torch.Tensor,
                failed: list) -> list[tuple[Request, int, tuple | None]]:
        """One token for each request that reached its newest token (logits: one row each), then for each
        child adopted this step (from its parent's row). A request whose own mask, penalties or grammar
        raise goes to `failed` instead (_guarded)."""
        reqs = [s.req for s in sched.seqs if s.samples]
        if sched.forks:
            reqs, logits = self._fork(sched.forks, reqs, logits)
        if not reqs:
            return []
        raw = logits
        self._force_think_close(reqs)
        # penalties, logit_bias, min_tokens and grammar masks touch only the rows of requests that use them
        touched = [i for i, r in enumerate(reqs)
                   if (r.params.needs_processing or (r.matcher is not None and not r.thinking)) and not r.forced]
        bad: set[int] = set()
        if touched:
            logits = logits.clone()
            bad = {i for i in touched if not _guarded(failed, reqs[i], self._process_row, reqs[i], logits[i])}
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        for i, req in enumerate(reqs):
            if req.forced:
                tokens[i] = req.forced.pop(0)
        lps = self._logprobs(raw, reqs, tokens)
        return [(req, tok, lps.get(i)) for i, (req, tok) in enumerate(zip(reqs, tokens))
                if i not in bad and _guarded(failed, req, self._track, req, tok)]

    def _fork(self, forks, reqs: list[Request], logits: torch.Tensor):
        """Each adopted child gets copies of its parent's prompt K/V and linear state (the pass just computed
        them) and its parent's logits row."""
        rows = []
        for kid, parent in forks:
            self._copy_caches(parent, kid, len(kid.prompt_ids))
            rows.append(reqs.index(parent))
        idx = torch.tensor(list(range(len(reqs))) + rows, dtype=torch.long, device=logits.device)
        return reqs + [kid for kid, _ in forks], logits[idx]

    def _copy_caches(self, src: Request, dst: Request, n: int) -> None:
        kv, dev = self.engine.caches.kv, self.engine.device
        if kv.k is not None:
            a = kv.flat_index(src.pages, 0, n, dev)
            b = kv.flat_index(dst.pages, 0, n, dev)
            for t in (raw(kv.k), raw(kv.v)):
                t[:, b] = t[:, a]
        self.engine.caches.state.copy([(src.state_slot, dst.state_slot)])

    def _force_think_close(self, reqs: list[Request]) -> None:
        """A spent thinking budget closes the block: its closing tokens are emitted next."""
        for req in reqs:
            p = req.params
            if (req.thinking and p.max_thinking_tokens is not None and not req.forced
                    and req.thinking_tokens >= p.max_thinking_tokens and self.think_end is not None):
                close = list(self.think_close) or [self.think_end]
                if req.matcher is not None and self.think_end in close:  # the grammar starts right after it
                    close = close[:close.index(self.think_end) + 1]
                req.forced = close

    def _process_row(self, req: Request, row: torch.Tensor) -> None:
        p = req.params
        if p.needs_processing:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos)
            req.penalties = req.penalties or PenaltyState()  # kept: a step then costs its new tokens only
            apply_penalties(row, p, req.prompt_ids, req.output_ids, stops, req.penalties)
        if req.matcher is not None and not req.thinking and not req.matcher.done:
            apply_bitmask(row, req.matcher.allowed())
            if why := req.matcher.dead_end():
                raise RequestError(why)

    def _track(self, req: Request, tok: int) -> None:
        """Reasoning-block bookkeeping and the grammar's state after `tok` (before the next step samples)."""
        if req.thinking:
            if tok == self.think_end:
                req.thinking = False  # the block ended (by the model, or by the forced close)
                if req.matcher is not None:
                    req.matcher.prefetch()
            else:
                req.thinking_tokens += 1
            return
        if req.matcher is not None and not req.matcher.done:
            req.matcher.consume(tok)
            if why := req.matcher.dead_end():  # not a stop: the value is incomplete (_guarded ends req, a 400)
                raise RequestError(why)
        elif tok == self.think_start and self.think_start is not None and req.matcher is None:
            req.thinking = True

    def _logprobs(self, raw: torch.Tensor, reqs: list[Request], tokens: list[int]) -> dict[int, tuple]:
        idx = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not idx:
            return {}
        rows = raw[torch.tensor(idx, dtype=torch.long, device=raw.device)]
        got = logprobs_of(rows, [tokens[i] for i in idx], [reqs[i].params.logprobs for i in idx])
        return dict(zip(idx, got))

    def _prompt_logprobs(self, logits: torch.Tensor, prompt_rows: list[tuple[Request, int, int]]) -> None:
        rows = logits[torch.tensor([r for _, _, r in prompt_rows], dtype=torch.long, device=logits.device)]
        got = logprobs_of(rows, [req.prompt_ids[k] for req, k, _ in prompt_rows],
                          [req.params.prompt_logprobs for req, _, _ in prompt_rows])
        for (req, k, _), lp in zip(prompt_rows, got):
            if k == len(req.prompt_lps):
                req.prompt_lps.append(lp)

    # ---- speculative decoding (--speculative mtp) -------------------------------------------
    def _verify(self, logits: torch.Tensor, spec, failed: list) -> list[tuple[Request, list[int]]]:
        """Each verified request keeps its longest agreeing prefix of drafts plus one token of the target
        (sampler.verify_drafts); its linear state rolls back to the last kept position (one slot copy). A
        request whose verification raises goes to `failed` (_guarded): the others keep their tokens."""
        out: list[tuple[Request, list[int]]] = []
        for req, row, n, slots in spec:
            _guarded(failed, req, self._verify_one, out, req, logits[row:row + n], slots)
        return out

    def _verify_one(self, out: list, req: Request, rows: torch.Tensor, slots: list[int]) -> None:
        """Verify req's drafts against its logits `rows` (one per draft and one after them) -> out."""
        drafts, req.drafts = req.drafts[:rows.shape[0] - 1], []
        toks = verify_drafts(rows, drafts, req.params, req.generator)
        a, t = len(toks) - 1, self.spec_totals
        t["verify_steps"] += 1
        t["drafted"] += len(drafts)
        t["accepted"] += a
        t["emitted"] += len(toks)
        for i in range(len(drafts)):
            t["drafted_at"][i] += 1
            t["accepted_at"][i] += i < a
        if a < len(drafts) and slots:
            self.engine.caches.state.copy([(slots[a], req.state_slot)])
        for tok in toks:
            self._track(req, tok)
        out.append((req, toks))

    def spec_stats(self) -> dict:
        """Speculative decoding's counters: drafts proposed and accepted (in all and per draft position),
        verify steps, tokens emitted by them (accepted drafts + the target's own token)."""
        t = self.spec_totals
        rate = [a / d if d else 0.0 for a, d in zip(t["accepted_at"], t["drafted_at"])]
        return {"method": "mtp", "num_speculative_tokens": self.spec_k, **{k: v for k, v in t.items()
                if not isinstance(v, list)}, "drafted_per_position": list(t["drafted_at"]),
                "accepted_per_position": list(t["accepted_at"]), "acceptance_rate_per_position": rate,
                "acceptance_rate": t["accepted"] / t["drafted"] if t["drafted"] else 0.0,
                "tokens_per_verify_step": t["emitted"] / t["verify_steps"] if t["verify_steps"] else 0.0}

    def draft(self, sched: ScheduledBatch, room) -> None:
        """The MTP block after a step: over every position the step computed (its K/V, so later drafts attend
        to the whole sequence), then K drafts for each decoding request, one MTP pass per draft position.
        room(req, position): the scheduler gives req the page of `position` or says there is none
        (Scheduler.draft_room); a request without one drafts no further."""
        batch, self._batch = self._batch, None
        fill, src, drafters, rows = self._fill_batch(sched, batch)
        if fill is None:
            return
        logits = self.engine.draft(fill, self.engine.model.hidden[src], 0)
        for req, tok in zip(drafters, torch.argmax(logits, dim=-1).tolist()):
            req.drafts = [tok]
        rows = list(range(len(drafters)))  # the block's hidden holds the drafting rows only, in drafters' order
        for step in range(1, self.spec_k):
            live = [(r, row) for r, row in zip(drafters, rows) if room(r, r.num_computed - 1 + step)]
            if not live:
                return
            self._draft_step(live, step)
            drafters, rows = [r for r, _ in live], list(range(len(live)))

    def _fill_batch(self, sched: ScheduledBatch, batch: ForwardBatch):
        """The MTP block's first pass: every position the step computed (token t + 1 with hidden t), logits at
        the last row of each request that drafts. (batch, hidden rows, drafters, their rows); batch None
        when no request advanced."""
        dev, kv = self.engine.device, self.engine.caches.kv
        ids, pos, seqs, src, rows, drafters = [], [], [], [], [], []
        start = 0
        for s, q in zip(sched.seqs, batch.seqs):
            req, c0, c1 = s.req, s.cached, s.req.num_computed
            if req.status != Status.RUNNING or c1 <= c0:
                continue
            L = c1 - c0
            ids += req.all_ids[c0 + 1:c1 + 1]  # the token after each position
            pos += range(c0, c1)
            src += range(q.start, q.start + L)
            seqs.append(SeqMeta(start=start, length=L, cached=c0, state_slot=req.state_slot,
                                kv_index=kv.flat_index(req.pages, 0, c1, dev)))
            if not req.in_prefill and req.can_draft:
                rows.append(start + L - 1)
                drafters.append(req)
            start += L
        if not seqs:
            return None, None, [], []
        fill = ForwardBatch(input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
                            positions=torch.tensor(pos, dtype=torch.long, device=dev), seqs=seqs,
                            kv_write_index=torch.cat([q.kv_index[q.cached:] for q in seqs]),
                            logits_index=torch.tensor(rows, dtype=torch.long, device=dev))
        if rows:  # the rows the block's MLP and experts run for (QwenMoeModel.draft), as a host list for route taps
            fill.extra["draft_rows"] = rows
        if all(q.length <= 1 + self.spec_k for q in seqs):  # after a decode / verify step: a few rows a request,
            fill.extra["decode_like"] = True  # whose experts take the decode path (not a prompt chunk's streaming)
        return fill, torch.tensor(src, dtype=torch.long, device=dev), drafters, rows

    def _draft_step(self, live: list[tuple[Request, int]], step: int) -> None:
        """Draft position `step` of each live request: the block's own output at its last row is the next
        input, its newest draft the next token."""
        dev, kv = self.engine.device, self.engine.caches.kv
        prev = self.engine.model.hidden
        ps = [r.num_computed - 1 + step for r, _ in live]
        seqs = [SeqMeta(start=i, length=1, cached=p, state_slot=r.state_slot,
                        kv_index=kv.flat_index(r.pages, 0, p + 1, dev))
                for i, ((r, _), p) in enumerate(zip(live, ps))]
        ids = torch.tensor([r.drafts[-1] for r, _ in live], dtype=torch.long, device=dev)
        nxt = ForwardBatch(input_ids=ids, positions=torch.tensor(ps, dtype=torch.long, device=dev), seqs=seqs,
                           kv_write_index=torch.cat([q.kv_index[-1:] for q in seqs]),
                           logits_index=torch.arange(len(live), dtype=torch.long, device=dev))
        src = torch.tensor([row for _, row in live], dtype=torch.long, device=dev)
        logits = self.engine.draft(nxt, prev[src], step)
        for (r, _), tok in zip(live, torch.argmax(logits, dim=-1).tolist()):
            r.drafts.append(tok)

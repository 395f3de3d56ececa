"""Decode with and without MTP speculative decoding (issue 22) at full Qwen3.6-35B-A3B shape on capped VRAM.

Run on the GPU machine, from the repo root:
    PYTHONPATH=$PWD python3 benchmarks/mtp_decode.py --out $OUT/mtp.json
Local smoke test of the same code path on CPU with a tiny shape:
    PYTHONPATH=$PWD python benchmarks/mtp_decode.py --tiny --device cpu --backends cpu --caps 0 --k 0,2 --accept 0.8

The model (with a one-layer MTP block, `mtp_num_hidden_layers: 1`) is built in memory with random bf16 weights,
as benchmarks/decode_sweep.py does, then made predictable (`make_predictable`), because random weights make a
random drafter that the main model never agrees with: the embedding is scaled to an RMS of 64 per element, so
the residual stream of any layer stays close to the input token's embedding whatever the random layers add;
the lm_head row of token pi(t) (pi: a fixed random permutation) is t's unit embedding, so the model's greedy
next token after t is pi(t) by a margin of ~40 logits (no near-ties for bf16 rounding, batch shape or routing to
flip); the MTP block's fc passes its input token's normed embedding times 64 (the hidden half zero), so its
draft after token u is pi(u): the real block drafts the main model's own tokens. Every layer and expert still
runs on random weights (routing is the random router's), so the step's cost and the experts' traffic are
those of the real shape. --accept below 1 makes each draft wrong with probability 1 - accept (the block's
argmax moved to another token after it ran). The plain greedy run of the same prompts (k = 0) is the baseline
row; every speculative run is checked to give its tokens.

Routing: the random router's (uniform: the k + 1 tokens of a verify step share almost no experts, so MTP cannot
save PCIe bytes), or with --trace synthetic:PRESET (moe/synth.py, made for this model's main layers, one stream
per request) or --trace FILE forced by token position (moe/trace.py RouteForcer(by_position=True)): a token routes
to the same experts whether a decode step or a verify step computes it, so the speculative runs still give the
baseline's tokens, and consecutive tokens share experts as the trace's locality says. With a synthetic trace the
MTP layer gets a trace layer of its own (the same locality as the model's layers), so the drafter's passes route
as a real block's would, not uniformly (--router-draft: its random router, as measured before 2026-12-05's
fifteenth session, where its uniform misses took slots from the main layers); a trace FILE has no MTP layer.

Time split: `draft_s` (the drafter's passes, eager) and `step_s` (the engine's forward calls, verify or decode) of
the measured run, from wall clocks around the calls (the drafter's passes end in a host read, so their time is
theirs; a forward returns once launched, so the sync of its results is counted in whatever reads them next).

k = 0 runs on the engine built for the largest k (its decode buffers and pair scratch rows sized for k + 1
rows a request, which takes a few expert slots from the cache); for the exact baseline run with --k 0
--max-k 0 (a separate process, no MTP block loaded).

Per (backend, cap, bs, k, accept): decode tok/s (aggregate, per request), bytes over PCIe per generated
token, expert hit rate, drafted / accepted per draft position, tokens per verify step.
"""
from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from decode_sweep import QWEN36, TINY, delta, force_routes, measure_bandwidths, totals


def make_predictable(llm, seed: int = 0, scale: float = 64.0) -> None:
    """The predictable model of the module docstring, in place (before any step: recorded graphs hold pointers)."""
    m = llm.engine.model
    E, head, fc = m.embed_tokens.weight, m.lm_head.weight, m.mtp.fc.weight
    V, H = E.shape
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(seed)).to(E.device)
    with torch.no_grad():
        for r in range(0, V, 16384):  # in slices: a few MB of temporaries on a capped card
            e = E[r:r + 16384].float()
            e = e * (scale / e.pow(2).mean(-1, keepdim=True).sqrt())
            E[r:r + 16384] = e.to(E.dtype)
            head[perm[r:r + 16384]] = (e / e.norm(dim=-1, keepdim=True)).to(head.dtype)
        fc.zero_()
        fc[:, :H] = torch.eye(H, device=fc.device, dtype=fc.dtype) * scale


def noisy_drafter(llm, accept: float, seed: int = 0):
    """The real drafter, each draft made wrong with probability 1 - accept (its argmax moved to the next token id)."""
    engine = llm.engine
    real = type(engine).draft
    g = torch.Generator().manual_seed(seed)

    def draft(batch, hidden, step=0):
        logits = real(engine, batch, hidden, step)
        if accept >= 1.0:
            return logits
        logits = logits.clone()  # (an inference tensor: not written in place outside inference mode)
        top = logits.argmax(-1).tolist()
        for i, t in enumerate(top):
            if float(torch.rand((), generator=g)) >= accept:
                logits[i, (t + 1) % logits.shape[1]] = logits[i, t] + 1.0
        return logits

    engine.draft = draft


class Clock:
    """Wall time inside the engine's draft and forward calls (module doc)."""

    def __init__(self, engine):
        self.engine, self.s = engine, {"draft_s": 0.0, "step_s": 0.0, "drafts": 0, "steps": 0}
        self.real = {name: getattr(type(engine), name) for name in ("draft", "forward")}

    def wrap(self):
        e, s = self.engine, self.s
        draft = e.__dict__.get("draft") or self.real["draft"].__get__(e)  # (noisy_drafter's, when set)
        forward = self.real["forward"].__get__(e)

        def timed(fn, key):
            def call(*a, **kw):
                t = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    s[key + "_s"] += time.perf_counter() - t
                    s[key + "s"] += 1
            return call

        e.draft, e.forward = timed(draft, "draft"), timed(forward, "step")
        return self

    def unwrap(self, had_draft):
        self.engine.__dict__.pop("forward", None)
        if had_draft is None:
            self.engine.__dict__.pop("draft", None)
        else:
            self.engine.draft = had_draft


def run(llm, prompts, new_tokens: int, k: int, want=None, accept: float = 0.0) -> dict:
    from moestream import SamplingParams

    runner = llm.llm_engine.runner
    runner.spec_k = k
    if k:
        noisy_drafter(llm, accept)
    else:
        llm.engine.__dict__.pop("draft", None)
    sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    # warm: the cache, and the decode / verify graphs of every KV bucket the measured run will cross
    llm.generate(prompts, sp)
    before, spec_before = totals(llm), json.loads(json.dumps(runner.spec_totals))
    g = getattr(llm.engine, "graphs", None)
    g0 = (g.recorded, g.replays) if g is not None else (0, 0)
    had_draft = llm.engine.__dict__.get("draft")
    clock = Clock(llm.engine).wrap()
    try:
        outs = [o.token_ids for o in llm.generate(prompts, sp)]
    finally:
        clock.unwrap(had_draft)
    d = delta(totals(llm), before)
    g = getattr(llm.engine, "graphs", None)
    graphs = {"graphs_recorded": g.recorded - g0[0], "graph_replays": g.replays - g0[1]} if g is not None else {}
    t = llm.last_timing
    spec = {key: ([a - b for a, b in zip(v, spec_before[key])] if isinstance(v, list) else v - spec_before[key])
            for key, v in runner.spec_totals.items()}
    toks = max(t["decode_tokens"], 1)
    hits, misses = d.get("hits", 0), d.get("misses", 0)
    agg = t["decode_tokens"] / t["decode_s"] if t["decode_s"] else 0.0
    return {"k": k, "accept": accept if k else None, "bs": len(prompts), "decode_tok_s_agg": agg,
            "decode_tok_s_per_req": agg / len(prompts), "decode_tokens": t["decode_tokens"],
            "decode_s": t["decode_s"], "hit_rate": hits / (hits + misses) if hits + misses else None,
            # prefill traffic of the measured run is included (32-token prompts: small next to the decode)
            "pcie_bytes_per_token": d.get("bytes_h2d", 0) / toks,
            "drafted_per_position": spec["drafted_at"][:k], "accepted_per_position": spec["accepted_at"][:k],
            "tokens_per_verify_step": spec["emitted"] / spec["verify_steps"] if spec["verify_steps"] else None,
            "tokens_equal": None if want is None else outs == want, "outputs": outs,
            "prefill_streamed": d.get("prefill_streamed", 0), **graphs,
            **{key: (round(v, 4) if isinstance(v, float) else v) for key, v in clock.s.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--caps", default="24,12,8")
    ap.add_argument("--backends", default="offload,hybrid")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--k", default="0,1,2,3", help="drafts per step to measure (0: no speculation)")
    ap.add_argument("--max-k", type=int, default=None, help="--num-speculative-tokens of the engine (default: max --k)")
    ap.add_argument("--accept", default="1.0,0.8,0.6", help="probability that a draft is left right (1: the real drafts)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="mtp.json")
    ap.add_argument("--router-draft", action="store_true",
                    help="with a synthetic trace: the MTP layer keeps its random router (uniform) instead of a trace "
                         "layer of its own")
    ap.add_argument("--trace", default=None, help="force routing by token position: FILE or synthetic:PRESET "
                    "(qwen36, qwen36-skewed, uniform); default: the random router's")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from moestream import LLM

    ks = [int(x) for x in args.k.split(",")]
    max_k = max(ks) if args.max_k is None else args.max_k
    cfg = {**(TINY if args.tiny else QWEN36), "mtp_num_hidden_layers": 1}
    dev = torch.device(args.device)
    backends = args.backends.split(",")
    caps = [float(c) for c in args.caps.split(",")]
    t0 = time.perf_counter()
    bandwidths = measure_bandwidths(dev)  # before the engine caps torch's allocator at the first cap
    llm = LLM(cfg, device=args.device, dtype="bfloat16", moe_backend=backends[0],
              gpu_memory_gb=caps[0] if dev.type == "cuda" else None, max_running_requests=max(
                  int(b) for b in args.batch.split(",")), num_tokens=16384, max_seq_len_override=4096,
              speculative="mtp" if max_k else "none", num_speculative_tokens=max(max_k, 1))
    if max_k:
        make_predictable(llm)
    if args.trace:
        force_routes(llm, args.trace, max(int(b) for b in args.batch.split(",")), tokens=2048,
                     rows_per_request=max_k + 1, by_position=True,
                     draft=args.trace.startswith("synthetic:") and not args.router_draft)  # (module doc)
    print(f"built model in {time.perf_counter() - t0:.0f} s", flush=True)
    results = {"date": time.strftime("%Y-%m-%d"), "bandwidths": bandwidths, "max_k": max_k,
               "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "trace": args.trace, "runs": []}
    V = llm.model_config.vocab_size
    for backend in backends:
        for cap in caps:
            try:
                llm.engine.reconfigure_experts(moe_backend=backend, moe_cache_size=None,
                                               gpu_memory_gb=cap if dev.type == "cuda" else None)
            except Exception as e:  # a plan that does not fit is a result too
                results["runs"].append({"backend": backend, "cap_gb": cap, "error": str(e)})
                continue
            for bs in (int(x) for x in args.batch.split(",")):
                g = torch.Generator().manual_seed(bs)
                prompts = [torch.randint(0, V, (32,), generator=g).tolist() for _ in range(bs)]
                base = run(llm, prompts, args.new_tokens, 0)
                want = base["outputs"]
                rows = [base] + [run(llm, prompts, args.new_tokens, k, want, float(a))
                                 for k in ks if k for a in args.accept.split(",")]
                for r in rows:
                    r.pop("outputs")
                    r.update(backend=backend, cap_gb=cap, speedup=r["decode_tok_s_agg"] / base["decode_tok_s_agg"]
                             if base["decode_tok_s_agg"] else None)
                    results["runs"].append(r)
                    print(json.dumps(r), flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    print(f"\n{'backend':8} {'cap':>5} {'bs':>3} {'k':>2} {'accept':>6} {'tok/s':>8} {'x base':>6} {'MB/tok':>7} "
          f"{'hit':>5} {'tok/verify':>10} {'draft s':>7} {'step s':>7} same")
    for r in results["runs"]:
        if "error" in r:
            print(f"{r['backend']:8} {r['cap_gb']:5.0f} error: {r['error'][:80]}")
            continue
        f = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else "-"
        print(f"{r['backend']:8} {r['cap_gb']:5.0f} {r['bs']:3d} {r['k']:2d} {f(r['accept'], '6.2f')} "
              f"{r['decode_tok_s_agg']:8.1f} {f(r['speedup'], '6.2f')} {r['pcie_bytes_per_token'] / 1e6:7.2f} "
              f"{f(r['hit_rate'], '5.2f')} {f(r['tokens_per_verify_step'], '10.2f')} {r['draft_s']:7.3f} "
              f"{r['step_s']:7.3f} {r['tokens_equal']}")


if __name__ == "__main__":
    main()

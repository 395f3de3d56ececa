"""A GGUF's dense layers kept compressed on the GPU against the same file dequantized at load (CUDA; issue 13
item 3, issue 17's 4 GB cards): same prefill logits within bf16 rounding, same greedy decode tokens (CUDA graphs
on), for fused and offload, and what each layout holds.

    PYTHONPATH=$PWD python3 benchmarks/gpu_dense_check.py MODEL.gguf [--json OUT.json]

MODEL: e.g. the 4-layer Qwen3.6-shaped Q4_K_M file of `make_qwen36_q4km.py --layers 4` (full widths: its Gated
DeltaNet out_proj keeps the file's tiled value-head order, its in-projections stay unfused, the embedding is
decoded at lookup). MOESTREAM_DENSE_QUANT=1 keeps the dense layers compressed, =0 dequantizes them (the
reference). Random weights make near-ties, so the logits are compared by relative error and the decode tokens
by the share that agree.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def full_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, one prefill pass (as tests/test_engine_parity.py)."""
    from moestream import SamplingParams
    from moestream.scheduler.request import Request

    sch = llm.scheduler
    req = Request("check", list(ids), SamplingParams(max_tokens=1))
    llm.llm_engine.add_request(req)
    prefix, sch.prefix = sch.prefix, None
    try:
        batch, _ = llm.llm_engine.runner.build(sch.schedule())
        batch.logits_index = torch.arange(len(ids), device=batch.input_ids.device)
        out = llm.engine.forward(batch).float().cpu()
        sch.abort(req.id)
    finally:
        sch.prefix = prefix
    return out


DTYPE = "auto"


def run(path: str, mode: str, backend: str, cap: float | None, device: str) -> dict:
    from moestream import LLM, SamplingParams
    from moestream.layers.quant_linear import QuantEmbedding, QuantLinear

    os.environ["MOESTREAM_DENSE_QUANT"] = mode
    kw = {"gpu_memory_gb": cap} if cap else {"moe_cache_size": 96} if backend == "offload" else {}
    llm = LLM(path, device=device, moe_backend=backend, max_running_requests=4, dtype=DTYPE, **kw)
    m = llm.engine.model
    gdn = [layer.linear_attn for layer in m.layers if layer.kind == "linear_attention"]
    info = {"mode": mode, "backend": backend, "cap": cap, "dense_gib": llm.engine.plan.bytes.dense / 2**30,
            "embedding": type(m.embed_tokens).__name__, "head": repr(m.lm_head),
            "gdn_out_permuted": sum(isinstance(g.out_proj, QuantLinear) and g.out_proj.in_perm is not None
                                    for g in gdn),
            "gdn_in_unfused": sum(g.in_proj is None for g in gdn), "gdn_layers": len(gdn),
            "quant_embedding": isinstance(m.embed_tokens, QuantEmbedding)}
    vocab = m.embed_tokens.num_embeddings
    ids = [(i * 7919) % (vocab - 10) + 10 for i in range(96)]
    logits = full_logits(llm, ids)
    prompts = [ids[:8], ids[8:24], ids[24:29], ids[40:72]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    graphs = getattr(llm.engine, "graphs", None)
    info["graph_replays"] = graphs.replays if graphs is not None else 0
    info["tokens"] = [o.token_ids for o in outs]
    llm.close()
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return info, logits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--json")
    ap.add_argument("--offload-cap", type=float, default=0.0, help="offload's --gpu-memory-gb (0: 96 expert slots)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the GPU's layout (MOESTREAM_DENSE_QUANT=gpu)")
    ap.add_argument("--dtype", default="auto", help="the model dtype (float32: both layouts near-exact, so a layout bug "
                    "shows; bf16 rounding moves a random model's routing)")
    ap.add_argument("--backends", default="fused,offload")
    args = ap.parse_args(argv)
    global DTYPE
    DTYPE = args.dtype
    report = []
    ok = True
    for backend in args.backends.split(","):
        res = {}
        for mode in ("0", "1" if args.device == "cuda" else "gpu"):
            try:
                res[mode] = run(args.model, mode, backend, args.offload_cap or None, args.device)
            except Exception as e:  # noqa: BLE001 (reported, the other runs go on)
                ok = False
                res[mode] = ({"mode": mode, "backend": backend, "error": f"{type(e).__name__}: {e}"}, None)
        row = {"backend": backend, "runs": [r[0] for r in res.values()]}
        if all(r[1] is not None for r in res.values()):
            (_, (_, ref)), (_, (_, got)) = res.items()
            row["logits_rel_err"] = float((got - ref).norm() / ref.norm())
            row["argmax_agree"] = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
            ta, tb = (r[0]["tokens"] for r in res.values())
            same = sum(x == y for a, b in zip(ta, tb) for x, y in zip(a, b))
            row["decode_tokens_agree"] = same / sum(len(a) for a in ta)
            row["first_tokens_equal"] = [a[:4] == b[:4] for a, b in zip(ta, tb)]
            ok &= row["logits_rel_err"] < 2e-2
        for r in row["runs"]:
            r.pop("tokens", None)
        report.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

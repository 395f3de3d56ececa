"""Decode speed with a JSON schema active vs unconstrained, batch 4, on the CPU default model (SmolLM2-135M).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python3 benchmarks/structured_decode.py [--rounds 3] [--tokens 64]

Both runs sample (temperature 1, seeds 0..3) from the same chat prompt; the constrained one carries a JSON
schema (llguidance mask applied to its rows). Reports decode tok/s (the engine's decode steps only) as the
median of the rounds, alternating the two so machine load hits both alike, and the ratio; and the time the
constrained rows spend on the critical path (waiting for their mask, applying it) per row and as a share of
the constrained runs' step time. The schema cannot be completed within --tokens, so the batch stays 4."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moestream import LLM, SamplingParams  # noqa: E402
from moestream.models.checkpoint import default_model_path  # noqa: E402
from moestream.tokenizer.grammar import compile_grammar  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "kind": {"enum": ["cat", "dog", "bird"]},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 40},  # no answer ends early: same batch
    "owner": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}},
    "required": ["name", "kind", "tags", "owner"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    llm = LLM(default_model_path(), device="cpu")
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a pet as JSON."}],
                                               add_generation_prompt=True, tokenize=True)
    g = compile_grammar("json_schema", SCHEMA)
    # time on the critical path of the constrained rows: waiting for the mask + applying it (+ penalties)
    runner = llm.llm_engine.runner
    spent = {"s": 0.0, "rows": 0}
    inner = runner._process_row

    def timed(req, row):
        t0 = time.perf_counter()
        inner(req, row)
        spent["s"] += time.perf_counter() - t0
        spent["rows"] += 1

    runner._process_row = timed
    rates = {"free": [], "json_schema": []}
    decode_s = 0.0
    for _ in range(a.rounds):
        for name in rates:
            ps = [SamplingParams(max_tokens=a.tokens, temperature=1.0, seed=s, ignore_eos=name == "free",
                                 grammar=g if name == "json_schema" else None) for s in range(4)]
            outs = llm.generate([prompt] * 4, ps)
            t = llm.last_timing
            rates[name].append(t["decode_tokens"] / t["decode_s"])
            if name == "json_schema":
                decode_s += t["decode_s"] + t["prefill_s"]
                assert all(len(o.token_ids) == a.tokens for o in outs)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(json.dumps({"decode_tok_s": med, "rounds": rates, "ratio": med["json_schema"] / med["free"],
                      "mask_critical_path_us_per_row": 1e6 * spent["s"] / max(spent["rows"], 1),
                      "mask_share_of_constrained_step_time": spent["s"] / decode_s if decode_s else None},
                     indent=1))


if __name__ == "__main__":
    main()

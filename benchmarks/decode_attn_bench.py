"""Decode attention at long context: the split-KV Triton kernel (layers/attn_decode.py) against the torch path it
replaces (attention.py `_decode_padded`: gather the padded K/V, SDPA with the query heads of a KV head as its
query rows), one attention layer, bf16, KV rows scattered over a token pool as the engine's pages leave them.

    python benchmarks/decode_attn_bench.py [--widths 1024,4096,16384,32768,65536] [--batch 1,4] [--shape qwen36]

Prints, per (shape, batch, context length), microseconds per call of each path (CUDA events, median of 50
after warm-up), the KV bytes one call must read and the bandwidth that gives, and the largest difference
between the two outputs. Needs CUDA and triton.
"""
from __future__ import annotations

import argparse
import json
import torch
from gdn_chunk_bench import time_ms  # CUDA-event median (this folder is on sys.path when run as a script)

SHAPES = {"qwen36": (16, 2, 256), "qwen3-30b": (32, 4, 128)}  # query heads, KV heads, head dim


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="1024,4096,16384,32768,65536")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--shape", default="qwen36,qwen3-30b")
    ap.add_argument("--json")
    args = ap.parse_args()
    from moestream.layers import attn_decode
    from moestream.layers.attention import Attention

    dev = torch.device("cuda")
    rows = []
    for shape in args.shape.split(","):
        H, Hk, D = SHAPES[shape]
        layer = Attention(H * D, H, Hk, D, 1e-6, False, False).to(dev, torch.bfloat16)
        for B in (int(x) for x in args.batch.split(",")):
            for W in (int(x) for x in args.widths.split(",")):
                pool = B * W + 64
                k = torch.randn(pool, Hk, D, device=dev, dtype=torch.bfloat16)
                v = torch.randn(pool, Hk, D, device=dev, dtype=torch.bfloat16)
                q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
                idx = torch.randperm(pool, device=dev)[:B * W].view(B, W)
                lengths = torch.full((B,), W, device=dev, dtype=torch.long)
                valid = torch.ones(B, W, dtype=torch.bool, device=dev)
                torch_us = 1e3 * time_ms(lambda: layer._decode_padded(q, idx, valid, k, v), 50, 5)
                split_us = 1e3 * time_ms(lambda: attn_decode.decode_attention(q, k, v, idx, lengths, layer.scale), 50, 5)
                diff = (layer._decode_padded(q, idx, valid, k, v).float()
                        - attn_decode.decode_attention(q, k, v, idx, lengths, layer.scale).float()).abs().max().item()
                kv_bytes = 2 * B * W * Hk * D * 2
                n, keys = attn_decode._splits(W, B * Hk, dev)
                row = {"shape": shape, "batch": B, "context": W, "torch_us": round(torch_us, 1),
                       "split_us": round(split_us, 1), "speedup": round(torch_us / split_us, 2),
                       "split_gbs": round(kv_bytes / split_us / 1e3, 1), "splits": n, "max_diff": diff}
                rows.append(row)
                print(json.dumps(row), flush=True)
                del k, v
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

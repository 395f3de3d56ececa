"""Write a Qwen3.6-35B-A3B-shaped HF checkpoint with FP8 weights (random values), in the layout of the official FP8
release: safetensors shards + index, config.json with `quantization_config` {quant_method fp8, e4m3, 128 x 128
`weight_block_size`}, every linear weight as float8_e4m3fn `weight` + float32 `weight_scale_inv` [ceil(n/128),
ceil(k/128)] except lm_head, the routers (`mlp.gate`) and `mlp.shared_expert_gate` (bf16, as
`modules_to_not_convert` says); norms, conv, A_log, dt_bias and the embedding bf16.

    python benchmarks/make_qwen36_fp8.py OUT_DIR                 # full shape: 40 layers, 256 experts, ~35 GB
    python benchmarks/make_qwen36_fp8.py OUT_DIR --layers 4      # fewer layers (a memory probe)
    python benchmarks/make_qwen36_fp8.py OUT_DIR --tiny          # hidden 256, 8 experts: the CPU check of the writer

Without a tokenizer (token-id prompts only: edge_memory.py, decode_sweep.py --model). The shapes and names are
those of benchmarks/decode_sweep.py's QWEN36 config (Qwen3_5MoeForCausalLM, text-only layout `model.layers.*`).

Speed: nothing is quantized from floats. The bytes come from small pools of random values: e4m3 codes with
exponent <= 7 (|code| < 2, random sign) and block scales of 0.01-0.02, so every weight is ~N(0, 0.02)-sized and no
code is NaN; bf16 tensors ~N(0, 0.02), norm weights 0 (the zero-centred norms' unit scale). The safetensors files are
written by hand (an 8-byte header length, the JSON header, then the tensors back to back) straight from the pools,
without materialising the 35 GB in memory; writing is bound by the target's write speed.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_sweep import QWEN36, TINY  # noqa: E402

KEEP = ("lm_head", "mlp.gate", "mlp.shared_expert_gate")
BLOCK = 128


def layer_tensors(cfg: dict, i: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of decoder layer i; kind: fp8 (a linear weight to quantize), bf16, norm (zeros)."""
    H, E, Ie, Is = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    p = f"model.layers.{i}."
    out = [(p + "input_layernorm.weight", (H,), "norm"), (p + "post_attention_layernorm.weight", (H,), "norm")]
    if cfg["layer_types"][i] == "linear_attention":
        hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        conv = 2 * hk * dk + hv * dv
        a = p + "linear_attn."
        out += [(a + "in_proj_qkv.weight", (conv, H), "fp8"), (a + "in_proj_z.weight", (hv * dv, H), "fp8"),
                (a + "in_proj_b.weight", (hv, H), "fp8"), (a + "in_proj_a.weight", (hv, H), "fp8"),
                (a + "conv1d.weight", (conv, 1, cfg["linear_conv_kernel_dim"]), "bf16"),
                (a + "dt_bias", (hv,), "norm"), (a + "A_log", (hv,), "norm"), (a + "norm.weight", (dv,), "norm"),
                (a + "out_proj.weight", (H, hv * dv), "fp8")]
    else:
        nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        a = p + "self_attn."
        out += [(a + "q_proj.weight", (2 * nh * hd, H), "fp8"), (a + "k_proj.weight", (nkv * hd, H), "fp8"),
                (a + "v_proj.weight", (nkv * hd, H), "fp8"), (a + "o_proj.weight", (H, nh * hd), "fp8"),
                (a + "q_norm.weight", (hd,), "norm"), (a + "k_norm.weight", (hd,), "norm")]
    m = p + "mlp."
    out += [(m + "gate.weight", (E, H), "bf16"), (m + "shared_expert_gate.weight", (1, H), "bf16")]
    for proj, shape in (("gate_proj", (Is, H)), ("up_proj", (Is, H)), ("down_proj", (H, Is))):
        out.append((f"{m}shared_expert.{proj}.weight", shape, "fp8"))
    for e in range(E):
        for proj, shape in (("gate_proj", (Ie, H)), ("up_proj", (Ie, H)), ("down_proj", (H, Ie))):
            out.append((f"{m}experts.{e}.{proj}.weight", shape, "fp8"))
    return out


class Pools:
    """Random bytes the tensors are cut from (a tensor of more bytes than a pool repeats it)."""

    def __init__(self, seed: int, size: int = 1 << 24):
        rng = np.random.default_rng(seed)
        r = rng.integers(0, 256, size, dtype=np.uint8)
        self.fp8 = (r & 0x80) | (r & 0x3F)  # sign, exponent <= 7, any mantissa: |value| < 2, never NaN
        self.bf16 = (rng.standard_normal(size // 2, dtype=np.float32) * 0.02).view(np.uint32) >> 16
        self.bf16 = self.bf16.astype(np.uint16).view(np.uint8)
        self.scale = (0.01 + 0.01 * rng.random(size // 4, dtype=np.float32)).view(np.uint8)

    @staticmethod
    def write(f, pool: np.ndarray, nbytes: int, start: int) -> None:
        start %= len(pool)
        while nbytes:
            n = min(nbytes, len(pool) - start)
            f.write(memoryview(pool[start:start + n]))
            nbytes -= n
            start = 0


def entries(cfg: dict, layers: range, first: bool, last: bool):
    """(name, dtype, shape, pool name, bytes) of a shard's tensors: the layers', plus the embedding (first) and the
    final norm and lm_head (last)."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    out = []
    if first:
        out.append(("model.embed_tokens.weight", "BF16", (V, H), "bf16"))
    for i in layers:
        for name, shape, kind in layer_tensors(cfg, i):
            if kind == "fp8" and not name.rsplit(".", 1)[0].endswith(KEEP):
                out.append((name, "F8_E4M3", shape, "fp8"))
                n, k = shape
                out.append((name[:-len("weight")] + "weight_scale_inv", "F32", (-(-n // BLOCK), -(-k // BLOCK)), "scale"))
            else:
                out.append((name, "BF16", shape, "zero" if kind == "norm" else "bf16"))
    if last:
        out += [("model.norm.weight", "BF16", (H,), "zero"), ("lm_head.weight", "BF16", (V, H), "bf16")]
    size = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
    return [(n, dt, s, pool, int(np.prod(s)) * size[dt]) for n, dt, s, pool in out]


def write_shard(path: Path, items, pools: Pools, salt: int) -> int:
    header, off = {}, 0
    for name, dt, shape, _, nb in items:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for j, (_, _, _, pool, nb) in enumerate(items):
            if pool == "zero":
                f.write(bytes(nb))
            else:
                src = {"fp8": pools.fp8, "bf16": pools.bf16, "scale": pools.scale}[pool]
                align = 4 if pool == "scale" else 2 if pool == "bf16" else 1
                Pools.write(f, src, nb, (salt * 7919 + j * 104729) // align * align)
    return off


def write(out: Path, cfg: dict, layers_per_shard: int, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pools = Pools(seed)
    L = cfg["num_hidden_layers"]
    groups = [range(s, min(L, s + layers_per_shard)) for s in range(0, L, layers_per_shard)]
    weight_map, total, t0 = {}, 0, time.perf_counter()
    for n, layers in enumerate(groups):
        fname = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        items = entries(cfg, layers, n == 0, n == len(groups) - 1)
        total += write_shard(out / fname, items, pools, n)
        weight_map.update({name: fname for name, *_ in items})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    config = dict(cfg, torch_dtype="bfloat16", quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": list(KEEP)})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    print(f"wrote {out}: {len(weight_map)} tensors in {len(groups)} shards, {total / 1e9:.2f} GB in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's 40)")
    ap.add_argument("--tiny", action="store_true", help="decode_sweep.TINY's small shape")
    ap.add_argument("--layers-per-shard", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = dict(TINY if args.tiny else QWEN36)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
        cfg["layer_types"] = cfg["layer_types"][:args.layers]
    write(Path(args.out), cfg, args.layers_per_shard, args.seed)


if __name__ == "__main__":
    main()

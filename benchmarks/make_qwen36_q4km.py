"""Write a Qwen3.6-35B-A3B-shaped GGUF (architecture qwen35moe) with random weights, Q8_0 or a Q4_K_M-style
mix, for timing moestream and llama.cpp on the same file. Values are random but sane (weights with a
standard deviation of about 0.02, unit norms); outputs are noise.

    python benchmarks/make_qwen36_q4km.py OUT.gguf --quant q4_k_m --vocab-from tokenizer-fields.json
    python benchmarks/make_qwen36_q4km.py OUT.gguf --quant q8_0 --vocab-from tokenizer-fields.json [--layers 40]
    python benchmarks/make_qwen36_q4km.py OUT.gguf --tiny --quant q4_k_m         # 4 layers, widths 256, vocab 512
    python benchmarks/make_qwen36_q4km.py OUT.gguf --tiny --quant q4_k_m --dequantized   # same weights as F32

Tensor names, shapes and metadata are those of ../shared/tools/make_qwen36_gguf.py (the Q8_0 file the
peer numbers were measured on; its list is repeated here with the shape and the quant type of every tensor
as parameters). --vocab-from names a JSON of the tokenizer.* GGUF fields (the vocabulary size follows its
token list; with --tiny or --vocab N it is cut to its first N - 3 tokens plus three control tokens); without
it a small byte-level vocabulary is made up (--vocab, default 512), enough for both engines to load the file.

Quant mixes (`--quant`) (and iq3_s: routed experts IQ3_S, every other tensor as in q4_k_m; file type 26):
- q8_0: every matrix Q8_0 (general.file_type 7), norms, router, conv and the small GDN tensors F32.
- q4_k_m (general.file_type 15), modelled on llama.cpp's Q4_K_M choice per tensor: routed and shared experts'
  gate/up Q4_K, their down Q6_K in the layers llama.cpp gives more bits (the first and last eighth, and every
  third layer between: 20 of 40 layers) and Q4_K elsewhere; attention V and the GDN qkv projection follow the
  same Q6_K/Q4_K rule, the other attention/GDN projections Q4_K; output Q6_K; token embedding Q4_K; the rest F32.

Speed: the blocks are not quantized from floats. Each type has a pool of random but valid blocks (random
quant codes, fp16 scales chosen so the weights have a standard deviation of about 0.02, no NaN, no
subnormal) made once with numpy, and every tensor is the pool's bytes streamed on from where the last
tensor of that type stopped (the pool size is prime, so experts do not repeat each other's rows exactly).
The full Q4_K_M file (~21 GB) or Q8_0 file (~36.5 GB) is written at the speed of the disk / tmpfs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

POOL_BLOCKS = 32749  # prime
STD = 0.02


@dataclass(frozen=True)
class Shape:
    H: int = 2048      # hidden
    L: int = 40        # layers (every 4th is full attention, the rest Gated DeltaNet)
    NH: int = 16       # attention q heads
    NKV: int = 2       # attention kv heads
    HD: int = 256      # attention head dim
    KH: int = 16       # GDN key heads
    VH: int = 32       # GDN value heads
    KD: int = 128      # GDN key head dim
    VD: int = 128      # GDN value head dim
    CONV: int = 4      # GDN conv kernel
    E: int = 256       # experts
    K: int = 8         # experts per token
    I: int = 512       # expert intermediate
    SI: int = 512      # shared expert intermediate
    ROPE: int = 64     # rotary dims (0.25 * HD)
    SECTIONS: tuple = (11, 11, 10, 0)  # M-RoPE sections, summing to ROPE / 2


FULL = Shape()
# Every row length a multiple of 256 so every matrix can be a K-quant; 3 GDN layers + 1 attention layer.
TINY = Shape(H=256, L=4, NH=2, NKV=1, HD=128, KH=2, VH=4, KD=64, VD=64, E=8, K=2, I=256, SI=256, ROPE=32,
             SECTIONS=(6, 5, 5, 0))


# ---- the tensors -----------------------------------------------------------------------------
# (name, ne (ne[0] innermost, GGUF order), role); a role is either a weight role the quant mix maps to a
# type, or one of the F32 fillers: ones, neg, zeros, rand.

def tensors(s: Shape, V: int):
    yield "token_embd.weight", [s.H, V], "embd"
    yield "output_norm.weight", [s.H], "ones"
    yield "output.weight", [s.H, V], "output"
    conv_dim = 2 * s.KH * s.KD + s.VH * s.VD
    for i in range(s.L):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", [s.H], "ones"
        yield p + "post_attention_norm.weight", [s.H], "ones"
        if (i + 1) % 4:  # gated delta net layer
            yield p + "ssm_a", [s.VH], "neg"
            yield p + "ssm_conv1d.weight", [s.CONV, conv_dim], "rand"
            yield p + "ssm_dt.bias", [s.VH], "zeros"
            yield p + "ssm_alpha.weight", [s.H, s.VH], "rand"
            yield p + "ssm_beta.weight", [s.H, s.VH], "rand"
            yield p + "attn_qkv.weight", [s.H, conv_dim], "attn_qkv"
            yield p + "attn_gate.weight", [s.H, s.VH * s.VD], "proj"
            yield p + "ssm_norm.weight", [s.VD], "ones"
            yield p + "ssm_out.weight", [s.VH * s.VD, s.H], "proj"
        else:            # gated full attention layer
            yield p + "attn_q.weight", [s.H, s.NH * s.HD * 2], "proj"
            yield p + "attn_k.weight", [s.H, s.NKV * s.HD], "proj"
            yield p + "attn_v.weight", [s.H, s.NKV * s.HD], "attn_v"
            yield p + "attn_output.weight", [s.NH * s.HD, s.H], "proj"
            yield p + "attn_q_norm.weight", [s.HD], "ones"
            yield p + "attn_k_norm.weight", [s.HD], "ones"
        yield p + "ffn_gate_inp.weight", [s.H, s.E], "rand"
        yield p + "ffn_gate_exps.weight", [s.H, s.I, s.E], "exps_gate_up"
        yield p + "ffn_up_exps.weight", [s.H, s.I, s.E], "exps_gate_up"
        yield p + "ffn_down_exps.weight", [s.I, s.H, s.E], "exps_down"
        yield p + "ffn_gate_inp_shexp.weight", [s.H, 1], "rand"
        yield p + "ffn_gate_shexp.weight", [s.H, s.SI], "shexp_gate_up"
        yield p + "ffn_up_shexp.weight", [s.H, s.SI], "shexp_gate_up"
        yield p + "ffn_down_shexp.weight", [s.SI, s.H], "shexp_down"


F32_ROLES = ("ones", "neg", "zeros", "rand")
FILE_TYPES = {"q8_0": 7, "q4_k_m": 15, "iq3_s": 26}  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q8_0 / _Q4_K_M / _IQ3_S


def more_bits(i: int, n: int) -> bool:
    """The layers llama.cpp's Q4_K_M gives Q6_K (its use_more_bits rule)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quant_type(mix: str, name: str, role: str, n_layers: int) -> str:
    """GGUF type name of one tensor under a mix."""
    if role in F32_ROLES:
        return "F32"
    if mix == "q8_0":
        return "Q8_0"
    if mix not in ("q4_k_m", "iq3_s"):
        raise ValueError(f"unknown quant mix {mix!r} (q8_0, q4_k_m, iq3_s)")
    if mix == "iq3_s" and role.startswith("exps_"):
        return "IQ3_S"  # routed experts IQ3_S, the rest as q4_k_m
    if role == "output":
        return "Q6_K"
    if role in ("attn_v", "attn_qkv", "exps_down", "shexp_down"):
        layer = int(name.split(".")[1])
        return "Q6_K" if more_bits(layer, n_layers) else "Q4_K"
    return "Q4_K"


# ---- valid random blocks -----------------------------------------------------------------------
BLOCK = {"Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210), "IQ3_S": (256, 110)}  # (weights, bytes) per block


def _f16_bytes(d: np.ndarray) -> np.ndarray:
    return d.astype(np.float16).view(np.uint8).reshape(-1, 2)


def make_pool(qtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """n valid blocks of qtype (ggml block layouts), weights ~ STD standard deviation, mean ~0."""
    jitter = rng.uniform(0.75, 1.25, n)
    if qtype == "Q8_0":  # d (f16), 32 x int8; value = d * q
        b = np.empty((n, 34), np.uint8)
        b[:, 2:] = rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)
        b[:, :2] = _f16_bytes(jitter * STD / 73.3)  # std of uniform int8 codes: 73.3
        return b
    if qtype == "Q4_K":
        # d, dmin (f16), 12 bytes of 6-bit scale/min pairs for 8 sub-blocks of 32, 128 bytes of nibbles;
        # value = d * sc_j * q - dmin * m_j. With every sc, m < 16 the packing is plain: bytes 0-3 sc_0..3,
        # 4-7 m_0..3, 8-11 sc_4..7 | m_4..7 << 4. dmin = 8 d and m_j = round(7.5 sc_j / 8) centre q on 7.5.
        b = np.empty((n, 144), np.uint8)
        sc = rng.integers(8, 16, (n, 8)).astype(np.uint8)
        m = np.rint(7.5 * sc / 8).astype(np.uint8)
        d = jitter * STD / (11.6 * 4.61)  # mean sc ~11.6 (rms), std of uniform nibbles 4.61
        b[:, 0:2] = _f16_bytes(d)
        b[:, 2:4] = _f16_bytes(8 * d)
        b[:, 4:8] = sc[:, :4]
        b[:, 8:12] = m[:, :4]
        b[:, 12:16] = sc[:, 4:] | (m[:, 4:] << 4)
        b[:, 16:] = rng.integers(0, 256, (n, 128), dtype=np.uint8)
        return b
    if qtype == "Q6_K":
        # ql[128], qh[64], 16 int8 scales, d (f16); value = d * scale * (q6 - 32)
        b = np.empty((n, 210), np.uint8)
        b[:, :192] = rng.integers(0, 256, (n, 192), dtype=np.uint8)
        b[:, 192:208] = rng.integers(2, 6, (n, 16), dtype=np.int8).view(np.uint8)
        b[:, 208:210] = _f16_bytes(jitter * STD / (3.6 * 18.5))  # rms scale ~3.6, std of 6-bit codes 18.5
        return b
    if qtype == "IQ3_S":
        # d (f16), 64 grid-index low bytes, 8 bytes of 9th bits, 32 bytes of signs, 4 bytes of 4-bit sub-block
        # scales; value = d * (1 + 2 sc) * grid * sign, grid magnitudes 1..15 (rms ~9.2)
        b = np.empty((n, 110), np.uint8)
        b[:, 2:106] = rng.integers(0, 256, (n, 104), dtype=np.uint8)
        lo, hi = rng.integers(2, 6, (n, 4)), rng.integers(2, 6, (n, 4))
        b[:, 106:110] = (lo | (hi << 4)).astype(np.uint8)
        b[:, 0:2] = _f16_bytes(jitter * STD / (8.3 * 9.2))  # rms of 1 + 2 sc over sc in 2..5: ~8.3
        return b
    raise ValueError(f"no block maker for {qtype}")


class Blocks:
    """A pool of valid blocks per type, streamed: each tensor continues where the last one of its type
    stopped, so the same sequence of calls gives the same bytes (the F32 twin relies on it)."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.pools: dict[str, np.ndarray] = {}
        self.pos: dict[str, int] = {}

    def _pool(self, qtype: str) -> np.ndarray:
        if qtype not in self.pools:
            p = make_pool(qtype, POOL_BLOCKS, self.rng)
            self.pools[qtype] = np.concatenate([p, p])  # any window of <= POOL_BLOCKS blocks is contiguous
            self.pos[qtype] = 0
        return self.pools[qtype]

    def chunks(self, qtype: str, nblocks: int):
        pool = self._pool(qtype)
        while nblocks:
            k = min(nblocks, POOL_BLOCKS)
            s = self.pos[qtype]
            yield pool[s:s + k]
            self.pos[qtype] = (s + k) % POOL_BLOCKS
            nblocks -= k

    def array(self, qtype: str, nblocks: int) -> np.ndarray:
        return np.concatenate(list(self.chunks(qtype, nblocks)))


def nbytes_of(ne, qtype: str) -> int:
    n = int(np.prod(ne))
    if qtype == "F32":
        return 4 * n
    w, b = BLOCK[qtype]
    assert ne[0] % w == 0, f"row length {ne[0]} is not a multiple of {qtype}'s block of {w}"
    return n // w * b


def f32_values(ne, role: str, rng: np.random.Generator) -> np.ndarray:
    shape = tuple(reversed(ne))
    if role == "ones":
        return np.ones(shape, np.float32)
    if role == "neg":
        return -np.ones(shape, np.float32)
    if role == "zeros":
        return np.zeros(shape, np.float32)
    return (rng.standard_normal(shape) * STD).astype(np.float32)


# ---- vocabulary ------------------------------------------------------------------------------
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_chars() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes: printable Latin-1 bytes as themselves,
    the others as code points from 256 up, printable ones first."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in keep]
    return [chr(b) for b in keep] + [chr(256 + i) for i in range(len(others))]


def synthetic_vocab(V: int) -> dict:
    """A byte-level BPE vocabulary of V tokens: 256 byte tokens, merges of pairs of letters/digits, and the
    three control tokens at the end."""
    chars = byte_chars()
    base = [c for c in chars if c.isalnum()]
    merges, tokens = [], list(chars)
    for a in base:
        for b in base:
            if len(tokens) >= V - len(SPECIALS):
                break
            merges.append(f"{a} {b}")
            tokens.append(a + b)
    if len(tokens) < V - len(SPECIALS):
        raise ValueError(f"synthetic vocabulary tops out at {len(tokens) + len(SPECIALS)} tokens")
    tokens += SPECIALS
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * (V - 3) + [3, 3, 3], "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": V - 1, "tokenizer.ggml.padding_token_id": V - 3,
            "tokenizer.ggml.bos_token_id": V - 3, "tokenizer.chat_template": CHAT_TEMPLATE}


def cut_vocab(tok: dict, V: int) -> dict:
    """The first V - 3 tokens of a real vocabulary, the merges among them, and the three control tokens."""
    keep = tok["tokenizer.ggml.tokens"][:V - len(SPECIALS)]
    have = set(keep)
    merges = [m for m in tok["tokenizer.ggml.merges"]
              if (ab := m.split(" ", 1)) and len(ab) == 2 and ab[0] in have and ab[1] in have and ab[0] + ab[1] in have]
    return {**tok, "tokenizer.ggml.tokens": keep + list(SPECIALS),
            "tokenizer.ggml.token_type": list(tok["tokenizer.ggml.token_type"][:V - 3]) + [3, 3, 3],
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.eos_token_id": V - 1,
            "tokenizer.ggml.padding_token_id": V - 3, "tokenizer.ggml.bos_token_id": V - 3}


# ---- the file ------------------------------------------------------------------------------
def write(out: str | Path, quant: str = "q4_k_m", shape: Shape = FULL, tok: dict | None = None,
          dequantized: bool = False, seed: int = 0, log=print) -> dict:
    """Write the file; returns {tensor name: GGUF type} plus a summary under "_summary".
    dequantized: the same weights stored as F32 (the oracle for tests; small shapes only)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    tok = tok or synthetic_vocab(512)
    V = len(tok["tokenizer.ggml.tokens"])
    plan = [(name, ne, role, quant_type(quant, name, role, shape.L)) for name, ne, role in tensors(shape, V)]
    if dequantized and sum(nbytes_of(ne, "F32") for _, ne, _, _ in plan) > 2 << 30:
        raise ValueError("--dequantized is for small shapes (the F32 file would exceed 2 GiB)")
    w = gguf.GGUFWriter(str(out), "qwen35moe")
    a = "qwen35moe."
    w.add_name(f"qwen36-35b-a3b-shape-random-{quant}{'-dequantized' if dequantized else ''}")
    w.add_uint32(a + "block_count", shape.L)
    w.add_uint32(a + "context_length", 262144)
    w.add_uint32(a + "embedding_length", shape.H)
    w.add_uint32(a + "attention.head_count", shape.NH)
    w.add_uint32(a + "attention.head_count_kv", shape.NKV)
    w.add_float32(a + "rope.freq_base", 10000000.0)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(a + "expert_count", shape.E)
    w.add_uint32(a + "expert_used_count", shape.K)
    w.add_uint32(a + "attention.key_length", shape.HD)
    w.add_uint32(a + "attention.value_length", shape.HD)
    w.add_uint32("general.file_type", 0 if dequantized else FILE_TYPES[quant])
    w.add_uint32(a + "expert_feed_forward_length", shape.I)
    w.add_uint32(a + "expert_shared_feed_forward_length", shape.SI)
    w.add_uint32(a + "ssm.conv_kernel", shape.CONV)
    w.add_uint32(a + "ssm.state_size", shape.KD)
    w.add_uint32(a + "ssm.group_count", shape.KH)
    w.add_uint32(a + "ssm.time_step_rank", shape.VH)
    w.add_uint32(a + "ssm.inner_size", shape.VH * shape.VD)
    w.add_array(a + "attention.recurrent_layers", [bool((i + 1) % 4) for i in range(shape.L)])
    w.add_uint32(a + "full_attention_interval", 4)
    w.add_uint32(a + "rope.dimension_count", shape.ROPE)
    w.add_array(a + "rope.dimension_sections", list(shape.SECTIONS))
    w.add_uint32("general.quantization_version", 2)
    w.add_string("tokenizer.ggml.model", tok["tokenizer.ggml.model"])
    w.add_string("tokenizer.ggml.pre", tok["tokenizer.ggml.pre"])
    w.add_array("tokenizer.ggml.tokens", tok["tokenizer.ggml.tokens"])
    w.add_array("tokenizer.ggml.token_type", tok["tokenizer.ggml.token_type"])
    w.add_array("tokenizer.ggml.merges", tok["tokenizer.ggml.merges"])
    for k in ["eos_token_id", "padding_token_id", "bos_token_id"]:
        w.add_uint32("tokenizer.ggml." + k, tok["tokenizer.ggml." + k])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", tok["tokenizer.chat_template"])
    for name, ne, role, qt in plan:
        stored = "F32" if dequantized else qt
        if stored == "F32":
            w.add_tensor_info(name, list(reversed(ne)), np.dtype(np.float32), nbytes_of(ne, "F32"), raw_dtype=Q.F32)
        else:
            byte_shape = list(reversed(ne[1:])) + [ne[0] // BLOCK[qt][0] * BLOCK[qt][1]]
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes_of(ne, qt), raw_dtype=Q[qt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    # Tensor data as GGUFWriter.write_tensors_to_file lays it out (each tensor aligned, padded after), but
    # streamed from the block pools instead of one array per tensor.
    fout = w.fout[0]
    w.write_padding(fout, fout.tell())
    blocks, rng = Blocks(seed), np.random.default_rng(seed + 1)
    t, total, types = time.time(), 0, {}
    for name, ne, role, qt in plan:
        types[name] = qt
        n = nbytes_of(ne, "F32" if dequantized else qt)
        if qt == "F32":
            f32_values(ne, role, rng).tofile(fout)
        elif dequantized:
            from gguf.quants import dequantize

            raw = blocks.array(qt, int(np.prod(ne)) // BLOCK[qt][0])
            dequantize(raw.reshape(-1), Q[qt]).astype(np.float32).tofile(fout)
        else:
            for chunk in blocks.chunks(qt, int(np.prod(ne)) // BLOCK[qt][0]):
                fout.write(memoryview(chunk).cast("B"))
        w.write_padding(fout, n)
        total += n
    w.close()
    secs = time.time() - t
    counts: dict[str, int] = {}
    for name, ne, role, qt in plan:
        counts[qt] = counts.get(qt, 0) + nbytes_of(ne, qt)
    summary = {"path": str(out), "quant": quant, "dequantized": dequantized, "tensors": len(plan), "bytes": total,
               "seconds": round(secs, 1), "vocab": V, "layers": shape.L,
               "bytes_by_type": counts}
    log(f"wrote {out}: {len(plan)} tensors, {total / 1e9:.2f} GB in {secs:.0f} s, vocab {V}, "
        + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in sorted(counts.items())))
    return {**types, "_summary": summary}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--quant", default="q4_k_m", choices=sorted(FILE_TYPES))
    ap.add_argument("--layers", type=int, help="layers (default 40; --tiny 4)")
    ap.add_argument("--vocab-from", help="JSON with the tokenizer.* GGUF fields (e.g. qwen3-tokenizer-gguf-fields.json)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (made up, or the cut of --vocab-from; --tiny: 512)")
    ap.add_argument("--tiny", action="store_true", help="small dims (hidden 256, 8 experts top-2, 4 layers), vocab 512")
    ap.add_argument("--dequantized", action="store_true", help="store the same weights as F32 (small files only)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shape = TINY if args.tiny else FULL
    if args.layers:
        shape = replace(shape, L=args.layers)
    V = args.vocab or (512 if args.tiny else None)
    if args.vocab_from:
        tok = json.loads(Path(args.vocab_from).read_text())
        if V and V < len(tok["tokenizer.ggml.tokens"]):
            tok = cut_vocab(tok, V)
    elif V:
        tok = synthetic_vocab(V)
    else:
        sys.exit("the full shape needs --vocab-from (the real vocabulary) or --vocab N (a made-up one)")
    return write(args.out, args.quant, shape, tok, args.dequantized, args.seed)


if __name__ == "__main__":
    main()

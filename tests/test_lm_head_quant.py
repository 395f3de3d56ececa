"""--lm-head-quant q8_0: a checkpoint's 16/32-bit vocabulary head stored as Q8_0 blocks at load.

The oracle for the bytes is the `gguf` package's Q8_0 quantizer (ggml's reference); for the logits, the head's input
times the dequantized blocks in float64; the plan counts the Q8_0 bytes instead of the matrix's. A head tied to the
embedding is refused with the reason; a GGUF's head keeps the type its file stores.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def test_quantize_q8_0_equals_ggml_reference():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from moestream.quant.gguf_formats import quantize_q8_0

    g = torch.Generator().manual_seed(0)
    w = torch.randn(203, 192, generator=g) * torch.rand(203, 1, generator=g) * 4
    w[7] = 0  # all-zero blocks: d = 0, codes 0
    w[9, 32:64] = 1e-30
    for dtype in (torch.float32, torch.bfloat16):
        x = w.to(dtype)
        got = quantize_q8_0(x, rows_at_once=50)
        assert got.dtype == torch.uint8 and got.shape == (203, 192 // 32 * 34)
        assert np.array_equal(got.numpy(), quantize(x.float().numpy(), GGMLQuantizationType.Q8_0))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.zeros(2, 48))


def test_engine_head_in_q8_0(tiny_checkpoint):
    from safetensors.torch import load_file

    from moestream import LLM, SamplingParams
    from moestream.layers.quant_linear import QuantLinear
    from moestream.quant import gguf_format
    from moestream.quant.gguf_formats import quantize_q8_0

    path = tiny_checkpoint("qwen35")
    plain = LLM(path, device="cpu", dtype="float32")
    dense = plain.engine.plan.bytes.dense
    plain.close()
    llm = LLM(path, device="cpu", dtype="float32", lm_head_quant="q8_0")
    head = llm.engine.model.lm_head
    assert isinstance(head, QuantLinear) and head.fmt.type_name == "Q8_0" and head.float_activations
    stored = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        stored.update(load_file(f))
    w = stored["lm_head.weight"].float()
    V, H = w.shape
    assert torch.equal(head.raw, quantize_q8_0(w))
    assert llm.engine.plan.bytes.dense == dense - V * H * 4 + V * (H // 32) * 34

    seen = []
    head.register_forward_hook(lambda m, args, out: seen.append((args[0].detach().clone(), out.detach().clone())))
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    wq = gguf_format("Q8_0").dequantize(head.raw, (V, H), torch.float64)
    assert len(seen) >= 3
    for x, y in seen:  # float32 activations times the stored blocks, summed in float32
        want = x.double() @ wq.T
        assert (y.double() - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())
    llm.close()


def test_tied_head_is_refused(tmp_path):
    import tiny_models

    from moestream import LLM
    from moestream.core import ConfigError

    path = tiny_models.make_qwen3_moe(tmp_path / "tied", tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        LLM(path, device="cpu", dtype="float32", lm_head_quant="q8_0")


def test_a_gguf_head_keeps_its_type(tmp_path, tiny_checkpoint, caplog):
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream import LLM

    gguf = gguf_writer.write_gguf(tiny_checkpoint("qwen3"), tmp_path / "m.gguf", Q.Q4_1)[0]
    plain = LLM(gguf, device="cpu", dtype="float32")
    kind, dense = type(plain.engine.model.lm_head), plain.engine.plan.bytes.dense
    plain.close()
    with caplog.at_level("INFO", logger="moestream.engine"):
        llm = LLM(gguf, device="cpu", dtype="float32", lm_head_quant="q8_0")
    assert type(llm.engine.model.lm_head) is kind and llm.engine.plan.bytes.dense == dense
    assert "a GGUF's head keeps the type its file stores" in caplog.text
    llm.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_q8_0_head_prefill_rows_in_tiles():
    """On a GPU a Q8_0 head bigger than GPU_TILE_BYTES dense (40,000 x 2,048: 156 MiB in bf16) takes more rows than
    the GEMV path (prompt logprobs, verify rows) in 64 MiB row tiles: the product equals the float64 one of the stored
    blocks within bf16 rounding."""
    from moestream.layers.quant_linear import GPU_GEMV_ROWS, QuantLinear
    from moestream.quant import gguf_format
    from moestream.quant.base import gpu_tile_rows
    from moestream.quant.gguf_formats import quantize_q8_0

    N, K = 40000, 2048
    assert gpu_tile_rows(K, N, 2) < N  # (the tiled path)
    w = torch.randn(N, K) * 0.05
    head = QuantLinear("Q8_0", quantize_q8_0(w), N, K, float_activations=True).cuda()
    x = torch.randn(GPU_GEMV_ROWS + 24, K, device="cuda", dtype=torch.bfloat16)
    y = head(x)
    want = x.double().cpu() @ gguf_format("Q8_0").dequantize(head.raw.cpu(), (N, K), torch.float64).T
    assert y.shape == (x.shape[0], N) and (y.double().cpu() - want).abs().max().item() < 0.05 * want.abs().max().item()

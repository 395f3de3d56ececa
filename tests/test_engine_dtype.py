"""The automatic compute dtype per device (no GPU needed: the capability query is replaced)."""
from __future__ import annotations

import torch

from moestream.engine import engine as eng


class Cfg:
    torch_dtype = "bfloat16"

    @staticmethod
    def approx_num_params():
        return 1000


def test_bf16_checkpoint_runs_fp16_on_gpus_without_bf16_tensor_cores(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # Turing
    assert eng.resolve_dtype("auto", Cfg, cuda) == torch.float16
    assert eng.resolve_dtype("bfloat16", Cfg, cuda) == torch.bfloat16  # an explicit choice is kept
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # Hopper
    assert eng.resolve_dtype("auto", Cfg, cuda) == torch.bfloat16
    assert eng.resolve_dtype("auto", Cfg, torch.device("cpu")) == torch.float32


def test_cpu_counts_only_the_weights_that_take_the_dtype(monkeypatch):
    """On a CPU, auto is float32 unless it would fill over a quarter of host memory; routed experts that keep a
    quantized checkpoint's format (a GGUF's) take no dtype and do not count (a Qwen3-30B-A3B-shaped GGUF on a 24 GB
    machine computes in float32, so the compiled CPU decode step runs), while the same model's bf16 experts do."""
    from moestream.config import ModelConfig

    cfg = ModelConfig.from_hf({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
                               "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                               "vocab_size": 151936, "intermediate_size": 6144, "num_experts": 128,
                               "num_experts_per_tok": 8, "moe_intermediate_size": 768, "rms_norm_eps": 1e-6,
                               "rope_theta": 1e6, "max_position_embeddings": 40960})
    experts = cfg.approx_routed_expert_params()
    assert experts == 48 * 3 * 2048 * 128 * 768 and 0 < cfg.approx_num_params() - experts < experts
    monkeypatch.setattr(eng, "host_memory", lambda: (24 << 30, 20 << 30))
    cpu = torch.device("cpu")
    assert eng.resolve_dtype("auto", cfg, cpu, experts_stored=True) == torch.float32
    assert eng.resolve_dtype("auto", cfg, cpu, experts_stored=False) == torch.bfloat16
    assert eng.resolve_dtype("bfloat16", cfg, cpu, experts_stored=True) == torch.bfloat16  # an explicit choice is kept


def test_keep_16bit_linears_moves_only_exact_unshared_weights():
    """A float32 model loaded from a bf16 checkpoint: linear weights whose values are all bf16 values go back to bf16
    rows (same values), one with a value bf16 cannot hold stays float32, and a weight tied to an embedding stays."""
    from torch import nn

    g = torch.Generator().manual_seed(0)
    m = nn.Module()
    m.a = nn.Linear(8, 4, bias=False)
    m.b = nn.Linear(8, 4, bias=False)
    m.emb = nn.Embedding(4, 8)
    m.head = nn.Linear(8, 4, bias=False)
    with torch.no_grad():
        for lin in (m.a, m.b):
            lin.weight.copy_(torch.randn(4, 8, generator=g).bfloat16().float())
        m.b.weight[1, 2] += 2 ** -20  # not a bf16 value
        m.emb.weight.copy_(torch.randn(4, 8, generator=g).bfloat16().float())
    m.head.weight = m.emb.weight
    before = m.a.weight.clone()
    assert eng.keep_16bit_linears(m, torch.bfloat16) == 1
    assert m.a.weight.dtype == torch.bfloat16 and torch.equal(m.a.weight.float(), before)
    assert m.b.weight.dtype == torch.float32 and m.head.weight.dtype == torch.float32 and m.head.weight is m.emb.weight

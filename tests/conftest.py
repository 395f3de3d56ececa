"""Shared fixtures: tiny random checkpoints (built once per session) and their HF reference models."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# name -> builder kwargs; "qwen3" = Qwen3MoeForCausalLM, "qwen35" = real Qwen3.5/3.6 layout,
# "qwen35_causal" = the text-only Qwen3_5MoeForCausalLM layout.
VARIANTS = {
    "qwen3": ("make_qwen3_moe", {}),
    "qwen35": ("make_qwen3_5_moe", {"layout": "conditional"}),
    "qwen35_causal": ("make_qwen3_5_moe", {"layout": "causal"}),
    "qwen35_mtp": ("make_qwen3_5_moe_mtp", {"layout": "conditional"}),  # with a multi-token-prediction block
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(variant, **kw) -> Path, cached per (variant, kw)."""
    import tiny_models

    cache: dict = {}

    def make(variant: str, **kw) -> Path:
        key = (variant, tuple(sorted(kw.items())))
        if key not in cache:
            fn, base = VARIANTS[variant]
            out = tmp_path_factory.mktemp(variant)
            cache[key] = getattr(tiny_models, fn)(out, **{**base, **kw})
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint):
    import tiny_models

    cache: dict = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = tiny_models.hf_reference(tiny_checkpoint(variant))
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def one_torch_thread():
    """Pin torch's intra-op pool to one thread for a module and put it back after: the cpu/hybrid
    expert backends set the (process-wide) thread count, and these tiny models are dominated by
    thread hand-offs, not arithmetic."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

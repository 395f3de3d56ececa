"""Engine options are declared once (EngineConfig fields), and the CLI flags are built from them; the one
Triton decision (env.triton_enabled) is what every Triton kernel gate asks, and --triton sets it."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moestream import cli, env  # noqa: E402
from moestream.config import EngineConfig  # noqa: E402
from moestream.core import ConfigError  # noqa: E402

API_ONLY = {"seed", "revision", "prefill_rows_cap"}  # LLM(...) keywords without a flag (`generate --seed` samples)


def _engine_actions(command: list[str]) -> tuple[argparse.Namespace, dict[str, list[argparse.Action]]]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command[0]]
    by_dest: dict[str, list[argparse.Action]] = {}
    for action in sub._actions:
        by_dest.setdefault(action.dest, []).append(action)
    return parser.parse_args(command), by_dest


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"], ["chat"]])
def test_every_engine_option_has_one_flag_with_the_config_default(command):
    args, by_dest = _engine_actions(command)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(cli.ENGINE_KEYS) == fields - API_ONLY
    defaults = EngineConfig()
    for name in cli.ENGINE_KEYS:
        assert len(by_dest[name]) == 1, f"{name}: {len(by_dest[name])} flags"
        assert getattr(args, name) == getattr(defaults, name), name
    assert EngineConfig.from_options(**cli.engine_options(args)) == defaults


def test_flag_choices_are_what_the_config_accepts():
    _, by_dest = _engine_actions(["serve"])
    for name in cli.ENGINE_KEYS:
        choices = by_dest[name][0].choices
        if choices is None:
            continue
        for value in choices:
            assert getattr(EngineConfig(**{name: value}), name) == value
        with pytest.raises(ConfigError, match="--" + name.replace("_", "-")):
            EngineConfig(**{name: "no-such-choice"})


def test_prefetch_is_off_in_every_declaration():
    """The CLI, EngineConfig and the expert runtime's own default agree (docs: `--moe-prefetch off`, the
    default; benchmarks/RESULTS.md measured it slower on an H200)."""
    from moestream.moe.runtime import RuntimeOptions

    args, _ = _engine_actions(["serve"])
    assert args.moe_prefetch == EngineConfig().moe_prefetch == "off"
    assert RuntimeOptions().prefetch is False


@pytest.fixture
def triton_mode():
    yield env.set_triton_mode
    env.set_triton_mode("auto")


def _gates() -> dict[str, bool]:
    """Every Triton kernel gate's answer for a (pretended) CUDA tensor."""
    from moestream.layers import quant_linear, triton_ops
    from moestream.moe import compute, pairs, qpairs
    from moestream.quant import gguf_format
    from moestream.quant import base

    cuda = torch.device("cuda")
    t = SimpleNamespace(is_cuda=True, device=cuda)
    bank = object()
    refs = {0: SimpleNamespace(bank=bank, fmt=None)}
    return {"layers.triton_ops.enabled": triton_ops.enabled(t), "moe.pairs.triton_ready": pairs.triton_ready(cuda),
            "moe.qpairs": qpairs._triton_ok(), "quant.base._triton_path": base._triton_path(t) is not None,
            "layers.quant_linear.gpu_gemv": quant_linear.gpu_gemv(gguf_format("Q8_0")),
            "moe.compute.grouped_ready": _grouped_gate(compute, t, refs)}


def _grouped_gate(compute, t, refs) -> bool:
    try:
        return compute.grouped_ready(t, refs)
    except Exception:  # past the Triton decision: the gate looked at the (fake) bank
        return True


def test_triton_off_closes_every_gate(triton_mode, monkeypatch):
    monkeypatch.setenv("MOESTREAM_TRITON", "1")
    triton_mode("off")
    assert not env.triton_enabled()
    assert not any(_gates().values()), _gates()
    if importlib.util.find_spec("triton") is not None:  # and on opens them, whatever MOESTREAM_TRITON says
        monkeypatch.setenv("MOESTREAM_TRITON", "0")
        triton_mode("on")
        assert all(_gates().values()), _gates()


def test_triton_option_decides_over_the_environment(triton_mode, monkeypatch):
    monkeypatch.setenv("MOESTREAM_TRITON", "0")
    assert not env.triton_enabled()  # auto: the environment decides
    triton_mode("on")
    assert env.triton_enabled()
    monkeypatch.setenv("MOESTREAM_TRITON", "1")
    triton_mode("off")
    assert not env.triton_enabled()
    triton_mode("auto")
    assert env.triton_enabled()
    with pytest.raises(ValueError):
        triton_mode("maybe")


def test_engine_sets_the_triton_decision(triton_mode, monkeypatch):
    from moestream import LLM

    monkeypatch.setenv("MOESTREAM_TRITON", "1")
    LLM("demo", device="cpu", triton="off", max_running_requests=1)
    assert not env.triton_enabled()
    LLM("demo", device="cpu", max_running_requests=1)  # auto again: MOESTREAM_TRITON decides
    assert env.triton_enabled()


def test_kv_cache_dtype_sets_the_pool_and_the_plan(tiny_checkpoint):
    """--kv-cache-dtype: auto keeps the model's dtype; float16 makes a float16 pool whose bytes the plan counts
    (half a float32 model's per token); anything else is one readable ConfigError."""
    from moestream import LLM

    sizes = {}
    for kv in ("auto", "float16"):
        llm = LLM(tiny_checkpoint("qwen3"), device="cpu", dtype="float32", kv_cache_dtype=kv)
        pool = llm.engine.caches.kv
        assert pool.k.dtype == pool.v.dtype == (torch.float16 if kv == "float16" else torch.float32)
        sizes[kv] = llm.engine.plan.as_dict()["bytes"]["kv"] / llm.engine.plan.kv_tokens
        llm.close()
    assert sizes["float16"] == sizes["auto"] / 2
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        EngineConfig(kv_cache_dtype="int8").validate()


def test_prefill_rows_cap_is_checked():
    """The planner's prefill-row cap (Python API only): a positive count or None."""
    EngineConfig(prefill_rows_cap=16).validate()
    with pytest.raises(ConfigError, match="prefill_rows_cap"):
        EngineConfig(prefill_rows_cap=0).validate()

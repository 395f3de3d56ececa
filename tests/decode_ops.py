"""Count the kernels one decode step issues, per decoder layer, on the CPU.

A TorchDispatchMode sees every aten op of one decode step of a tiny model (bf16, as on a GPU: the dtype
casts count); ops that launch no kernel (views, allocations) are not counted. Ops are attributed to the
layer whose token mixer (GDN or attention) ran last: a layer counts from its mixer up to the next
layer's input norm (which a fused MoE combine may compute). The first layer's input norm is under
"embed"; the routed experts (`runtime.forward`, moe/) are a bucket of their own.

With `triton=True` (run under TRITON_INTERPRET=1) the model takes its CUDA path on CPU tensors: the
Triton wrappers' `enabled()` ignores the device and every Triton launch counts as one kernel (the aten
ops inside the interpreter are not counted). That is the count a CUDA decode step has, up to the experts.

As a script it prints the per-layer counts of the moestream it imports, so
    PYTHONPATH=<checkout> TRITON_INTERPRET=1 python tests/decode_ops.py [--triton] [--json OUT] [qwen35|qwen3]
compares two checkouts (it adds only tests/ to sys.path, for tiny_models); --json writes
{"per_kind": {...}, "ops": {bucket: [op names]}} for tests/test_decode_ops.py.
"""
from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that allocate or alias: no kernel launch
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "detach", "alias", "lift_fresh", "_unsafe_view",
              "resolve_conj", "resolve_neg", "new_empty", "new_empty_strided"}


def launches_kernel(func) -> bool:
    return not func.is_view and func.overloadpacket.__name__.lstrip("_").rstrip("_") not in \
        {n.strip("_") for n in _NO_KERNEL}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.where = "embed"
        self.ops: dict[str, list[str]] = defaultdict(list)
        self.paused = 0
        self.active = False  # Triton launches count only inside `with counter:` (the decode step)

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and launches_kernel(func):
            self.ops[self.where].append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def bucket(self, name: str, count_as: str | None = None):
        """Run a region outside the aten count; `count_as` records it as one launch of that name."""
        prev, self.where = self.where, name
        if count_as:
            self.ops[name].append(count_as)
        self.paused += count_as is not None
        try:
            yield
        finally:
            self.paused -= count_as is not None
            self.where = prev


def _wrap_triton_launches(counter: OpCounter, stack: contextlib.ExitStack) -> None:
    """Every `_*_kernel` JIT function of layers/triton_ops counts one launch; enabled() ignores the device."""
    from moestream.env import triton_enabled
    from moestream.layers import triton_ops

    class Launch:
        def __init__(self, name, jit):
            self.name, self.jit = name, jit

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                if not counter.active:
                    return self.jit[grid](*args, **kwargs)
                with counter.bucket(counter.where, count_as=f"triton:{self.name}"):
                    return self.jit[grid](*args, **kwargs)
            return run

    for name in [n for n in dir(triton_ops) if n.startswith("_") and n.endswith("_kernel")]:
        stack.enter_context(_patched(triton_ops, name, Launch(name, getattr(triton_ops, name))))
    stack.enter_context(_patched(triton_ops, "enabled", lambda x: triton_enabled()))


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def count_decode_step(folder: Path, triton: bool = False, **llm_kw) -> dict[str, list[str]]:
    """{bucket: op names} of the first decode step of a one-prompt greedy generation (batch 1)."""
    from moestream import LLM, SamplingParams

    llm = LLM(folder, device="cpu", **{"dtype": "bfloat16", "moe_decode_kernel": "pairs", **llm_kw})
    eng, model = llm.engine, llm.engine.model
    counter = OpCounter()
    with contextlib.ExitStack() as stack:
        if triton:
            _wrap_triton_launches(counter, stack)
        for i, layer in enumerate(model.layers):
            tag = f"{i}:{'gdn' if layer.kind == 'linear_attention' else 'attn'}"
            tag += "+moe" if hasattr(layer.mlp, "runtime") else "+mlp"
            mixer = layer.linear_attn if layer.kind == "linear_attention" else layer.self_attn
            mixer.register_forward_pre_hook(lambda m, a, tag=tag: setattr(counter, "where", tag))
        model.norm.register_forward_pre_hook(lambda m, a: setattr(counter, "where", "head"))
        runtime_forward = eng.runtime.forward

        def experts(*a, **k):
            with counter.bucket("experts"):
                return runtime_forward(*a, **k)

        stack.enter_context(_patched(eng.runtime, "forward", experts))
        engine_forward, done = eng.forward, []

        def forward(batch):
            if not batch.is_decode or done:
                return engine_forward(batch)
            done.append(1)
            counter.where = "embed"
            with counter:
                return engine_forward(batch)

        stack.enter_context(_patched(eng, "forward", forward))
        # under inference_mode a TorchDispatchMode does not see dtype casts (_to_copy): run the model's
        # forward under no_grad instead (the same ops and numbers)
        plain = type(model).forward.__wrapped__
        stack.enter_context(_patched(model, "forward", lambda batch: plain(model, batch)))
        stack.enter_context(torch.no_grad())
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert done, "no decode step ran"
    return dict(counter.ops)


def per_layer_kind(ops: dict[str, list[str]]) -> dict[str, int]:
    """{layer kind ('gdn+moe', ...): kernels of the first layer of that kind}. Layers of a kind issue the
    same ops, except that the last layer also holds the model's pick of the logits rows (h[logits_index])."""
    out: dict[str, int] = {}
    for where, names in ops.items():
        if ":" in where:
            out.setdefault(where.split(":", 1)[1], len(names))
    return out


def main(argv: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import moestream
    import tiny_models

    triton = "--triton" in argv
    out = argv[argv.index("--json") + 1] if "--json" in argv else None
    variant = next((a for a in argv if not a.startswith("-") and a != out), "qwen35")
    d = tempfile.mkdtemp()
    folder = tiny_models.make_qwen3_5_moe(d, layout="causal") if variant == "qwen35" else tiny_models.make_qwen3_moe(d)
    ops = count_decode_step(folder, triton=triton)
    print(f"moestream {Path(moestream.__file__).parent}  variant {variant}  triton path {triton}")
    for where, names in ops.items():
        print(f"  {where:12s} {len(names):4d}  {dict(Counter(names))}")
    print("  per layer kind:", per_layer_kind(ops))
    if out:
        Path(out).write_text(json.dumps({"per_kind": per_layer_kind(ops), "ops": ops}))


if __name__ == "__main__":
    main(sys.argv[1:])

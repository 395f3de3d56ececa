"""Imports point down: server -> scheduler -> engine -> models -> layers -> moe/kernels -> core/config."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "moestream"
# A package may import only packages of a lower rank (or its own).
RANK = {"core": 0, "env": 0, "hardware": 0, "demo_tokenizer": 0, "config": 1, "random_weights": 1, "quant": 2, "kernels": 2,
        "tokenizer": 2, "demo": 2, "moe": 3, "layers": 4, "kvcache": 4, "models": 5, "engine": 6, "scheduler": 7,
        "parallel": 7, "llm": 8, "server": 9, "cli": 10}
# engine/batch.py is plain data shared by layers and models (the vocabulary of a forward pass).
# kernels/cpu_quant.py (the compiled CPU matmuls; it imports only env) computes quant.qlinear on CPU.
ALLOWED = {("layers", "engine.batch"), ("models", "engine.batch"), ("kvcache", "core"),
           ("quant", "kernels.cpu_quant")}


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PKG).with_suffix("")
    parts = list(rel.parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[:-node.level] if len(parts) >= node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("moestream."):
                mod = node.module[len("moestream."):]
            else:
                continue
            yield mod


def test_imports_point_down():
    bad = []
    for path in PKG.rglob("*.py"):
        top = path.relative_to(PKG).parts[0].removesuffix(".py")
        if top == "__init__" or top not in RANK:
            continue
        for mod in _imports(path):
            target = mod.split(".")[0]
            if not target or target == top or target not in RANK:
                continue
            if any(top == a and mod.startswith(b) for a, b in ALLOWED):
                continue
            if RANK[target] >= RANK[top]:
                bad.append(f"{path.relative_to(PKG)} imports {mod}")
    assert not bad, "upward imports:\n" + "\n".join(bad)

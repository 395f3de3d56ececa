"""Imports point down: server -> llm -> parallel -> engine -> scheduler -> models -> layers/kvcache -> moe
-> quant/tokenizer -> kernels -> config/batch -> core/env/hardware. No exceptions, so no package cycles."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "moestream"
# A package may import only packages of a lower rank (or its own).
# batch.py is plain data shared by layers, models and the engine (the vocabulary of a forward pass);
# kernels/ (compiled CPU matmuls, widened GEMMs) import only machine facts, so quant/ can call them.
RANK = {"core": 0, "env": 0, "hardware": 0, "demo_tokenizer": 0, "config": 1, "random_weights": 1, "batch": 1,
        "kernels": 2, "quant": 3, "tokenizer": 3, "demo": 3, "moe": 4, "layers": 5, "kvcache": 5, "models": 6,
        "scheduler": 7, "engine": 8, "parallel": 9, "llm": 10, "server": 11, "cli": 12}


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
        elif isinstance(node, ast.Import):
            yield from (a.name[len("moestream."):] for a in node.names if a.name.startswith("moestream."))


def test_imports_point_down():
    bad = []
    for path in PKG.rglob("*.py"):
        top = path.relative_to(PKG).parts[0].removesuffix(".py")
        if top == "__init__":
            continue
        for mod in _imports(path):
            target = mod.split(".")[0]
            if not target or target == top:
                continue
            if RANK[target] >= RANK[top]:
                bad.append(f"{path.relative_to(PKG)} imports {mod}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_every_module_has_a_rank():
    tops = {p.name.removesuffix(".py") for p in PKG.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()}
    assert tops == set(RANK), (sorted(tops - set(RANK)), sorted(set(RANK) - tops))

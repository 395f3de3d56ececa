"""Plot a vs_llama.json (benchmarks/vs_llama.py) where the run had no matplotlib, or again after merging:
decode tg64 (batch 1) and prefill pp512 against GPU memory, llama.cpp and each moestream backend, one column
per file.

    python benchmarks/plot_vs_llama.py vs_llama.json [-o vs_llama.png] [--merge older.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_llama  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("-o", "--out")
    ap.add_argument("--merge", help="an older vs_llama.json whose results fill what this one lacks")
    args = ap.parse_args()
    rep = json.loads(Path(args.json).read_text())
    if args.merge:
        old = json.loads(Path(args.merge).read_text())
        for side in ("llama", "moestream", "files"):
            for q, v in old.get(side, {}).items():
                if q not in rep.setdefault(side, {}):
                    rep[side][q] = v
                elif "runs" in v:
                    rep[side][q]["runs"] = {**v["runs"], **rep[side][q].get("runs", {})}
    out = Path(args.out or Path(args.json).with_suffix(".png"))
    if not vs_llama.plot(rep, out):
        sys.exit("no plot made (matplotlib missing or no results)")
    print(f"wrote {out}")
    print(vs_llama.markdown(rep))


if __name__ == "__main__":
    main()

"""Plot decode tok/s against VRAM cap for each backend and batch size from a decode_sweep.py JSON.

    python benchmarks/plot_sweep.py benchmarks/results/decode_sweep_2026-12-02_h200.json out.png
(needs matplotlib, which is not a moestream dependency)
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    d = json.load(open(src))
    runs = [r for r in d["runs"] if "error" not in r and r.get("cap_gb")]
    backends = sorted({r["backend"] for r in runs})
    batches = sorted({r["bs"] for r in runs})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), sharey=True)
    for ax, bs in zip(axes, batches):
        for b in backends:
            pts = sorted((r["cap_gb"], r["decode_tok_s_agg"]) for r in runs if r["backend"] == b and r["bs"] == bs)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b)
        for r in d["runs"]:  # the fused ceiling (no cap) as a dashed line
            if r.get("backend") == "fused" and r.get("bs") == bs and "error" not in r:
                ax.axhline(r["decode_tok_s_agg"], ls="--", color="gray", label="fused (all in VRAM)")
        ax.set_yscale("log")
        ax.set_title(f"batch {bs} (aggregate)")
        ax.set_xlabel("VRAM cap (GB)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("decode tok/s")
    axes[0].legend()
    fig.suptitle(f"moestream decode, Qwen3.6-35B-A3B shape, random bf16, {d.get('gpu', '')} {d.get('date', '')}")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""benchmarks/vs_llama.py's bookkeeping (no engine, no llama.cpp): the grid of configurations from llama.cpp's
measured VRAM, and the report table built from results files like the ones the GPU run writes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import vs_llama  # noqa: E402


def test_grid_uses_measured_vram_and_skips_unmeasured_levels():
    cfgs = vs_llama.parse_grid("fused@all;offload,auto@n15,n29;cpu@7.5", {15: 23.9, 0: 35.1})
    by = {c["name"]: c for c in cfgs}
    assert list(by) == ["fused@all", "offload@n15", "offload@n29", "auto@n15", "auto@n29", "cpu@7.5"]
    assert by["fused@all"]["cap_gb"] is None and by["fused@all"]["ncmoe"] == 0
    assert by["offload@n15"]["cap_gb"] == 23.9 and by["offload@n15"]["ncmoe"] == 15
    assert "skip" in by["auto@n29"]
    assert by["cpu@7.5"]["cap_gb"] == 7.5 and by["cpu@7.5"]["ncmoe"] is None


def test_grid_variants_set_their_environment():
    cfgs = vs_llama.parse_grid("hybrid+hold+t15@n29;hybrid+nohold@n29;fused+sdown@all", {29: 11.68})
    by = {c["name"]: c for c in cfgs}
    assert by["hybrid+hold+t15@n29"]["set_env"] == {"MOESTREAM_BRIDGE_POOL": "all"}
    assert by["hybrid+hold+t15@n29"]["threads"] == 15
    assert by["hybrid+nohold@n29"]["set_env"] == {"MOESTREAM_BRIDGE_POOL": "0"}
    assert by["fused+sdown@all"]["env"] == {"MOESTREAM_SHARED_DOWN": "1"}
    assert vs_llama.parse_grid("fused+q8w@all", {})[0]["env"] == {"MOESTREAM_Q8_WORDS": "1"}
    assert vs_llama.parse_grid("fused+gdnprep@all", {})[0]["set_env"] == {"MOESTREAM_GDN_PREP": "1"}
    assert vs_llama.parse_grid("fused+gdnprep+gdnfront@all", {})[0]["set_env"] == {"MOESTREAM_GDN_PREP": "1",
                                                                                   "MOESTREAM_GDN_FRONT": "1"}
    assert vs_llama.parse_grid("fused+nogdnprep@all", {})[0]["set_env"] == {"MOESTREAM_GDN_PREP": "0"}
    assert vs_llama.parse_grid("hybrid+pool+spin2000@4", {})[0]["set_env"] == {"MOESTREAM_CPU_POOL": "pool",
                                                                              "MOESTREAM_CPU_SPIN_US": "2000"}
    assert vs_llama.parse_grid("hybrid+tail4+kb64@4", {})[0]["set_env"] == {"MOESTREAM_CPU_LAYER_TUNING": "tail=4,kb=64"}
    assert vs_llama.parse_grid("hybrid+omprel+t15@4", {})[0]["set_env"] == {"MOESTREAM_OMP_RELEASE": "1"}
    assert {"MOESTREAM_GDN_PREP", "MOESTREAM_GDN_FRONT", "MOESTREAM_CPU_SPIN_US",
            "MOESTREAM_OMP_RELEASE"} <= set(vs_llama.SET_ENV_KEYS)  # reset


def test_llama_buffer_sizes_are_summed():
    text = ("load_tensors:        CUDA0 model buffer size = 12000.50 MiB\nload_tensors:   CPU_Mapped model buffer size "
            "=  9000.00 MiB\nllama_kv_cache:      CUDA0 KV buffer size =    20.00 MiB\n"
            "llama_context:      CUDA0 compute buffer size =   500.25 MiB\n")
    assert vs_llama.buffers(text) == {"CUDA0 model": 12000.5, "CPU_Mapped model": 9000.0, "CUDA0 KV": 20.0,
                                      "CUDA0 compute": 500.25}


def test_report_rows_and_table(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    llama = {"quant": "q8_0", "runs": {
        "0": {"ncmoe": 0, "tg64": 220.9, "pp512": 6175, "vram_used_mib": 36000, "batched_pl4_tg_tok_s": 600.0},
        "15": {"ncmoe": 15, "tg64": 76.4, "pp512": 322, "vram_used_mib": 24500}}}
    run = lambda b, n, cap, tg, **kw: {"name": f"{b}@n{n}", "backend": b, "ncmoe": n, "cap_gb": cap, "tg_tok_s": tg,  # noqa: E731
                                       "bs4_tok_s": 2 * tg, "pp_tok_s": 100.0, "pp_tokens": 512, "tg_tokens": 63,
                                       "bs4_tokens": 252, "load_s": 16.0, "hit_rate": 0.6, "pcie_mb_per_token": 800.0,
                                       "plan": {"backend": kw.get("chose", b), "reason": "r", "cache_slots": 10,
                                                "total_experts": 10240}}
    moe = {"quant": "q8_0", "runs": {
        "fused@all": {**run("fused", 0, None, 3.1), "name": "fused@all"},
        "offload@n15": {**run("offload", 15, 23.93, 2.6),
                        "cuda_graphs": {"enabled": False, "capture_error": "AcceleratorError: capture invalidated"}},
        "auto@n15": {**run("auto", 15, 23.93, 2.7, chose="offload"), "cuda_graphs": {"capture_error": None}},
        "hybrid@n15": {"name": "hybrid@n15", "backend": "hybrid", "ncmoe": 15, "cap_gb": 23.93, "error": "boom"}}}
    (work / "llama_q8_0.json").write_text(json.dumps(llama))
    (work / "moe_q8_0.json").write_text(json.dumps(moe))
    (work / "file_q8_0.json").write_text(json.dumps({"quant": "q8_0", "bytes": 36.5e9}))
    rep = vs_llama.merged(work, None)
    rows = {r["ncmoe"]: r for r in vs_llama.rows(rep, "q8_0")}
    assert rows[0]["best"] == "fused" and abs(rows[0]["ratio"] - 3.1 / 220.9) < 1e-9
    assert rows[15]["best"] == "auto" and rows[15]["cap_gb"] == 23.93
    md = vs_llama.markdown(rep)
    assert "| 15 | 23.93 | 76.4 / 322 / – | – | 2.6 / 5.2 / 100 | error | – | 2.7 / 5.4 / 100 (offload) | auto | 0.04 |" in md
    assert "| 0 | 35.16 | 220.9 / 6175 / 600.0 | 3.1 / 6.2 / 100 |" in md
    # a run whose decode fell back to eager (a failed CUDA graph capture) says so in its line; the others do not
    lines = {ln.split(":")[0]: ln for ln in md.splitlines() if ln.startswith("- ")}
    assert "CUDA graphs off: AcceleratorError: capture invalidated" in lines["- offload@n15"]
    assert "CUDA graphs off" not in lines["- auto@n15"]
    # a later call's results merge over an earlier report
    old = dict(rep)
    (work / "llama_q8_0.json").unlink()
    rep2 = vs_llama.merged(work, json.loads(json.dumps(old)))
    assert rep2["llama"]["q8_0"]["runs"]["15"]["tg64"] == 76.4

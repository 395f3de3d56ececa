"""All expert placement, caching, movement and compute (see docs/architecture.md and moe/README.md).

formats   which arrays one expert has in a format, shapes, bytes; swiglu: the experts' SwiGLU and its oracle
store     master copies: host banks (pinned up to a budget) or the device
residency which (layer, expert) sits in which slot; one cache, victims by policy; hits, misses, evictions
trace     routing traces: file format, recorder (--record-routing), forcer (benchmarks under locality)
replay    a trace through the cache policies (`moestream bench cache`); synth: synthetic traces (`bench trace`)
transfer  slot pools, copy stream + events, prefill double buffer
compute   (x, route, weights) -> y on the device (grouped) and on CPU threads over host banks
runtime   ExpertRuntime: a cache (caches) + a decode and a prefill strategy (strategies), composed per
          backend (fused, offload, cpu, hybrid) by the one factory in backends
planner   pure: model sizes + hardware + budget (+ bandwidths) -> frozen MoePlan
bench     `moestream bench bw`: the bandwidths the planner weighs
"""
from .runtime import BACKENDS, ExpertRuntime, RuntimeOptions, build_runtime
from .store import ExpertStore
from . import backends  # noqa: F401,E402  (fills BACKENDS)

__all__ = ["ExpertRuntime", "RuntimeOptions", "build_runtime", "BACKENDS", "ExpertStore"]

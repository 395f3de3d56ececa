"""Request accounting for /v1/stats and Prometheus /metrics (an own registry, so several apps can
live in one process, e.g. in tests)."""
from __future__ import annotations

import collections
import statistics

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self, model_name: str, window: int = 1000):
        self.registry = r = CollectorRegistry()
        lbl = ["model"]
        self.model = model_name
        self.requests = Counter("moestream_requests", "Finished requests by outcome", lbl + ["outcome"], registry=r)
        self.prompt_tokens = Counter("moestream_prompt_tokens", "Prompt tokens of served requests", lbl, registry=r)
        self.gen_tokens = Counter("moestream_generation_tokens", "Generated tokens", lbl, registry=r)
        self.ttft = Histogram("moestream_time_to_first_token_seconds", "Time to first token", lbl,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("moestream_e2e_request_latency_seconds", "Request latency", lbl,
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("moestream_num_requests_running", "Requests in the running batch", lbl, registry=r)
        self.queued = Gauge("moestream_num_requests_waiting", "Requests waiting for admission", lbl, registry=r)
        self.kv_usage = Gauge("moestream_kv_cache_usage_ratio", "Fraction of KV pages in use", lbl, registry=r)
        self.state_usage = Gauge("moestream_state_slot_usage_ratio", "Fraction of linear-state slots in use",
                                 lbl, registry=r)
        self.decode_tps = Gauge("moestream_gen_throughput_tokens_per_second", "Decode tokens/s (5 s window)",
                                lbl, registry=r)
        self.hit_rate = Gauge("moestream_expert_hit_rate", "Expert cache hit rate", lbl, registry=r)
        self.prefix = {k: Gauge(f"moestream_prefix_cache_{k}", doc, lbl, registry=r) for k, doc in (
            ("hit_rate", "Prompt tokens served from the prefix cache / prompt tokens"),
            ("cached_tokens", "Prompt tokens served from the prefix cache (total)"),
            ("saved_prefill_tokens", "Prefill tokens not computed thanks to the prefix cache, re-admissions included"),
            ("pages", "KV pages held by the prefix cache"),
            ("snapshots", "Linear-state snapshots held by the prefix cache"),
            ("host_pages", "KV pages held in the prefix cache's host tier"),
            ("host_spill_bytes", "Bytes of pages and snapshots moved to the prefix cache's host tier (total)"),
            ("host_fetch_bytes", "Bytes of pages and snapshots fetched back from the host tier (total)"))}
        # speculative decoding (--speculative mtp): the engine's running totals, as gauges of its snapshot
        self.spec = {k: Gauge(f"moestream_spec_decode_{k}", doc, lbl, registry=r) for k, doc in (
            ("drafted_tokens", "Draft tokens proposed by the MTP block (total)"),
            ("accepted_tokens", "Draft tokens the main model accepted (total)"),
            ("verify_steps", "Requests' verify steps (one per decoding request and step with drafts, total)"),
            ("acceptance_rate", "Accepted / drafted tokens"))}
        self.spec_pos = {k: Gauge(f"moestream_spec_decode_{k}_per_position", doc, lbl + ["position"], registry=r)
                         for k, doc in (("drafted_tokens", "Drafts proposed at draft position (0: the first)"),
                                        ("accepted_tokens", "Drafts accepted at draft position"),
                                        ("acceptance_rate", "Accepted / drafted at draft position"))}
        # sizes a live cache rebuild changes, host memory
        self.kv_tokens = Gauge("moestream_kv_cache_tokens", "KV pool size in tokens", lbl, registry=r)
        self.expert_slots = Gauge("moestream_expert_cache_slots", "Expert slots of the device cache", lbl, registry=r)
        self.rebuilds = Gauge("moestream_cache_rebuilds", "Live cache rebuilds done", lbl, registry=r)
        self.host_rss = Gauge("moestream_host_rss_bytes", "Resident host memory of the engine process", lbl,
                              registry=r)
        self.graph_replays = Gauge("moestream_cuda_graph_replays", "Decode steps replayed as CUDA graphs", lbl,
                                   registry=r)
        self.graphs_failed = Gauge("moestream_cuda_graph_capture_failed",
                                   "1 when a CUDA graph capture failed and decode runs eagerly", lbl, registry=r)
        # Recent requests, for TTFT mean/p95 in /v1/stats.
        self.recent_ttft: collections.deque = collections.deque(maxlen=window)
        self.recent_latency: collections.deque = collections.deque(maxlen=window)
        self.totals = collections.Counter()

    def record(self, prompt_tokens: int, completion_tokens: int, ttft: float | None, latency: float,
               outcome: str) -> None:
        m = self.model
        self.requests.labels(m, outcome).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.gen_tokens.labels(m).inc(completion_tokens)
        self.latency.labels(m).observe(latency)
        self.recent_latency.append(latency)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
            self.recent_ttft.append(ttft)
        self.totals.update(requests=1, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        self.totals[outcome] += 1

    def summary(self) -> dict:
        return {"completed": self.totals["requests"], "prompt_tokens_total": self.totals["prompt_tokens"],
                "completion_tokens_total": self.totals["completion_tokens"],
                "outcomes": {k: v for k, v in self.totals.items()
                             if k not in ("requests", "prompt_tokens", "completion_tokens")},
                "ttft_mean_ms": _ms(statistics.fmean(self.recent_ttft)) if self.recent_ttft else None,
                "ttft_p95_ms": _ms(_p95(self.recent_ttft)), "latency_p95_ms": _ms(_p95(self.recent_latency))}

    def update_engine(self, stats: dict) -> None:
        m = self.model
        self.running.labels(m).set(stats.get("running", 0))
        self.queued.labels(m).set(stats.get("queued", 0))
        self.kv_usage.labels(m).set(stats.get("kv", {}).get("usage", 0.0))
        self.state_usage.labels(m).set(stats.get("state", {}).get("usage", 0.0))
        self.decode_tps.labels(m).set(stats.get("throughput", {}).get("decode_tps", 0.0))
        if stats.get("experts_hit_rate") is not None:
            self.hit_rate.labels(m).set(stats["experts_hit_rate"])
        kv = stats.get("kv") or {}
        self.kv_tokens.labels(m).set(kv.get("total_pages", 0) * kv.get("page_size", 0))
        self.expert_slots.labels(m).set((stats.get("memory_plan") or {}).get("cache_slots", 0))
        self.rebuilds.labels(m).set((stats.get("cache_rebuilds") or {}).get("count", 0))
        self.host_rss.labels(m).set(((stats.get("host_memory") or {}).get("now") or {}).get("rss", 0))
        graphs = stats.get("cuda_graphs") or {}
        self.graph_replays.labels(m).set(graphs.get("replays", 0))
        self.graphs_failed.labels(m).set(1 if graphs.get("capture_error") else 0)
        for k, g in self.prefix.items():
            if isinstance(stats.get("prefix_cache"), dict) and k in stats["prefix_cache"]:
                g.labels(m).set(stats["prefix_cache"][k])

        spec = stats.get("speculative")
        if isinstance(spec, dict):
            for k, src in (("drafted_tokens", "drafted"), ("accepted_tokens", "accepted"),
                           ("verify_steps", "verify_steps"), ("acceptance_rate", "acceptance_rate")):
                self.spec[k].labels(m).set(spec.get(src, 0))
            for k, src in (("drafted_tokens", "drafted_per_position"), ("accepted_tokens", "accepted_per_position"),
                           ("acceptance_rate", "acceptance_rate_per_position")):
                for i, v in enumerate(spec.get(src) or []):
                    self.spec_pos[k].labels(m, str(i)).set(v)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _p95(values) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))]


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 3)

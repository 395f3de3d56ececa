"""`moestream ctl`: a running server's admin routes from the terminal (standard library HTTP, as `moestream
chat --server`).

    ctl cache --kv N --moe M|auto   POST /v1/admin/cache: resize the KV pool and the expert slot cache live
    ctl stats                       GET /v1/stats: the live figures, one topic a line
"""
from __future__ import annotations

import json

from .chat import open_url

GiB = 1 << 30


def call(server: str, path: str, api_key: str | None, body: dict | None = None, timeout: float = 660.0) -> dict:
    """The route's JSON answer; ServerError (one line: URL, status and the server's message) otherwise."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with open_url(server.rstrip("/").removesuffix("/v1") + path, headers, body, timeout) as r:
        return json.load(r)


def rebuild_cache(server: str, api_key: str | None, kv_tokens: int | None, moe_slots: int | str | None) -> dict:
    body = {k: v for k, v in (("kv_tokens", kv_tokens), ("moe_slots", moe_slots)) if v is not None}
    return call(server, "/v1/admin/cache", api_key, body)


def format_rebuild(r: dict) -> str:
    kv, moe = r["kv_tokens"], r["moe_slots"]
    head = (f"cache rebuilt in {r['rebuild_s']:.3f} s: KV {kv['before']} -> {kv['after']} tokens, expert slots "
            f"{moe['before']} -> {moe['after']} of {r['total_experts']}; {r['running']} requests in flight "
            f"({r['moved_pages']} KV pages moved), {r['queued']} queued, {r['evicted_prefix_pages']} prefix-cache "
            "pages evicted")
    return head + ("\n" + r["plan_text"] if r.get("plan_text") else "")


def format_stats(s: dict) -> str:
    """The /v1/stats body as short lines (what is missing from it is left out)."""
    g = (lambda n: f"{(n or 0) / GiB:.2f} GiB")
    lines = [f"{s.get('model')}: engine {'alive' if s.get('engine_alive') else 'NOT RUNNING'}, "
             f"up {s.get('uptime_s', 0):.0f} s"]
    tp = s.get("throughput") or {}
    lines.append(f"requests: {s.get('running', 0)} running, {s.get('queued', 0)} queued; prefill "
                 f"{tp.get('prefill_tps', 0):.1f} tok/s, decode {tp.get('decode_tps', 0):.1f} tok/s")
    if kv := s.get("kv"):
        P = kv.get("page_size", 0)
        lines.append(f"KV cache: {kv['total_pages'] * P} tokens ({kv['total_pages']} pages of {P}), "
                     f"{kv['used_pages'] * P} in use ({100 * kv.get('usage', 0):.1f}%)")
    if (st := s.get("state")) and st.get("total_slots"):
        lines.append(f"linear-state slots: {st['used_slots']} of {st['total_slots']} in use")
    if plan := s.get("memory_plan"):
        total = plan.get("total_experts") or 0
        slots = plan.get("cache_slots", 0)
        hit = s.get("experts_hit_rate")
        resident = "every expert resident" if plan.get("backend") == "fused" else \
            f"{slots} of {total} expert slots ({100 * slots / total if total else 0:.1f}%)"
        lines.append(f"experts: backend {plan.get('backend')}, {resident}"
                     + (f", hit rate {hit:.2f}" if isinstance(hit, (int, float)) else ""))
        b = plan.get("bytes") or {}
        lines.append(f"memory plan: {plan.get('device')} budget {g(b.get('budget'))}: dense {g(b.get('dense'))} + "
                     f"experts {g(b.get('experts_device'))} + prefill {g(b.get('prefill_buffer'))} + "
                     f"KV {g(b.get('kv'))} ({plan.get('kv_tokens')} tokens) + state {g(b.get('state'))} + "
                     f"workspace {g(b.get('workspace'))}")
    if host := s.get("host_memory"):
        load, now = host.get("at_load") or {}, host.get("now") or {}
        lines.append(f"host memory: RSS {g(now.get('rss'))} now, {g(load.get('rss'))} at load (peak "
                     f"{g(load.get('peak_rss'))}); expert banks {g(load.get('bank_bytes'))}, "
                     f"{g(load.get('mapped_bank_bytes'))} of them mapped from the checkpoint")
    if (rb := s.get("cache_rebuilds")) and (rb.get("count") or rb.get("refused")):
        last = rb.get("last")
        tail = (f"; last in {last['rebuild_s']:.3f} s to KV {last['kv_tokens']['after']} tokens, "
                f"{last['moe_slots']['after']} expert slots") if last else ""
        lines.append(f"cache rebuilds: {rb.get('count', 0)} done, {rb.get('refused', 0)} refused{tail}")
    if pc := s.get("prefix_cache"):
        lines.append(f"prefix cache: {pc.get('pages', 0)} pages, {pc.get('snapshots', 0)} snapshots, hit rate "
                     f"{pc.get('hit_rate', 0):.2f}")
    return "\n".join(lines)

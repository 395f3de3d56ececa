"""The `--moe-backend` names as compositions of parts, and the one factory that builds them.

A runtime (moe/runtime.py) is a cache (moe/caches.py `CACHES`), a decode and a prefill strategy
(moe/strategies.py `DECODERS`, `PREFILLS`) and, for the grouped path, where the CPU computes (`PLACES`):

    backend  cache and decode                                     prefill              CPU computes
    fused    none + pairs if pairs_wanted, else none + grouped    resident (no host    nothing
                                                                  sync on the pairs
                                                                  path)
    offload  device + pairs if device_cache_wanted,               streamed with a      nothing
             else host + grouped                                  prefill buffer,
                                                                  else resident
    cpu      host (the plan gives it no slots) + bridge if        streamed / resident  every expert
             bridge_wanted, else host + grouped
    hybrid   device + bridge if device_cache_wanted and           streamed / resident  the misses, by the
             bridge_wanted, else host + grouped                                        fetch share

fused    every expert resident on the compute device (store banks live there)
offload  slot cache (one cache over all layers, victims by --moe-cache-policy; the device cache of the pair
         path: LRU); misses copied from host banks; grouped decode prefetches layer l+1's predicted experts
cpu      routed experts computed by CPU threads from host banks; on a GPU, prefill chunks still stream
         through the device double buffer (a prefill chunk is compute-bound)
hybrid   hits on the device; misses split between PCIe fetch and CPU compute in proportion to the
         measured bandwidths; every routed expert computed exactly once
"""
from __future__ import annotations

from dataclasses import dataclass

from .caches import BankExperts, DeviceSlots, HostSlots
from .compute import CpuExperts
from .pairs import triton_ready
from .qpairs import supports as qpair_supports
from .runtime import Context, ExpertRuntime, Lookahead, register
from .stats import StatsBook
from .strategies import DECODERS, PREFILLS, HostCompute
from .transfer import Copier, Sync


@dataclass(frozen=True)
class Composition:
    """What a backend is made of (module doc)."""

    cache: str  # none | host | device
    decode: str  # pairs | grouped | bridge
    prefill: str  # resident | streamed
    cpu: str  # none | all | misses: which routed experts CPU threads compute


CACHES = {  # Composition.cache -> builder(ctx, composition)
    "none": lambda ctx, comp: BankExperts(ctx, on_device=comp.decode == "pairs"),
    "host": lambda ctx, comp: HostSlots(ctx),
    "device": lambda ctx, comp: DeviceSlots(ctx),
}


# ---- the decision rules -------------------------------------------------------------------------
def pairs_wanted(options, store, device) -> bool:
    """Use the pair kernels for decode? auto: on CUDA with Triton, for dense experts and every compressed
    format with a quantized pair kernel (moe/qpairs.py); pairs: also on CPU (the torch references, for
    tests); grouped: never."""
    if options.decode_kernel == "grouped":
        return False
    if store.fmt.quantized and device.type == "cuda" and not all(
            qpair_supports(store.fmt.for_layer(layer)) for layer in store.moe_layers):
        return False  # a format with no Triton pair kernel keeps the grouped path on CUDA
    if device.type == "cuda":
        return triton_ready(device)
    return options.decode_kernel == "pairs"


def device_cache_wanted(options, store, device) -> bool:
    """The slot cache in device tensors (moe/device_cache.py) where the pair kernels run, every host bank is
    pinned (the staging kernel reads them through their unified address), prefill has its buffer (it must not
    go through the decode path) and there are slots; it is an LRU: other policies keep the host cache."""
    pinned = device.type != "cuda" or all(t.is_pinned() for per in store.banks.values() for t in per.values())
    return (pairs_wanted(options, store, device) and pinned and options.prefill_slots > 0
            and options.cache_slots > 0 and options.cache_policy == "lru")


def bridge_wanted(options, store, device) -> bool:
    """CPU pairs through the bridge: wherever the pair kernels run (CUDA + Triton, dense or compressed
    experts; or forced on CPU for tests) and the plan says how many pairs a decode layer call may have."""
    return pairs_wanted(options, store, device) and options.max_pairs > 0


def _prefill(options) -> str:
    """Through the double buffer when the plan gave it rows; else where the experts are (the decode path)."""
    return "streamed" if options.prefill_slots > 0 else "resident"


@register("fused")
def fused(options, store, device) -> Composition:
    """Every expert in the device banks; the pair kernels decode where they run."""
    decode = "pairs" if pairs_wanted(options, store, device) else "grouped"
    return Composition(cache="none", decode=decode, prefill="resident", cpu="none")


@register("offload")
def offload(options, store, device) -> Composition:
    """A slot cache: in device tensors with the pair kernels where they apply, else the host's."""
    on_device = device_cache_wanted(options, store, device)
    return Composition(cache="device" if on_device else "host", decode="pairs" if on_device else "grouped",
                       prefill=_prefill(options), cpu="none")


@register("cpu")
def cpu(options, store, device) -> Composition:
    """Every routed expert on CPU threads: through the bridge where the pair path runs."""
    decode = "bridge" if bridge_wanted(options, store, device) else "grouped"
    return Composition(cache="host", decode=decode, prefill=_prefill(options), cpu="all")


@register("hybrid")
def hybrid(options, store, device) -> Composition:
    """Hits on the device, misses split between PCIe and the CPU: the bridge over the device cache, or the
    grouped path over the host cache."""
    on_device = device_cache_wanted(options, store, device) and bridge_wanted(options, store, device)
    return Composition(cache="device" if on_device else "host", decode="bridge" if on_device else "grouped",
                       prefill=_prefill(options), cpu="misses")


def q8_planar_wanted(comp: Composition, device, mapped_bytes: int = 0) -> bool:
    """Q8_0 experts row-planar (ExpertStore.set_q8_layout) where only the GPU's Triton kernels read the store, as
    env.q8_planar asks: "all" (the default) fused and offload's slot cache, "1" fused only (every expert resident),
    on CUDA with Triton; never where CPU threads compute experts (their kernels read Q8_0). Timed on an H100 against
    the file's layout in one run (benchmarks/RESULTS.md, thirty-sixth session): fused +9 % at batch 1, +20 % at
    batch 4, pp512 +8-18 %; offload +2-7 % at the caps (its fetch-in-pair kernels' row copy: qpairs._fetch_cw).
    A slot cache over host banks still mapped from the file (`mapped_bytes`: the layers beyond the pin budget) keeps the
    file's layout: converting would copy those pages into anonymous memory the host may not have."""
    from ..env import q8_planar

    mode = q8_planar()
    return mode != "0" and (comp.cache == "none" or (mode == "all" and not mapped_bytes)) and comp.cpu == "none" \
        and device.type == "cuda" and triton_ready(device)


# ---- the factory --------------------------------------------------------------------------------
def build(name: str, comp: Composition, store, device, options) -> ExpertRuntime:
    """The parts of `comp` over one Context, in the order they depend on each other: the copier (any device
    pool), the CPU threads (before the bridge's worker, as torch's thread count is process-wide), the
    cache, the decode strategy, the prefill strategy (which may be the decode one)."""
    store.set_q8_layout(q8_planar_wanted(comp, device, store.mapped_bytes))
    book = StatsBook(store.moe_layers)
    ctx = Context(store, device, options, book, Lookahead(store.moe_layers))
    if comp.cache != "none":
        ctx.copier = Copier(store, Sync(device), book)
    cpu_experts = CpuExperts(options.cpu_threads) if comp.cpu != "none" else None
    cache = CACHES[comp.cache](ctx, comp)
    host = HostCompute(ctx, cache, cpu_experts) if cpu_experts is not None else None
    decode = DECODERS[comp.decode](ctx, comp, cache, host)
    prefill = PREFILLS[comp.prefill](ctx, comp, cache, host, decode)
    return ExpertRuntime(name, ctx, cache, decode, prefill, cpu_experts, comp)

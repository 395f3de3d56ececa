"""All expert placement, caching, movement and compute (see docs/architecture.md).

formats  - which arrays one expert has in a format, shapes, bytes
store    - where the master copy of every routed expert lives (host banks or the device)
compute  - (x, route, weights) -> y, the torch reference every backend agrees with
runtime  - the one interface the model calls, a registry of placement policies
"""
from .runtime import ExpertRuntime, build_runtime, RUNTIMES
from .store import ExpertStore

__all__ = ["ExpertRuntime", "build_runtime", "RUNTIMES", "ExpertStore"]

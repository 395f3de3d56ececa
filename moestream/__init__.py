"""moestream: serve big Mixture-of-Experts LLMs on the hardware people already own."""
from .core import RequestOutput, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]


def __getattr__(name):
    # LLM imports torch; keep `import moestream` (and `moestream --help`) light.
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(name)

"""Offline API in the shape users know from vLLM.

    from moestream import LLM, SamplingParams
    llm = LLM("Qwen/Qwen3-30B-A3B", moe_backend="offload", moe_cache_size=2048)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(out[0].text)

`generate` queues its requests on the step loop (`engine/llm_engine.LLMEngine`, the one the server's engine
process and `moestream chat` drive too) and steps it until they finish.

With tp_size=N the engine runs as N processes in lockstep (moestream.parallel): this process is rank 0
(scheduler, sampling) and the other ranks are spawned; `close()` (or the end of this process) stops them.
"""
from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import Any, Sequence

from .config import EngineConfig, ModelConfig
from .core import ConfigError, RequestError, RequestOutput, SamplingParams, next_request_id
from .engine.engine import Engine
from .engine.llm_engine import LLMEngine
from .models.checkpoint import open_checkpoint, resolve_model_path
from .scheduler.request import Request

log = logging.getLogger("moestream")

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model_path: str | Path | dict | None, device: str = "auto", dtype: str = "auto",
                 tp_workers=None, **engine_options: Any):
        """tp_workers: a running moestream.parallel.TPWorkers to build on (several engines one after
        another on the same ranks, e.g. a backend sweep); by default tp_size > 1 starts its own."""
        self.engine_config = EngineConfig.from_options(device=device, dtype=dtype, **engine_options)
        if isinstance(model_path, dict):
            # An HF config dict: the model is built with random weights in memory (benchmarks), no tokenizer.
            self.model_dir = None
            self.model_config = ModelConfig.from_hf(model_path)
            self.tokenizer = None
        else:
            self.model_dir = resolve_model_path(model_path, self.engine_config.revision)
            checkpoint = open_checkpoint(self.model_dir)
            self.model_config = checkpoint.model_config()
            self.tokenizer = checkpoint.tokenizer()
        self._tp, self._owns_tp = None, False
        if self.engine_config.tp_size > 1:
            self.engine = self._start_tp(tp_workers)
        elif tp_workers is not None:
            raise ConfigError("tp_workers needs tp_size > 1")
        else:
            self.engine = Engine(self.model_dir, self.model_config, self.engine_config)
        eos = list(self.tokenizer.eos_token_ids) if self.tokenizer else []
        eos += [e for e in self.model_config.eos_token_ids if e not in eos]
        self.llm_engine = LLMEngine(self.engine, self.tokenizer, eos)
        self.last_timing: dict = {}
        _freeze_live_objects()

    @property
    def scheduler(self):
        """The step loop's scheduler (its queues, pages and prefix cache)."""
        return self.llm_engine.scheduler

    # ---- generation ------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params = _as_params(sampling_params, len(prompt_list))
        reqs = [Request(next_request_id(), self._encode(p), sp) for p, sp in zip(prompt_list, params)]
        for r in reqs:
            self.llm_engine.add_request(r)
        self._run(reqs)
        return [self._output(r) for r in reqs]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer, so chat() cannot apply a chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, tools=tools, add_generation_prompt=True, tokenize=True,
                                                      **(chat_template_kwargs or {})) for c in convs]
        return self.generate(prompts, sampling_params)

    def stats(self) -> dict:
        s = self.engine.runtime.stats()
        s["plan"] = self.engine.plan.as_dict()
        s["tp_size"] = self.engine_config.tp_size  # the expert figures are rank 0's (I / tp_size per expert)
        s["timing"] = dict(self.last_timing)
        s["host_memory"] = dict(getattr(self.engine, "host_memory", {}))  # RSS at load beside the bank bytes
        graphs = getattr(self.engine, "graphs", None)
        s["cuda_graphs"] = graphs.as_dict() if graphs is not None else None  # None: not on (CPU, --cuda-graphs off)
        sched = self.llm_engine.stats()
        for key in ("prefix_cache", "speculative"):
            if sched.get(key) is not None:
                s[key] = sched[key]
        return s

    def close(self) -> None:
        """Release the engine; with tp_size > 1 the ranks this LLM started are stopped."""
        if self._tp is not None:
            self._tp.release()
            if self._owns_tp:
                self._tp.close()
            self._tp = None
        else:
            self.engine.runtime.close()
        gc.unfreeze()  # what this LLM froze can be collected once the caller drops it

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- helpers -----------------------------------------------------------------------------
    def _start_tp(self, workers):
        from .parallel import TPWorkers, validate_tp

        validate_tp(self.model_config, self.engine_config, self.model_dir)  # before any process starts
        self._owns_tp = workers is None
        self._tp = workers or TPWorkers(self.engine_config.tp_size, self.engine_config.device)
        try:
            return self._tp.build(self.model_dir, self.model_config, self.engine_config)
        except BaseException:
            if self._owns_tp:
                self._tp.close()
            self._tp = None
            raise

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _run(self, reqs: list[Request]) -> None:
        t0 = time.perf_counter()
        prefill_tokens = decode_tokens = 0
        prefill_s = decode_s = 0.0
        while any(r.finish_reason is None for r in reqs):
            self._raise_refused(self.llm_engine.step(), reqs)
            st = self.llm_engine.last_step
            if st.get("prefill_tokens"):
                prefill_tokens += st["prefill_tokens"]
                prefill_s += st["seconds"]
            else:
                decode_tokens += st.get("decode", 0)
                decode_s += st.get("seconds", 0.0)
        self.last_timing = {
            "wall_s": time.perf_counter() - t0,
            "prefill_tokens": prefill_tokens, "prefill_s": prefill_s,
            "prefill_tok_s": prefill_tokens / prefill_s if prefill_s else 0.0,
            "decode_tokens": decode_tokens, "decode_s": decode_s,
            "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
        }

    def _raise_refused(self, outputs, reqs: list[Request]) -> None:
        """A request of this call refused once it was ready to join the step loop (its grammar compiled in a
        worker thread, and llguidance could not use it): RequestError, as when add_request refuses it, and
        the call's other requests are ended."""
        ids = {r.id for r in reqs}
        bad = next((o for o in outputs if o.refused and o.request.id in ids), None)
        if bad is not None:
            for r in reqs:
                self.llm_engine.abort(r.id)
            raise RequestError(bad.error)

    def _output(self, r: Request) -> RequestOutput:
        if r.detok is not None:
            text = r.detok.text
        else:
            text = ""
        ttft = (r.first_token_at - r.arrival) if r.first_token_at else None
        return RequestOutput(r.id, list(r.prompt_ids), list(r.output_ids), text, r.finish_reason, ttft,
                             list(r.output_lps) if r.params.logprobs is not None else None,
                             list(r.prompt_lps) if r.params.prompt_logprobs is not None else None,
                             cached_tokens=r.cached_tokens or 0)


def _freeze_live_objects() -> None:
    """Move every object alive now (the model, its caches, the tokenizer: live for the engine's life) out of the
    cyclic collector's reach, so a full collection during a decode loop does not walk them (measured: 4-9% of a
    CPU decode step of a small model). What an earlier LLM froze is first given back to the collector, so
    engines made one after another (tests, backend sweeps) leave no frozen garbage behind them."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params(sp, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise RequestError(f"got {len(sp)} sampling params for {n} prompts")
    return sp

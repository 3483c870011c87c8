"""Engine: the Python API. Engine.open(path, budget=..., spec=...) -> generate() / stream() / logits() / stats;
prepare() checks a request once (generate/request.py) and returns what stream() / generate() run.

The engine's parts are built by assemble.py from an EngineConfig (config.py); this module is the facade over them:
lifecycle, requests, and per-request stats read from each part's snapshot().

Concurrent generate() calls on one engine are serialized by a lock (one KV cache and one weight store per
engine): they give the same outputs as sequential calls. A thread that starts a second request while it still
iterates a stream of the same engine gets EngineBusyError (it would otherwise wait on itself); close() from
that thread ends the suspended stream first.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from .assemble import SPEC_ROOM, EngineParts, assemble, close_parts
from .config import SPEC_ARGUMENTS, EngineConfig, spec_problem
from .errors import ConfigError, EngineBusyError, EngineClosedError, out_of_memory_as_error
from .generate.decoder import FinishEvent, GenerationState, TokenEvent, drive
from .generate.prompt_cache import PromptCache
from .generate.grammar import GrammarMatcher
from .generate.request import PreparedRequest, RequestError, check_context, check_prompt, check_runnable
from .generate.sampling import Sampler, SamplingParams, TokenLogprob
from .interrupts import finish_despite_interrupts, sigint_guarded
from .modes import SPEC_MODES
from .planner.placement import Placement
from .prefetch.prefetcher import Prefetcher
from .runtime.mtp import mtp_layer_count
from .runtime.cpu_load import sample_other_load
from .runtime.threads import ThreadTuner
from .speculative.chooser import SpecStats
from .speculative.drafters.factory import self_draft_refusal
from .speculative.stepper import make_stepper
from .store.store import TieredStore
from .tokenizer import TOKENIZER_FILES


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for (logprobs=k)


class Engine:
    def __init__(self, parts: EngineParts):
        """An engine over assembled parts (assemble.assemble); Engine.open assembles them."""
        self.checkpoint, self.model, self.tokenizer = parts.checkpoint, parts.model, parts.tokenizer
        self.store = parts.store
        self.device, self.dtype = parts.device, parts.dtype
        self.context = parts.context  # prompt + generated tokens one request may hold
        self.speculative = parts.speculative  # the default speculative decoding of requests
        self.draft = Engine(parts.draft) if parts.draft is not None else None
        self._lock = threading.Lock()
        self._owner: int | None = None  # thread id of the request holding the lock
        self._streams: weakref.WeakSet = weakref.WeakSet()
        self._closed = False
        self._token = object()  # the requests this engine prepared carry it (PreparedRequest.owner)
        self.threads: ThreadTuner | None = None  # the compute thread count (Engine.open sets it: config.threads)
        self.reuse_prefix = True  # reuse cached prefixes: the last sequence's, and saved ones (prompt_cache.py)
        # saved prefixes within the bytes the placement charged the host tier for them (--cache-ram)
        self._prefix = PromptCache(self.model, sum(t.prompt_cache_bytes for t in parts.store.placement.tiers))
        # an engine dropped without close() still joins its reader threads and closes its descriptors
        self._finalizer = weakref.finalize(self, close_parts, self.store, self.draft)

    # ---- lifecycle -------------------------------------------------------------------------------------
    @classmethod
    @sigint_guarded()  # a Ctrl-C while it loads never strands a lock the cleanup needs (interrupts.py)
    def open(cls, path: str | os.PathLike, config: EngineConfig | None = None, **keywords: Any) -> "Engine":
        """Open a Hugging Face folder within a memory budget: `config` (an EngineConfig: every option, its
        default and what it means), or its keyword form (EngineConfig.from_keywords: budget, device, dtype,
        max_context, policy, direct_io, prefetch, trace, allow_cast, progress, read_fn, stall_timeout, spec,
        spec_depth, spec_width, draft_model, draft_budget, host_compute, prefill_chunk, threads, cache_ram), e.g.
        Engine.open(path, budget=Budget(ram="25%"), spec="auto"). Planning (and its BudgetError) happens before
        any weight is read. The thread count (runtime/threads.py) is set once the placement is known."""
        if config is None:
            config = EngineConfig.from_keywords(**keywords)
        elif keywords:
            raise TypeError(f"Engine.open: pass an EngineConfig or keywords, not both (got {sorted(keywords)})")
        elif not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be an offload_engine.EngineConfig, got {type(config).__name__}")
        parts = assemble(path, config)
        try:
            engine = cls(parts)
            engine.threads = ThreadTuner.open(config.threads, parts.store.placement.streams, sample_other_load())
            return engine
        except BaseException:  # a Ctrl-C may land in __init__ too
            finish_despite_interrupts(parts.close)
            raise

    @property
    def placement(self) -> Placement:
        return self.store.placement

    @property
    def prompt_cache(self) -> PromptCache:
        """The cached prefixes requests reuse (snapshot(): entries, bytes, hits and reused tokens)."""
        return self._prefix

    def close(self) -> None:
        """Idempotent: joins the reader threads and frees every slot. Called from the thread that is iterating
        a stream of this engine, it ends that stream first."""
        if self._owner == threading.get_ident():
            for stream in list(self._streams):
                if stream.gi_frame is not None and not stream.gi_running:
                    stream.close()  # its `finally` releases the lock
        with sigint_guarded(), self._lock:
            if not self._closed:
                self._closed = True
                self._finalizer.detach()  # closed here, by a rerunnable call (the finalizer runs once)
                self._prefix.clear()
                finish_despite_interrupts(lambda: close_parts(self.store, self.draft))

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("engine is closed: open a new one with Engine.open(...)")

    @contextmanager
    def _request(self) -> Iterator[None]:
        """Hold the engine for one request; refuse (instead of deadlocking) a nested one from the same thread."""
        me = threading.get_ident()
        if self._owner == me:
            raise EngineBusyError("this thread is still iterating a stream() of this engine: finish or close() "
                                  "that stream first (an engine serves one request at a time; open a second "
                                  "engine for parallel requests)")
        with self._lock:
            self._check_open()
            self._owner = me
            try:
                yield
            finally:
                try:
                    self.store.end_request()
                finally:
                    self._owner = None

    # ---- inference -------------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(f"{self.checkpoint.root}: no tokenizer ({' or '.join(TOKENIZER_FILES)}); pass the "
                                  f"prompt as token ids")
            if chat:
                return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def prepare(self, prompt: str | Sequence[int], *, chat: bool = False, spec: str | None = None,
                spec_depth: int | None = None, spec_width: int | None = None, **sampling: Any) -> PreparedRequest:
        """Check a request once and return it ready to run: the sampling values (SamplingParams' fields:
        max_new_tokens, temperature, top_k, top_p, min_p, seed, stop, stop_token_ids, ignore_eos, penalties,
        logit_bias, logprobs, grammar), the prompt's ids, the speculation mode (spec / spec_depth / spec_width
        override the engine's defaults), the grammar and the context. A refusal is a ConfigError naming the
        argument; stream(request) and generate(request) then run it without checking it again."""
        self._check_open()
        params = SamplingParams(**sampling)
        params.check_vocab(self.model.vocab_size)
        ids = check_prompt(self.encode(prompt, chat), self.model.vocab_size)
        if spec is None:
            mode, depth, width = self.speculative.mode, self.speculative.depth, self.speculative.width
        else:
            problem = spec_problem(spec, spec_depth, spec_width, SPEC_ARGUMENTS)
            if problem is not None:
                name, message = problem
                raise RequestError(message, name, code=None if spec in SPEC_MODES else "unknown_mode")
            mode, depth, width = spec, spec_depth, spec_width
        constraint = []  # the grammar's state, built now: a grammar that does not compile is refused here
        if params.grammar is not None:
            constraint.append(GrammarMatcher(params.grammar, self.tokenizer, self.model.vocab_size))
        check_runnable(mode, bool(mtp_layer_count(self.checkpoint)), self.draft is not None,
                       self_draft_refusal(self.model) if mode == "self" else None)
        check_context(len(ids), params.max_new_tokens, self.context)
        return PreparedRequest(tuple(ids), params, mode, depth, width, owner=self._token, _constraint=constraint)

    def stream(self, prompt: str | Sequence[int] | PreparedRequest, **arguments: Any
               ) -> Iterator[TokenEvent | FinishEvent]:
        """Yield TokenEvents as tokens are accepted, then a FinishEvent. Holds the engine lock while iterating.
        `prompt` with prepare()'s keyword arguments (checked here, before the first next()), or a request
        prepare() returned (run as it is)."""
        stream = self._serve(self._prepared(prompt, arguments))
        self._streams.add(stream)
        return stream

    def _prepared(self, prompt: str | Sequence[int] | PreparedRequest, arguments: dict[str, Any]) -> PreparedRequest:
        if not isinstance(prompt, PreparedRequest):
            return self.prepare(prompt, **arguments)
        if arguments:
            raise TypeError(f"a PreparedRequest carries its arguments: pass it alone (got {sorted(arguments)})")
        if prompt.owner is not self._token:
            raise ConfigError("this request was prepared by another engine: prepare it with this one")
        self._check_open()
        return prompt

    def _serve(self, request: PreparedRequest) -> Iterator[TokenEvent | FinishEvent]:
        ids, params, mode, depth, width = list(request.ids), request.params, request.spec, request.spec_depth, \
            request.spec_width
        with self._request():
            if self.threads is not None:
                self.threads.enter()
            before = self.snapshot()
            # plain decoding reuses the longest cached prefix of the prompt; drafters keep their own state (a draft
            # model's cache, MTP layers), so a speculative request starts fresh
            reuse = mode == "off" and self.reuse_prefix
            lease = None
            if reuse:
                with sigint_guarded(), out_of_memory_as_error("request"):  # it may forward a shared prefix
                    lease = self._prefix.take(ids, len(ids) + params.max_new_tokens)
                cache, reused, start = lease.cache, lease.reused, lease.start
            else:
                self._prefix.set_aside(save=self.reuse_prefix)
                cache = self.model.new_cache(min(len(ids) + params.max_new_tokens + SPEC_ROOM, self.model.max_context))
                reused = start = 0
            spec_stats = SpecStats()
            draft = self.draft
            sampler = Sampler(params, constraint=request.constraint(self.tokenizer, self.model.vocab_size))
            # no tokenizers to compare: the draft model's vocabulary was checked against the target's at open
            stepper = make_stepper(self.model, cache, sampler, mode, depth=depth, width=width, draft=draft,
                                   store=self.store, stats=spec_stats)
            events = drive(stepper, ids[start:], GenerationState(params, self.tokenizer))
            decoding = None  # the store's counters when the prefill's token came out
            while True:
                # out of memory in the MTP / draft forwards too: only this request fails
                with sigint_guarded(), out_of_memory_as_error("request"):
                    start = time.perf_counter()
                    event = next(events, None)
                if decoding is not None and isinstance(event, TokenEvent) and self.threads is not None:
                    self.threads.observe(time.perf_counter() - start, 1)  # a decode step's time, per token
                if event is None:
                    break
                if isinstance(event, FinishEvent):
                    if lease is not None:  # a shared prefix forwarded on its own is part of the prefill
                        event.prefill_s += lease.prefill_s
                        event.prefill_tokens += start - reused
                    event.stats = {**self.stats(event, before, decoding), **_spec_summary(mode, spec_stats, event),
                                   "prompt_tokens": len(ids), "reused_prompt_tokens": reused,
                                   "prefilled_tokens": len(ids) - reused}
                    if params.grammar is not None:
                        event.stats["grammar"] = params.grammar.kind
                    if reuse:
                        self._prefix.give_back(cache, ids + event.token_ids)
                elif decoding is None:
                    decoding = self.snapshot()
                yield event

    def generate(self, prompt: str | Sequence[int] | PreparedRequest, **arguments: Any) -> Completion:
        """The whole answer: stream()'s arguments (a prompt and prepare()'s keywords, or a prepared request)."""
        finish = None
        for event in self.stream(prompt, **arguments):
            if isinstance(event, FinishEvent):
                finish = event
        assert finish is not None
        return Completion(finish.text, finish.token_ids, finish.reason, finish.stats, finish.logprobs)

    def chat(self, messages: Sequence[dict[str, Any]], **sampling: Any) -> Completion:
        """One assistant turn after `messages` (role/content dicts, rendered by the model's chat template). A
        conversation that resends its history reuses the cache of the previous turn (Completion.stats:
        reused_prompt_tokens)."""
        if self.tokenizer is None:
            raise ConfigError(f"{self.checkpoint.root}: no tokenizer ({' or '.join(TOKENIZER_FILES)}): chat needs one")
        return self.generate(self.tokenizer.encode_chat(list(messages)), **sampling)

    def session(self, system: str | None = None) -> "ChatSession":
        """A conversation: session.send(text) returns the assistant's Completion and keeps both turns."""
        return ChatSession(self, [{"role": "system", "content": system}] if system else [])

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits [len(token_ids), vocab] of a fresh sequence (scoring, perplexity, parity)."""
        self._check_open()
        ids = torch.tensor([int(t) for t in token_ids], dtype=torch.long)
        if ids.numel() == 0:
            raise ConfigError("logits(): token_ids is empty")
        with sigint_guarded(), self._request(), out_of_memory_as_error("logits"):
            if self.threads is not None:
                self.threads.enter()
            return self.model.forward(ids, self.model.new_cache(ids.numel())).float().cpu()

    # ---- stats -----------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The engine's counters now (the store's and the model's, cumulative since open) and its memory: byte
        budgets and peaks per tier (ledger accounts). Two snapshots' counters subtract to a span's (stats)."""
        threads = self.threads.snapshot()["tokens_by_threads"] if self.threads is not None else {}
        return {**_store_snapshot(self.store), **self.model.snapshot(), "tokens_by_threads": threads}

    @property
    def compute_tier(self) -> str:
        """The tier the model computes from ("device", or "host" on a CPU without --vram): snapshot()'s hits and
        misses of this tier are the hit rate."""
        return self.store.compute.name

    def stats(self, finish: FinishEvent, before: dict | None = None, decoding: dict | None = None
              ) -> dict[str, Any]:
        """Per-request figures (counters as deltas from `before`, a snapshot() taken at its start; `decoding`: one
        taken when the prefill's token came out, for the decode steps' own stall)."""
        n = len(finish.token_ids)
        now = self.snapshot()
        counters = _delta(now, before or {})
        decode_wait = _delta(now, decoding)["io_wait_s"] if decoding else counters["io_wait_s"]
        host = self.model.host_compute
        return {
            "prompt_tokens": finish.prefill_tokens,
            "generated_tokens": n,
            "prefill_s": round(finish.prefill_s, 6),
            "decode_s": round(finish.decode_s, 6),
            "prefill_tok_s": finish.prefill_tokens / finish.prefill_s if finish.prefill_s > 0 else 0.0,
            "decode_tok_s": finish.decode_tokens_per_s,
            **counters,
            "bytes_read_disk_per_token": counters["bytes_read_disk"] / max(n, 1),
            "stall_s_per_token": decode_wait / max(n - 1, 1),  # per decode step, the prefill's waits excluded
            # share of the readers' busy time the compute thread did not wait through (I/O hidden by compute)
            "io_overlap": (max(0.0, 1.0 - counters["io_wait_s"] / counters["read_busy_s"])
                           if counters["read_busy_s"] > 0 else 1.0),
            "hit_rate": _hit_rate(counters, self.compute_tier),
            "prefetch": _prefetch_stats(self.model.prefetcher, counters["expert_reads"]),
            "host_compute": ({**host.snapshot(),  # and what the computing took, per expert
                              "measured_expert_us": counters["host_compute_s"] / counters["host_computed"] * 1e6
                              if counters["host_computed"] else None}
                             if host else {"mode": "off"}),
            "budget_bytes": _tiers(now["budget_bytes"]),
            "peak_bytes": _tiers(now["peak_bytes"]),
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "kv_dtype": self.model.kv_dtype,
            "cpu_kernels": self.model.kernels.describe() if self.model.kernels is not None else None,
            **_thread_stats(self.threads, counters["tokens_by_threads"]),
        }


@dataclass
class ChatSession:
    """A multi-turn conversation over one engine; each turn prefills only what the previous one did not hold."""
    engine: Engine
    messages: list[dict[str, Any]]

    def send(self, text: str, **sampling: Any) -> Completion:
        self.messages.append({"role": "user", "content": text})
        try:
            answer = self.engine.chat(self.messages, **sampling)
        except BaseException:
            self.messages.pop()  # a failed turn leaves the conversation as it was
            raise
        self.messages.append({"role": "assistant", "content": answer.text})
        return answer


# what a snapshot holds that is a level, not a counter: left out of the deltas
GAUGES = ("budget_bytes", "peak_bytes", "reads_in_flight")


def _store_snapshot(store: TieredStore) -> dict[str, Any]:
    """The store's counters, and its ledger's budgets and peaks per tier."""
    return store.snapshot()


def _prefetch_snapshot(prefetcher: Prefetcher) -> dict[str, Any]:
    return prefetcher.snapshot()


def _spec_summary(mode: str, stats: SpecStats, finish: FinishEvent) -> dict[str, Any]:
    """What speculation did for one request (SpecStats.as_dict keys, at the top level of the stats); a plain
    request makes one target forward per token. tokens_per_forward counts the prefill forward too."""
    if mode == "off":
        stats = SpecStats(target_forwards=max(len(finish.token_ids), 1), steps=max(len(finish.token_ids) - 1, 0))
    forwards = stats.target_forwards
    return {"spec": mode, **stats.as_dict(),
            "tokens_per_forward": len(finish.token_ids) / forwards if forwards else 0.0}


def _prefetch_stats(prefetcher: Prefetcher | None, expert_reads: dict[str, int]) -> dict[str, Any]:
    """The prefetcher's snapshot, and recall_effective: the share of this request's expert reads that a prefetch
    made ahead of their use (the planner's prefetch recall, `plan --bench`)."""
    if prefetcher is None:
        return {"enabled": False, "recall_effective": 0.0}
    reads = expert_reads["ahead"] + expert_reads["demand"]
    return {**_prefetch_snapshot(prefetcher), "recall_effective": expert_reads["ahead"] / reads if reads else 0.0}


def _thread_stats(tuner: ThreadTuner | None, tokens: dict[str, int]) -> dict[str, Any]:
    """`threads`: the intra-op count this request's decode steps ran at (the one most of them did; the count now
    where none ran); `thread_choice`: the rule's setting, its most, decode tokens per count, switches and probes
    since open (runtime/threads.py)."""
    tokens = {k: v for k, v in tokens.items() if v}
    if tuner is None:
        return {"threads": torch.get_num_threads(), "thread_choice": {"setting": None, "tokens_by_threads": tokens}}
    ran = max(tokens, key=lambda k: tokens[k]) if tokens else None
    choice = tuner.snapshot()
    now = choice.pop("threads")
    return {"threads": int(ran) if ran is not None else now,
            "thread_choice": {**choice, "tokens_by_threads": tokens}}


def _hit_rate(store: dict, tier: str) -> float:
    """Share of unit acquisitions served by the compute tier without a read or copy."""
    looked = store["hits"][tier] + store["misses"][tier]
    return store["hits"][tier] / looked if looked else 1.0


def _tiers(values: dict[str, int | None]) -> dict[str, int | None]:
    """Ledger accounts -> {"device", "host"}; on CPU without --vram the one RAM tier is the host tier."""
    return {"device": values.get("device", 0), "host": values.get("host", 0)}


def _delta(now: dict, before: dict) -> dict:
    """Counters of `now` less those of `before` (nested dicts key by key); gauges left out."""
    out = {}
    for k, v in now.items():
        if k in GAUGES:
            continue
        b = before.get(k)
        if isinstance(v, dict):
            out[k] = {kk: vv - (b or {}).get(kk, 0) for kk, vv in v.items()}
        else:
            out[k] = v - (b or 0)
    return out

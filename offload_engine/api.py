"""Engine: the Python API. Engine.open(path, budget=..., spec=...) -> generate() / stream() / logits().

Concurrent generate() calls on one engine are serialized by a lock (one KV cache and one weight store per
engine): they give the same outputs as sequential calls. A thread that starts a second request while it still
iterates a stream of the same engine gets EngineBusyError (it would otherwise wait on itself); close() from
that thread ends the suspended stream first.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from .checkpoint.model import ModelCheckpoint, open_model
from .config import Budget, resolve_device, resolve_dtype
from .interrupts import finish_despite_interrupts, sigint_guarded
from .errors import ConfigError, EngineBusyError, EngineClosedError, PlanError, out_of_memory_as_error
from .checkpoint.naming import UnitKey
from .planner.costs import Machine
from .constants import DEFAULT_CONTEXT, PREFILL_CHUNK
from .planner.kv import kv_bytes
from .planner.placement import Placement
from .prefetch.predictor import Combined, FrequencyPrior, RouterLookahead
from .prefetch.prefetcher import PrefetchConfig, Prefetcher
from .runtime.host_compute import HostCompute, check_host_compute, measure_machine
from .runtime.kv_cache import ROLLBACK
from .runtime.model import CausalLM
from .runtime.mtp import attach_mtp_units, mtp_layer_count, mtp_supported
from .speculative.chooser import SpecStats
from .generate.decoder import FinishEvent, GenerationState, TokenEvent, check_prompt, drive
from .generate.sampling import Sampler, SamplingParams
from .speculative.stepper import MAX_DEPTH, MAX_WIDTH, check_spec, make_stepper
from .store.build import build_store, plan_for
from .store.policy import POLICIES
from .store.store import ReadFn, TieredStore
from .tokenizer import Tokenizer


# KV entries a draft tree may occupy beyond the committed tokens during one verification pass; reserved (and
# charged) in every engine so any request may speculate
SPEC_ROOM = MAX_DEPTH * MAX_WIDTH + 1


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)


class Engine:
    def __init__(self, checkpoint: ModelCheckpoint, model: CausalLM, tokenizer: Tokenizer | None,
                 store: TieredStore, device: torch.device, dtype: torch.dtype, *, context: int | None = None,
                 spec: str = "off", spec_depth: int | None = None, spec_width: int | None = None,
                 draft: "Engine | None" = None):
        self.checkpoint, self.model, self.tokenizer, self.store = checkpoint, model, tokenizer, store
        self.device, self.dtype = device, dtype
        self.context = context or model.max_context  # prompt + generated tokens one request may hold
        self.spec, self.spec_depth, self.spec_width = check_spec(spec, spec_depth, spec_width)
        self.draft = draft
        self._lock = threading.Lock()
        self._owner: int | None = None  # thread id of the request holding the lock
        self._streams: weakref.WeakSet = weakref.WeakSet()
        self._closed = False
        # an engine dropped without close() still joins its reader threads and closes its descriptors
        self._finalizer = weakref.finalize(self, _close_parts, store, draft)

    # ---- lifecycle -------------------------------------------------------------------------------------
    @classmethod
    @sigint_guarded()  # a Ctrl-C while it loads never strands a lock the cleanup needs (interrupts.py)
    def open(cls, path: str | os.PathLike, budget: Budget | None = None, device: str | torch.device | None = None,
             dtype: str | torch.dtype | None = None, *, max_context: int | None = None, policy: str = "lru-floor",
             direct_io: str = "auto", prefetch: PrefetchConfig | bool = True, trace: str | None = None,
             allow_cast: bool = False, progress: bool = False, read_fn: ReadFn | None = None,
             stall_timeout: float | None = None, spec: str = "off", spec_depth: int | None = None,
             spec_width: int | None = None, draft_model: str | os.PathLike | None = None,
             draft_budget: Budget | None = None, host_compute: str = "off",
             prefill_chunk: int = PREFILL_CHUNK) -> "Engine":
        """Open a Hugging Face folder within a memory budget. Planning (and its BudgetError) happens before any
        weight is read. `prefetch`: True (defaults), False, or a PrefetchConfig; `trace`: a routing trace to seed
        the frequency prior. `read_fn` replaces the disk read of one byte range (fault-injection tests).
        `stall_timeout`: seconds without any read making progress before a request fails with IOStallError
        (default 60, or OFFLOAD_ENGINE_STALL_TIMEOUT).

        spec: the default speculative mode of requests ("off", "auto", "ngram", "mtp", "draft", "self");
        "mtp" loads the checkpoint's MTP layers as `mtp` units, "auto" only where they cost little memory
        (_with_mtp_units); spec_depth / spec_width fix the draft
        shape (default: the cost model chooses each step). draft_model: a smaller checkpoint with the same
        tokenizer, opened as its own engine within `draft_budget`.

        host_compute: "off" (default), "on" or "auto": experts the host tier holds and the device tier does not
        are computed by the CPU where they lie instead of being copied (runtime/host_compute.py; not bit for bit
        the device's results on a GPU).

        prefill_chunk: prompt tokens per forward (a longer prompt runs in chunks against the KV cache). Its
        activations grow with it (`plan --prefill-chunk` sizes them); under offload a larger chunk reads each
        expert the prompt misses fewer times."""
        budget = budget or Budget()
        if not isinstance(budget, Budget):
            raise ConfigError(f"budget must be an offload_engine.Budget, got {type(budget).__name__}")
        spec, spec_depth, spec_width = check_spec(spec, spec_depth, spec_width)
        if spec == "draft" and draft_model is None:
            raise ConfigError("spec 'draft' needs a draft model: pass --draft-model DIR (API: draft_model=...)")
        dev = resolve_device(device)
        compute_dtype = resolve_dtype(dtype, dev)
        host_compute = check_host_compute(host_compute)
        if policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)} (--policy), got {policy!r}")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk (--prefill-chunk) must be a positive int, got {prefill_chunk!r}")
        checkpoint = open_model(path, allow_cast=allow_cast)
        # percentages are of the checkpoint's tensor bytes (what the folder holds), whichever units --spec loads
        resolved = budget.resolve(checkpoint.index.total_bytes)
        context = max_context or min(checkpoint.spec.max_position_embeddings, DEFAULT_CONTEXT)
        itemsize = torch.empty((), dtype=compute_dtype).element_size()

        def plan(ck: ModelCheckpoint) -> tuple[Placement, bool]:
            return plan_for(ck, resolved, dev, _kv_bytes(ck, itemsize, context), direct_io)

        placement, use_direct = plan(checkpoint)
        if spec in ("auto", "mtp"):
            checkpoint, placement, use_direct = _with_mtp_units(checkpoint, placement, use_direct, plan,
                                                                required=spec == "mtp")
        # the rates host_compute="auto" weighs, measured before the store allocates (the probes' buffers are
        # transient and outside the budget), and only where the host tier will cache experts apart from VRAM
        rates = (measure_machine(dev, compute_dtype)
                 if host_compute == "auto" and dev.type == "cuda" and placement.host_caches("expert") else None)
        store = build_store(checkpoint, placement, dev, compute_dtype, use_direct, policy, progress, read_fn,
                            stall_timeout=stall_timeout)
        draft = None
        try:
            model = CausalLM(checkpoint, store, dev, compute_dtype, max_context=context + SPEC_ROOM,
                             prefill_chunk=prefill_chunk)
            if spec == "mtp" and not mtp_supported(model):
                raise ConfigError(f"--spec mtp: {checkpoint.root} has no multi-token-prediction layers the engine "
                                  f"can run (config.json num_nextn_predict_layers, MTP tensors, architecture "
                                  f"{checkpoint.arch.name})")
            model.prefetcher = _prefetcher(model, store, prefetch, trace)
            model.host_compute = _host_compute(host_compute, rates, store)
            tokenizer = Tokenizer(checkpoint.root) if (Path(checkpoint.root) / "tokenizer.json").is_file() else None
            if draft_model is not None and spec in ("auto", "draft"):
                draft = _open_draft(draft_model, draft_budget, dev, compute_dtype, context, tokenizer,
                                    model.vocab_size, progress)
            return cls(checkpoint, model, tokenizer, store, dev, compute_dtype, context=context, spec=spec,
                       spec_depth=spec_depth, spec_width=spec_width, draft=draft)
        except BaseException:  # a Ctrl-C may land anywhere here, the Engine's own __init__ included
            finish_despite_interrupts(lambda: _close_parts(store, draft))
            raise

    @property
    def placement(self) -> Placement:
        return self.store.placement

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
                finish_despite_interrupts(lambda: _close_parts(self.store, self.draft))

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
                raise ConfigError(f"{self.checkpoint.root}: no tokenizer.json; pass the prompt as token ids")
            if chat:
                return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def stream(self, prompt: str | Sequence[int], *, chat: bool = False, spec: str | None = None,
               spec_depth: int | None = None, spec_width: int | None = None, **sampling: Any
               ) -> Iterator[TokenEvent | FinishEvent]:
        """Yield TokenEvents as tokens are accepted, then a FinishEvent. Holds the engine lock while iterating.
        spec / spec_depth / spec_width override the engine's speculative defaults for this request. Arguments
        are checked here, before the first next()."""
        self._check_open()
        params = SamplingParams(**sampling)
        ids = check_prompt(self.encode(prompt, chat), self.model.vocab_size)
        if spec is None:
            mode, depth, width = self.spec, self.spec_depth, self.spec_width
        else:
            mode, depth, width = check_spec(spec, spec_depth, spec_width)
        if mode == "mtp" and not mtp_layer_count(self.checkpoint):
            raise ConfigError("spec 'mtp': this engine was opened without the checkpoint's MTP layers; open it with "
                              "spec='mtp' (spec='auto' loads them only where they cost little memory)")
        if len(ids) + params.max_new_tokens > self.context:
            raise ConfigError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceed the "
                              f"context this engine reserved in its budget ({self.context} tokens): open it with a "
                              f"larger max_context (--context)")
        stream = self._serve(ids, params, mode, depth, width)
        self._streams.add(stream)
        return stream

    def _serve(self, ids: list[int], params: SamplingParams, mode: str, depth: int | None, width: int | None
               ) -> Iterator[TokenEvent | FinishEvent]:
        with self._request():
            before = self._counters()
            cache = self.model.new_cache(min(len(ids) + params.max_new_tokens + SPEC_ROOM, self.model.max_context))
            spec_stats = SpecStats()
            draft = self.draft
            stepper = make_stepper(self.model, cache, Sampler(params), mode, depth=depth, width=width, draft=draft,
                                   store=self.store, stats=spec_stats, tokenizer=self.tokenizer,
                                   draft_tokenizer=draft.tokenizer if draft is not None else None)
            events = drive(stepper, ids, GenerationState(params, self.tokenizer))
            decoding = None  # the store's counters when the prefill's token came out
            while True:
                # out of memory in the MTP / draft forwards too: only this request fails
                with sigint_guarded(), out_of_memory_as_error("request"):
                    event = next(events, None)
                if event is None:
                    break
                if isinstance(event, FinishEvent):
                    event.stats = {**self.stats(event, before, decoding), **_spec_summary(mode, spec_stats, event)}
                elif decoding is None:
                    decoding = self._counters()
                yield event

    def generate(self, prompt: str | Sequence[int], *, chat: bool = False, **sampling: Any) -> Completion:
        finish = None
        for event in self.stream(prompt, chat=chat, **sampling):
            if isinstance(event, FinishEvent):
                finish = event
        assert finish is not None
        return Completion(finish.text, finish.token_ids, finish.reason, finish.stats)

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits [len(token_ids), vocab] of a fresh sequence (scoring, perplexity, parity)."""
        self._check_open()
        ids = torch.tensor([int(t) for t in token_ids], dtype=torch.long)
        if ids.numel() == 0:
            raise ConfigError("logits(): token_ids is empty")
        with sigint_guarded(), self._request(), out_of_memory_as_error("logits"):
            return self.model.forward(ids, self.model.new_cache(ids.numel())).float().cpu()

    def _counters(self) -> dict[str, Any]:
        """The store's counters and the model's own (time computing experts on the host), for per-request deltas."""
        return {**self.store.stats.snapshot(), "host_compute_s": self.model.host_compute_s}

    def stats(self, finish: FinishEvent, before: dict | None = None, decoding: dict | None = None
              ) -> dict[str, Any]:
        """Per-request figures (store counters as deltas from `before`, a store snapshot taken at its start;
        `decoding`: one taken when the prefill's token came out, for the decode steps' own stall)."""
        n = len(finish.token_ids)
        now = self._counters()
        store = _delta(now, before or {})
        decode_wait = _delta(now, decoding)["io_wait_s"] if decoding else store["io_wait_s"]
        ledger = self.store.ledger
        return {
            "prompt_tokens": finish.prefill_tokens,
            "generated_tokens": n,
            "prefill_s": round(finish.prefill_s, 6),
            "decode_s": round(finish.decode_s, 6),
            "prefill_tok_s": finish.prefill_tokens / finish.prefill_s if finish.prefill_s > 0 else 0.0,
            "decode_tok_s": finish.decode_tokens_per_s,
            **store,
            "bytes_read_disk_per_token": store["bytes_read_disk"] / max(n, 1),
            "stall_s_per_token": decode_wait / max(n - 1, 1),  # per decode step, the prefill's waits excluded
            # share of the readers' busy time the compute thread did not wait through (I/O hidden by compute)
            "io_overlap": (max(0.0, 1.0 - store["io_wait_s"] / store["read_busy_s"])
                           if store["read_busy_s"] > 0 else 1.0),
            "hit_rate": _hit_rate(store, self.store.compute.name),
            "prefetch": _prefetch_stats(self.model.prefetcher, store["expert_reads"]),
            "host_compute": ({**self.model.host_compute.summary(),  # and what the computing took, per expert
                              "measured_expert_us": store["host_compute_s"] / store["host_computed"] * 1e6
                              if store["host_computed"] else None}
                             if self.model.host_compute else {"mode": "off"}),
            "budget_bytes": _tiers(ledger.budgets()),
            "peak_bytes": _tiers(ledger.peak()),
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
        }


def _kv_bytes(checkpoint: ModelCheckpoint, itemsize: int, context: int) -> int:
    """Every byte of per-sequence state one request may hold (the planner's formula): the main model's KV for
    the context plus a draft tree, its recurrent state with rollback logs, and each MTP layer's own cache (one
    attention layer's share, for the context, the tree and the MTP chain)."""
    tokens = context + SPEC_ROOM
    return kv_bytes(checkpoint.spec, tokens, itemsize, rollback=ROLLBACK, mtp_layers=mtp_layer_count(checkpoint),
                    mtp_positions=tokens + MAX_DEPTH + 1)


def _with_mtp_units(checkpoint: ModelCheckpoint, placement: Placement, use_direct: bool, plan: Any,
                    required: bool) -> tuple[ModelCheckpoint, Placement, bool]:
    """The checkpoint with its MTP layers as `mtp` units, and its placement. For "auto" only when they fit
    without un-pinning any of the model's own units and take at most MTP_CACHE_SHARE of the streaming caches: a
    dense layer or experts read from disk on every token cost more than MTP drafting saves, so auto then drafts
    without them (n-gram, self) rather than lose to plain decoding.
    "mtp" (required) loads them regardless, or fails with the budget's numbers."""
    with_mtp = attach_mtp_units(checkpoint)
    if with_mtp is checkpoint:
        return checkpoint, placement, use_direct
    try:
        mtp_placement, mtp_direct = plan(with_mtp)
    except PlanError:
        if required:
            raise
        return checkpoint, placement, use_direct
    if required or (_pinned(placement) <= _pinned(mtp_placement)
                    and _cache_bytes(mtp_placement) >= (1 - MTP_CACHE_SHARE) * _cache_bytes(placement)):
        return with_mtp, mtp_placement, mtp_direct
    return checkpoint, placement, use_direct


# --spec auto loads MTP layers when they cost at most this share of the cache that streams units (measured on
# the demo model: giving up 15-50% of the expert cache for MTP lost 11-39% of decode speed at 25-40% budgets,
# and 9.7% of it (4 of 41 expert slots) lost 5-8% at 50% while the cost model never chose to draft with MTP;
# one MTP layer of a real model, e.g. DeepSeek-V3's 1 of 61, stays well under 5%)
MTP_CACHE_SHARE = 0.05


def _pinned(placement: Placement) -> set[tuple[str, str]]:
    return {(t.name, kind) for t in placement.tiers for kind in t.pinned}


def _cache_bytes(placement: Placement) -> int:
    """Bytes of cache slots for units that stream (kinds not pinned on that tier)."""
    return sum(n * placement.sizes[kind].slot_bytes for t in placement.tiers for kind, n in t.slots.items()
               if kind not in t.pinned)


def _open_draft(path: str | os.PathLike, budget: Budget | None, device: torch.device, dtype: torch.dtype,
                context: int, tokenizer: Tokenizer | None, vocab_size: int, progress: bool) -> "Engine":
    """The draft model as an engine of its own (store, budget, reader threads), vocabulary checked now."""
    from .speculative.drafters.draft_model import check_same_vocabulary

    draft = Engine.open(path, budget=budget, device=device, dtype=dtype, max_context=context + SPEC_ROOM + MAX_DEPTH,
                        prefetch=False, progress=progress)
    try:
        check_same_vocabulary(tokenizer, draft.tokenizer, vocab_size, draft.model.vocab_size)
    except BaseException:
        draft.close()
        raise
    return draft


def _close_parts(store: TieredStore, draft: "Engine | None") -> None:
    store.close()
    if draft is not None:
        draft.close()


def _spec_summary(mode: str, stats: SpecStats, finish: FinishEvent) -> dict[str, Any]:
    """What speculation did for one request (SpecStats.as_dict keys, at the top level of the stats); a plain
    request makes one target forward per token. tokens_per_forward counts the prefill forward too."""
    if mode == "off":
        stats = SpecStats(target_forwards=max(len(finish.token_ids), 1), steps=max(len(finish.token_ids) - 1, 0))
    forwards = stats.target_forwards
    return {"spec": mode, **stats.as_dict(),
            "tokens_per_forward": len(finish.token_ids) / forwards if forwards else 0.0}


def _prefetcher(model: CausalLM, store: TieredStore, prefetch: PrefetchConfig | bool,
                trace: str | None) -> Prefetcher | None:
    """Only when something streams: with every unit pinned there is nothing to read ahead."""
    config = prefetch if isinstance(prefetch, PrefetchConfig) else PrefetchConfig(enabled=bool(prefetch))
    if not config.enabled or not store.placement.streams:
        if trace:
            logging.getLogger("offload_engine").warning(
                "routing trace %s not used: %s", trace,
                "prefetching is off" if not config.enabled else "every unit is resident, nothing is read ahead")
        return None
    ops, spec = model.ops, model.spec
    moe_layers = [l for l in range(spec.num_layers) if ops.is_moe(l)]
    lookahead = RouterLookahead(ops, moe_layers, spec.num_experts_per_tok, config.margin,
                                lambda t: store.peek(UnitKey(t, "dense")))
    prior = FrequencyPrior(moe_layers, spec.num_experts_per_tok, Path(trace) if trace else None)
    return Prefetcher(store, Combined(lookahead, prior), moe_layers, spec.num_layers, config)


def _host_compute(mode: str, rates: Machine | None, store: TieredStore) -> HostCompute | None:
    """Only where a host tier caches experts beyond its staging slots (a unit held for host compute must never
    leave a reader without one), and for "auto" only on a GPU."""
    if mode == "off" or not store.placement.host_caches("expert") or (mode == "auto" and not rates):
        return None
    layouts = [l for k, l in store.checkpoint.layouts.items() if k.kind == "expert"]
    biggest = max(layouts, key=lambda l: l.nbytes)
    params = sum(math.prod(t.shape) for t in biggest.slices)
    return HostCompute(mode, rates, biggest.nbytes, params)


def _prefetch_stats(prefetcher: Prefetcher | None, expert_reads: dict[str, int]) -> dict[str, Any]:
    """The prefetcher's summary, and recall_effective: the share of this request's expert reads that a prefetch
    made ahead of their use (the planner's prefetch recall, `plan --bench`)."""
    if prefetcher is None:
        return {"enabled": False, "recall_effective": 0.0}
    reads = expert_reads["ahead"] + expert_reads["demand"]
    return {**prefetcher.summary(), "recall_effective": expert_reads["ahead"] / reads if reads else 0.0}


def _hit_rate(store: dict, tier: str) -> float:
    """Share of unit acquisitions served by the compute tier without a read or copy."""
    looked = store["hits"][tier] + store["misses"][tier]
    return store["hits"][tier] / looked if looked else 1.0


def _tiers(values: dict[str, int | None]) -> dict[str, int | None]:
    """Ledger accounts -> {"device", "host"}; on CPU without --vram the one RAM tier is the host tier."""
    return {"device": values.get("device", 0), "host": values.get("host", 0)}


def _delta(now: dict, before: dict) -> dict:
    out = {}
    for k, v in now.items():
        b = before.get(k)
        if isinstance(v, dict):
            out[k] = {kk: vv - (b or {}).get(kk, 0) for kk, vv in v.items()}
        else:
            out[k] = v - (b or 0)
    return out

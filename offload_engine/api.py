"""Engine: the Python API. Engine.open(path, budget=...) -> generate() / stream() / logits().

Concurrent generate() calls on one engine are serialized by a lock (one KV cache and one weight store per
engine): they give the same outputs as sequential calls.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from .checkpoint.model import ModelCheckpoint, open_model
from .config import Budget, resolve_device, resolve_dtype
from .errors import ConfigError, EngineClosedError
from .checkpoint.naming import UnitKey
from .planner.placement import Placement
from .prefetch.predictor import Combined, FrequencyPrior, RouterLookahead
from .prefetch.prefetcher import PrefetchConfig, Prefetcher
from .runtime.kv_cache import ROLLBACK
from .runtime.model import CausalLM
from .spec.decoder import FinishEvent, TokenEvent, decode_stream
from .spec.sampling import SamplingParams
from .store.build import build_store, plan_for
from .store.store import ReadFn, TieredStore
from .tokenizer import Tokenizer


DEFAULT_CONTEXT = 4096


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)


class Engine:
    def __init__(self, checkpoint: ModelCheckpoint, model: CausalLM, tokenizer: Tokenizer | None,
                 store: TieredStore, device: torch.device, dtype: torch.dtype):
        self.checkpoint, self.model, self.tokenizer, self.store = checkpoint, model, tokenizer, store
        self.device, self.dtype = device, dtype
        self._lock = threading.Lock()
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, budget: Budget | None = None, device: str | torch.device | None = None,
             dtype: str | torch.dtype | None = None, *, max_context: int | None = None, policy: str = "layer-lru",
             direct_io: str = "auto", prefetch: PrefetchConfig | bool = True, trace: str | None = None,
             allow_cast: bool = False, progress: bool = False, read_fn: ReadFn | None = None) -> "Engine":
        """Open a Hugging Face folder within a memory budget. Planning (and its BudgetError) happens before any
        weight is read. `prefetch`: True (defaults), False, or a PrefetchConfig; `trace`: a routing trace to seed
        the frequency prior. `read_fn` replaces the disk read of one byte range (fault-injection tests)."""
        budget = budget or Budget()
        if not isinstance(budget, Budget):
            raise ConfigError(f"budget must be an offload_engine.Budget, got {type(budget).__name__}")
        dev = resolve_device(device)
        compute_dtype = resolve_dtype(dtype, dev)
        checkpoint = open_model(path, allow_cast=allow_cast)
        resolved = budget.resolve(checkpoint.total_bytes)
        context = max_context or min(checkpoint.spec.max_position_embeddings, DEFAULT_CONTEXT)
        ops = checkpoint.arch.ops(checkpoint.args, dev, compute_dtype)
        itemsize = torch.empty((), dtype=compute_dtype).element_size()
        kv_bytes = context * ops.kv_bytes_per_token(itemsize) + ops.state_bytes(itemsize, rollback=ROLLBACK)
        placement, use_direct = plan_for(checkpoint, resolved, dev, kv_bytes, direct_io)
        store = build_store(checkpoint, placement, dev, compute_dtype, use_direct, policy, progress, read_fn)
        model = CausalLM(checkpoint, store, dev, compute_dtype, max_context=context)
        model.prefetcher = _prefetcher(model, store, prefetch, trace)
        tokenizer = Tokenizer(checkpoint.root) if (Path(checkpoint.root) / "tokenizer.json").is_file() else None
        return cls(checkpoint, model, tokenizer, store, dev, compute_dtype)

    @property
    def placement(self) -> Placement:
        return self.store.placement

    def close(self) -> None:
        """Idempotent: joins the reader threads and frees every slot."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.store.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("engine is closed: open a new one with Engine.open(...)")

    # ---- inference -------------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError(f"{self.checkpoint.root}: no tokenizer.json; pass the prompt as token ids")
            if chat:
                return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def stream(self, prompt: str | Sequence[int], *, chat: bool = False, **sampling: Any
               ) -> Iterator[TokenEvent | FinishEvent]:
        """Yield TokenEvents as tokens are accepted, then a FinishEvent. Holds the engine lock while iterating."""
        self._check_open()
        params = SamplingParams(**sampling)
        ids = self.encode(prompt, chat)
        with self._lock:
            self._check_open()
            before = self.store.stats.snapshot()
            for event in decode_stream(self.model, ids, params, self.tokenizer):
                if isinstance(event, FinishEvent):
                    event.stats = self.stats(event, before)
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
        with self._lock:
            self._check_open()
            return self.model.forward(ids, self.model.new_cache(ids.numel())).float().cpu()

    def stats(self, finish: FinishEvent, before: dict | None = None) -> dict[str, Any]:
        """Per-request figures (store counters as deltas from `before`, a store snapshot taken at its start)."""
        n = len(finish.token_ids)
        store = _delta(self.store.stats.snapshot(), before or {})
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
            "hit_rate": _hit_rate(store, self.store.compute.name),
            "prefetch": self.model.prefetcher.summary() if self.model.prefetcher else {"enabled": False},
            "budget_bytes": _tiers(ledger.budgets()),
            "peak_bytes": _tiers(ledger.peak()),
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
        }


def _prefetcher(model: CausalLM, store: TieredStore, prefetch: PrefetchConfig | bool,
                trace: str | None) -> Prefetcher | None:
    """Only when something streams: with every unit pinned there is nothing to read ahead."""
    config = prefetch if isinstance(prefetch, PrefetchConfig) else PrefetchConfig(enabled=bool(prefetch))
    placement = store.placement
    if not config.enabled or all(placement.home(kind) != "disk" for kind in placement.sizes):
        return None
    ops, spec = model.ops, model.spec
    moe_layers = [l for l in range(spec.num_layers) if ops.is_moe(l)]
    lookahead = RouterLookahead(ops, moe_layers, spec.num_experts_per_tok, config.margin,
                                lambda t: store.peek(UnitKey(t, "dense")))
    prior = FrequencyPrior(moe_layers, spec.num_experts_per_tok, Path(trace) if trace else None)
    return Prefetcher(store, Combined(lookahead, prior), moe_layers, spec.num_layers, config)


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

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
from .errors import BudgetError, ConfigError, EngineClosedError
from .runtime.model import CausalLM
from .spec.decoder import FinishEvent, TokenEvent, decode_stream
from .spec.sampling import SamplingParams
from .store.resident import ResidentWeights
from .tokenizer import Tokenizer


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)


class Engine:
    def __init__(self, checkpoint: ModelCheckpoint, model: CausalLM, tokenizer: Tokenizer | None,
                 budget: Budget, device: torch.device, dtype: torch.dtype):
        self.checkpoint, self.model, self.tokenizer = checkpoint, model, tokenizer
        self.budget, self.device, self.dtype = budget, device, dtype
        self._lock = threading.Lock()
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, budget: Budget | None = None, device: str | torch.device | None = None,
             dtype: str | torch.dtype | None = None, *, allow_cast: bool = False, progress: bool = False) -> "Engine":
        budget = budget or Budget()
        if not isinstance(budget, Budget):
            raise ConfigError(f"budget must be an offload_engine.Budget, got {type(budget).__name__}")
        dev = resolve_device(device)
        compute_dtype = resolve_dtype(dtype, dev)
        checkpoint = open_model(path, allow_cast=allow_cast)
        resolved = budget.resolve(checkpoint.total_bytes)
        _check_fits(checkpoint, resolved.host, resolved.device, compute_dtype)
        source = ResidentWeights(checkpoint, dev, compute_dtype, progress=progress)
        model = CausalLM(checkpoint, source, dev, compute_dtype)
        tokenizer = Tokenizer(checkpoint.root) if (Path(checkpoint.root) / "tokenizer.json").is_file() else None
        return cls(checkpoint, model, tokenizer, budget, dev, compute_dtype)

    def close(self) -> None:
        self._closed = True

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
            yield from decode_stream(self.model, ids, params, self.tokenizer)

    def generate(self, prompt: str | Sequence[int], *, chat: bool = False, **sampling: Any) -> Completion:
        finish = None
        for event in self.stream(prompt, chat=chat, **sampling):
            if isinstance(event, FinishEvent):
                finish = event
        assert finish is not None
        return Completion(finish.text, finish.token_ids, finish.reason, self._stats(finish))

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits [len(token_ids), vocab] of a fresh sequence (scoring, perplexity, parity)."""
        self._check_open()
        ids = torch.tensor([int(t) for t in token_ids], dtype=torch.long)
        if ids.numel() == 0:
            raise ConfigError("logits(): token_ids is empty")
        with self._lock:
            return self.model.forward(ids, self.model.new_cache(ids.numel())).float().cpu()

    def _stats(self, finish: FinishEvent) -> dict[str, Any]:
        n = len(finish.token_ids)
        return {
            "prompt_tokens": finish.prefill_tokens,
            "generated_tokens": n,
            "prefill_s": round(finish.prefill_s, 6),
            "decode_s": round(finish.decode_s, 6),
            "prefill_tok_s": finish.prefill_tokens / finish.prefill_s if finish.prefill_s > 0 else 0.0,
            "decode_tok_s": finish.decode_tokens_per_s,
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
        }


def _check_fits(checkpoint: ModelCheckpoint, host: int | None, device: int | None, dtype: torch.dtype) -> None:
    """Until the tiered store lands, every weight is resident: the model must fit the RAM budget."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = sum(s.numel * itemsize for specs in checkpoint.schema.units.values() for s in specs.values())
    if host is not None and need > host:
        raise BudgetError("ram", need, host, {"weights (resident, compute dtype)": need},
                          hint="streaming weights from disk within a smaller budget is not available yet")

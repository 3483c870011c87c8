"""Which drafters a --spec mode builds for a given target (and optional draft model and store)."""
from __future__ import annotations

from typing import Any

from ...constants import DEFAULT_CONTEXT
from ...errors import ConfigError
from ...runtime.mtp import mtp_layer_count, mtp_supported
from .ngram import NgramDrafter


def self_draft_refusal(model: Any) -> str | None:
    """Why the self drafter cannot run on `model`, or None when it can: it runs every layer of the target on one
    rank, with the target's resident routed experts (Engine.prepare refuses spec "self" with this reason)."""
    if getattr(model, "stage", None) is not None:
        return ("self drafting runs every layer of the target on one rank: not available with the layers split "
                "across ranks (pipeline stages)")
    if not (getattr(getattr(model, "spec", None), "num_experts", 0) and hasattr(model, "checkpoint")):
        return ("self drafting uses the target's resident routed experts: it needs a mixture-of-experts model (this "
                "one has no routed experts)")
    return None


def build_drafters(spec: str, model: Any, cache: Any, *, draft: Any = None, store: Any = None,
                   tokenizer: Any = None, draft_tokenizer: Any = None, max_depth: int = 8,
                   with_self: bool = True, self_experts_per_token: int | None = None) -> list:
    """spec "auto": every drafter the target supports (self only `with_self`); otherwise the named one, or
    ConfigError saying why not."""
    capacity = getattr(cache, "capacity", None) or (model.max_context or DEFAULT_CONTEXT)
    has_mtp = hasattr(model, "checkpoint") and mtp_supported(model)
    out = []
    if spec in ("auto", "ngram"):
        out.append(NgramDrafter())
    if spec == "mtp" or (spec == "auto" and has_mtp):
        if not has_mtp:
            why = ("its architecture's MTP forward is not implemented" if hasattr(model, "checkpoint")
                   and mtp_layer_count(model.checkpoint) else "the checkpoint has no multi-token-prediction layers "
                   "(config.json num_nextn_predict_layers is 0, or its MTP tensors are absent)")
            raise ConfigError(f"--spec mtp: {why}")
        from .mtp import MtpDrafter
        out.append(MtpDrafter(model, capacity + max_depth + 1))
    if spec == "draft" or (spec == "auto" and draft is not None):
        if draft is None:
            raise ConfigError("--spec draft needs a draft model: pass --draft-model DIR (API: draft_model=...)")
        from .draft_model import DraftModelDrafter, check_same_vocabulary
        draft_model = getattr(draft, "model", draft)
        draft_tok = draft_tokenizer if draft_tokenizer is not None else getattr(draft, "tokenizer", None)
        # a caller that passes the target's tokenizer asks for the comparison; Engine compares them once when it
        # opens (assemble.py) and passes none: its target's vocab_size may be padded past the draft's
        if tokenizer is not None:
            check_same_vocabulary(tokenizer, draft_tok, model.vocab_size, draft_model.vocab_size)
        out.append(DraftModelDrafter(draft_model, capacity + max_depth + 1, model.vocab_size))
    no_self = self_draft_refusal(model)
    if spec == "self" or (spec == "auto" and with_self and no_self is None and store is not None):
        if no_self is not None:
            raise ConfigError(f"--spec self: {no_self}")
        from .self_draft import SelfDrafter
        resident = (lambda: store.resident_keys("device")) if store is not None else None
        out.append(SelfDrafter(model, cache, resident, self_experts_per_token))
    return out

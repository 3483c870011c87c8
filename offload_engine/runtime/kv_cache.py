"""Per-layer attention cache with rewind: `trim(n)` drops the last n positions (rejected draft tokens).

Each layer stores whatever tensors its attention needs ([positions, ...] along dim 0: K and V for standard
attention, the compressed latent and the rope key for MLA). Storage is allocated once per layer at the first
append, for `capacity` positions, so growth never copies and the bytes are known up front for budgeting. How each
tensor is stored (the compute dtype, bf16, or fp8 / int8 with per-row scales) is `kv_dtype`'s storage class
(kv_storage.py); `append` returns every position in the compute dtype whatever the storage.

Recurrent layers (linear attention: a fixed-size state instead of per-position entries) use `state(layer)` and
`set_state(layer, ...)`. A state set during a forward is committed by `advance`, like appended entries, so a forward
that fails halfway leaves the cache as it was. Rewinding such a layer needs its state as of an earlier position:
the cache keeps a few states (checkpoints, at least `rollback` positions apart) and, for each position after the
oldest one, the step log the layer recorded; `trim` / `keep` replay the log from the nearest checkpoint, which
rebuilds the earlier state exactly. At least the last `rollback` positions can always be rewound, unless a forward
recorded no log (a chunked prefill): positions before its end can then only be rewound to 0 (a fresh sequence).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import check_kv_dtype
from ..errors import BudgetError
from .kv_storage import KVStorage, PlainStorage, new_storage

RecurrentState = tuple[torch.Tensor, ...]
StepLog = tuple[torch.Tensor, ...]  # [positions, ...] each
Replay = Callable[[RecurrentState | None, StepLog], RecurrentState]  # (state at p, log of p..q-1) -> state at q
ROLLBACK = 16  # positions a recurrent layer can always be rewound by (a speculative window and then some)


@dataclass
class _Segment:
    start: int  # position of its first token
    log: StepLog

    @property
    def end(self) -> int:
        return self.start + self.log[0].shape[0]


class _StateHistory:
    """One recurrent layer: its state at a few positions (the last is the live one) and the logs after the first."""

    def __init__(self, replay: Replay):
        self.replay = replay
        self.anchors: list[tuple[int, RecurrentState | None]] = [(0, None)]
        self.segments: list[_Segment] = []

    @property
    def head(self) -> tuple[int, RecurrentState | None]:
        return self.anchors[-1]

    def commit(self, end: int, state: RecurrentState, log: StepLog | None, replay: Replay, window: int) -> None:
        start = self.head[0]
        self.replay = replay
        if log is None:  # not replayable: earlier positions are out of reach (except a reset to 0)
            self.anchors, self.segments = [(end, state)], []
            return
        if log[0].shape[0] != end - start:
            raise ValueError(f"step log covers {log[0].shape[0]} positions, the forward {end - start}")
        self.segments.append(_Segment(start, log))
        previous = self.anchors.pop()
        if not self.anchors or previous[0] - self.anchors[-1][0] >= window:
            self.anchors.append(previous)  # a checkpoint at least `window` after the one before
        self.anchors.append((end, state))
        # keep the newest checkpoint at or before end - window, and everything after it
        first = max((i for i, (p, _) in enumerate(self.anchors) if p <= end - window), default=0)
        self.anchors = self.anchors[first:]
        self.segments = [s for s in self.segments if s.end > self.anchors[0][0]]

    def reachable(self, position: int) -> bool:
        return position == 0 or self.anchors[0][0] <= position

    def state_at(self, position: int) -> RecurrentState | None:
        """The state as of a reachable `position` <= the live one: the nearest checkpoint, then its log replayed."""
        if position == 0:
            return None
        start, state = max((a for a in self.anchors if a[0] <= position), key=lambda a: a[0])
        if position == start:
            return state
        parts = [s.log for s in self.segments if s.end > start and s.start < position]
        log = tuple(torch.cat([p[i] for p in parts])[:position - start] for i in range(len(parts[0])))
        return self.replay(state, log)

    def restore(self, position: int) -> None:
        """Make the state as of `position` the live one, forgetting everything after it."""
        if position == self.head[0]:
            return
        state = self.state_at(position)
        self.anchors = [a for a in self.anchors if a[0] < position] + [(position, state)]
        self.segments = [s for s in self.segments if s.start < position]
        if self.segments and self.segments[-1].end > position:
            last = self.segments[-1]
            self.segments[-1] = _Segment(last.start, tuple(t[:position - last.start] for t in last.log))

    def copy(self, position: int, device: torch.device) -> "_StateHistory":
        """A copy as of a reachable `position` (states and logs cloned onto `device`): shares no tensor with this one."""
        out = _StateHistory(self.replay)
        out.anchors, out.segments = list(self.anchors), list(self.segments)
        out.restore(position)  # new lists and views: this history is left as it was
        out.anchors = [(p, None if st is None else tuple(t.to(device, copy=True) for t in st)) for p, st in out.anchors]
        out.segments = [_Segment(s.start, tuple(t.to(device, copy=True) for t in s.log)) for s in out.segments]
        return out

    @property
    def nbytes(self) -> int:
        states = sum(t.numel() * t.element_size() for _, st in self.anchors if st is not None for t in st)
        logs = sum(t.numel() * t.element_size() for s in self.segments for t in s.log)
        return states + logs


class KVCache:
    def __init__(self, num_layers: int, capacity: int, device: torch.device | str = "cpu", rollback: int = ROLLBACK,
                 kv_dtype: str = "auto"):
        self.capacity = capacity
        self.device = torch.device(device)
        self.kv_dtype = check_kv_dtype(kv_dtype)  # refused here, not at the first append
        self.length = 0  # committed positions
        self.rollback = rollback  # recurrent layers: positions that can always be rewound
        self._store: list[tuple[KVStorage, ...] | None] = [None] * num_layers
        self._states: dict[int, _StateHistory] = {}  # recurrent layers, by layer
        self._pending: dict[int, tuple[RecurrentState, StepLog | None, Replay]] = {}  # set by the forward in flight

    def append(self, layer: int, *entries: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write `entries` ([T, ...] each) after the committed positions; return all positions, this forward's
        included, as stored (views for `auto`; dequantized for fp8 / int8, so every forward reads the same values)."""
        t = entries[0].shape[0]
        end = self.length + t
        if end > self.capacity:
            raise BudgetError("kv-cache", end, self.capacity, hint="context (positions) exceeds the cache capacity")
        store = self._store[layer]
        if store is None:
            store = tuple(new_storage(self.kv_dtype, self.capacity, e, self.device) for e in entries)
            self._store[layer] = store
        for part, e in zip(store, entries):
            part.write(self.length, e)
        return tuple(part.read(end) for part in store)

    def plain_buffers(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...] | None:
        """The layer's entry buffers ([capacity, ...] each) where they hold `dtype` values as given (`auto`) and
        one more position fits: a native kernel then writes position `length` itself (arch/base.py's
        StandardOps._native_step, kernels/native/decode_cpu.cpp) instead of calling `append`; None otherwise
        (not allocated yet, quantized, full)."""
        store = self._store[layer]
        if store is None or self.length >= self.capacity:
            return None
        if not all(isinstance(part, PlainStorage) and part.buf.dtype == dtype == part.compute for part in store):
            return None
        return tuple(part.buf for part in store)

    def advance(self, n: int) -> None:
        """Commit n positions written by the last forward (called once per forward, after every layer)."""
        for layer, (state, log, replay) in self._pending.items():
            self._states.setdefault(layer, _StateHistory(replay)).commit(self.length + n, state, log, replay,
                                                                         self.rollback)
        self._pending.clear()
        self.length += n

    def trim(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot trim {n} positions from a cache of {self.length}")
        self._restore_states(self.length - n)
        self.length -= n

    # ---- recurrent layers ------------------------------------------------------------------------------
    def state(self, layer: int) -> RecurrentState | None:
        """The committed state of a recurrent layer (as of `length` positions); None for a fresh sequence."""
        history = self._states.get(layer)
        return None if history is None else history.head[1]

    def set_state(self, layer: int, state: RecurrentState, *, log: StepLog | None = None,
                  replay: Replay | None = None) -> None:
        """The layer's state after the tokens of the forward in flight; `advance` commits it.

        log: what the layer consumed per new position ([T, ...] each) and `replay` rebuilds a state from such a
        log. Without a log (a chunked prefill) the positions before this forward's end can no longer be rewound
        to, except to 0."""
        if log is not None and replay is None:
            raise ValueError("a step log needs the replay function that consumes it")
        self._pending[layer] = (state, log, replay)

    def can_rewind(self, position: int) -> bool:
        """Whether trim / keep may bring the cache back to `position` (every recurrent layer can reach it)."""
        return 0 <= position <= self.length and all(h.reachable(position) for h in self._states.values())

    def _restore_states(self, position: int) -> None:
        """Rewind every recurrent layer to `position`, or change nothing and raise if one cannot."""
        self._pending.clear()
        for layer, history in self._states.items():
            if not history.reachable(position):
                raise ValueError(f"cannot rewind the recurrent state of layer {layer} to position {position}: "
                                 f"states are kept from position {history.anchors[0][0]} (a rewindable window of "
                                 f"{self.rollback} positions after the last chunked forward)")
        for history in self._states.values():
            history.restore(position)

    @property
    def state_nbytes(self) -> int:
        """Bytes held for recurrent layers: live states, rewind checkpoints and step logs."""
        return sum(h.nbytes for h in self._states.values())

    def keep(self, positions: list[int]) -> None:
        """Compact: keep only these positions (ascending) of those at or after the first, e.g. an accepted tree path."""
        if not positions:
            return
        start = positions[0]
        if self._states:
            if positions != list(range(start, start + len(positions))):
                raise ValueError("recurrent (linear-attention) layers cannot keep a non-contiguous path: their state "
                                 "mixed every token in order; hybrid models verify linear chains only")
            self._restore_states(start + len(positions))
        idx = torch.tensor(positions, device=self.device)
        for store in self._store:
            if store is not None:
                for buf in (t for part in store for t in part.tensors):  # data and scales alike
                    buf[start:start + len(positions)] = buf[idx]
        self.length = start + len(positions)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for s in self._store if s is not None for part in s
                   for b in part.tensors)

    # ---- snapshots (the server's prompt cache, generate/prompt_cache.py) -------------------------------------
    def copy_prefix(self, n: int, device: torch.device | str = "cpu") -> "KVCache":
        """A new cache of capacity n on `device` holding copies of this one's first n positions (entries as
        stored: quantized ones with their scales) and its recurrent states as of n."""
        out = KVCache(len(self._store), n, device, self.rollback, self.kv_dtype)
        out.load(self, n)
        return out

    @torch.inference_mode()  # the buffers are inference tensors (written by forwards): updated in place here too
    def load(self, source: "KVCache", n: int) -> None:
        """Forget everything held and take copies of `source`'s first n positions (a rewindable position of it):
        later writes to either cache never reach the other. Buffers already allocated here are reused."""
        if not 0 <= n <= self.capacity or not source.can_rewind(n) or source.kv_dtype != self.kv_dtype:
            raise ValueError(f"cannot load {n} positions of a {source.kv_dtype} cache of {source.length} into a "
                             f"{self.kv_dtype} cache of capacity {self.capacity}")
        self._pending.clear()
        for layer, parts in enumerate(source._store):
            if parts is None:
                continue
            mine = self._store[layer]
            if mine is None or _layout(mine) != _layout(parts):
                mine = tuple(new_storage(self.kv_dtype, self.capacity, p.tensors[0].new_empty(
                    (0, *p.tensors[0].shape[1:]), dtype=p.compute), self.device) for p in parts)
                self._store[layer] = mine
            for dst, src in zip((t for p in mine for t in p.tensors), (t for p in parts for t in p.tensors)):
                dst[:n].copy_(src[:n])
        self._states = {layer: h.copy(n, self.device) for layer, h in source._states.items()}
        self.length = n

    def prefix_nbytes(self, n: int) -> int:
        """What copy_prefix(n) holds for the attention entries (the recurrent states add state_nbytes at most)."""
        return sum(b[:n].numel() * b.element_size() for s in self._store if s is not None for part in s
                   for b in part.tensors)


def _layout(parts: tuple[KVStorage, ...]) -> list:
    """What a layer's storage holds per position: each buffer's row shape and dtype, and the dtype reads return."""
    return [(p.compute, t.shape[1:], t.dtype) for p in parts for t in p.tensors]

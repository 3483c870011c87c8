"""A rank other than 0: serves rank 0's commands for its stage of the layers until told to close.

Each command arrives from the previous rank and, but for cache commands reaching the last rank (rank 0 has
applied them already), goes on to the next one. A failure (this rank's own, or a peer found dead or silent) is
sent on as an ERROR naming the rank at fault, so rank 0 fails the request with that name. The rank then keeps
taking (and dropping) what the previous rank sends, so rank 0's commands never wait on a rank that stopped
listening, until the ring closes or the previous rank goes away; then it ends serving with the error.
"""
from __future__ import annotations

import json
import resource
from typing import Any

import torch

from ..assemble import EngineParts
from ..checkpoint.stage import Stage
from ..errors import out_of_memory_as_error
from ..runtime.layers import causal_mask
from .group import Link, RankFailedError, decode_text, encode_text
from .pipeline import CHECK, CLOSE, DTYPES, ERROR, FORWARD, FREE, HAS_MASK, HAS_POSITIONS, KEEP, NEW, STATS, TRIM


def rank_figures(rank: int, stage: Stage | None, parts: EngineParts) -> dict[str, Any]:
    """What `stats` reports of one rank: its layers, device and memory (the ledger's budgets and peaks per tier,
    and the process's peak resident set)."""
    snap = parts.store.snapshot()
    return {"rank": rank, "device": str(parts.device),
            "layers": [stage.start, stage.stop - 1] if stage is not None else [0, parts.model.num_layers - 1],
            "embedding": stage is None or stage.first, "head": stage is None or stage.last,
            "budget_bytes": snap["budget_bytes"], "peak_bytes": snap["peak_bytes"],
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


class StageWorker:
    def __init__(self, parts: EngineParts, link: Link, stage: Stage):
        self.parts, self.link, self.stage = parts, link, stage
        self.model = parts.model
        self.rank = link.topology.rank
        self.last = link.topology.next == 0  # the rank before rank 0: replies go to rank 0
        self.caches: dict[int, Any] = {}

    def close(self) -> None:
        self.caches.clear()
        self.parts.close()

    def serve(self) -> None:
        """Until CLOSE; raises RankFailedError (after passing it on) when a peer or this rank failed."""
        while True:
            header = self.link.recv_header(idle=True)
            op = header[0]
            try:
                if op == CLOSE:
                    self.link.send(CLOSE)
                    return
                self._handle(op, header)
            except RankFailedError as e:
                self._pass_on(e.rank, str(e))
                self._drain()
                raise
            except Exception as e:  # this rank's own failure: the request fails on every rank, naming this one
                self._pass_on(self.rank, f"{type(e).__name__}: {e}")
                self._drain()
                raise RankFailedError(self.rank, f"{type(e).__name__}: {e}") from e

    def _pass_on(self, rank: int, message: str) -> None:
        text = encode_text(message[:2000])
        try:
            self.link.send(ERROR, rank, text.numel(), tensors=(text,))
        except RankFailedError:
            pass  # the next rank is gone too; rank 0 finds out from its own links

    def _drain(self) -> None:
        """After a failure: take every message until CLOSE or until the previous rank is gone."""
        try:
            while True:
                header = self.link.recv_header(idle=True)
                if header[0] == CLOSE:
                    return
                for shape, dtype in self._payload(header):
                    self.link.recv(shape, dtype)
        except RankFailedError:
            return

    def _payload(self, header: list[int]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The tensors that follow a header (their shapes and dtypes)."""
        op = header[0]
        if op == FORWARD:
            _, _, T, flags, cols, code = header[:6]
            first = [((T,), torch.int64) if self.stage.first else ((T, self.model.spec.hidden_size), DTYPES[code])]
            return (first + ([((T,), torch.int64)] if flags & HAS_POSITIONS else [])
                    + ([((T, cols), torch.uint8)] if flags & HAS_MASK else []))
        if op == KEEP:
            return [((header[2],), torch.int64)]
        if op in (STATS, ERROR):
            return [((header[1 if op == STATS else 2],), torch.uint8)]
        return []

    @torch.inference_mode()  # the caches' tensors are inference tensors: trim and keep update them in place
    def _handle(self, op: int, header: list[int]) -> None:
        link = self.link
        if op == ERROR:
            raise RankFailedError(header[1], decode_text(link.recv((header[2],), torch.uint8)))
        if op == FORWARD:
            self._forward(header)
        elif op == CHECK:  # goes around to rank 0, every rank's answer and-ed in
            ok = header[3] and self.caches[header[1]].can_rewind(header[2])
            link.send(CHECK, header[1], header[2], int(ok))
        elif op == STATS:
            ranks = json.loads(decode_text(link.recv((header[1],), torch.uint8)))
            text = encode_text(json.dumps(ranks + [rank_figures(self.rank, self.stage, self.parts)]))
            link.send(STATS, text.numel(), tensors=(text,))
        else:
            extra: tuple[torch.Tensor, ...] = ()
            if op == NEW:
                self.caches[header[1]] = self.model.new_cache(header[2])
            elif op == FREE:
                self.caches.pop(header[1], None)
            elif op == TRIM:
                self.caches[header[1]].trim(header[2])
            elif op == KEEP:
                extra = (link.recv((header[2],), torch.int64),)
                self.caches[header[1]].keep(extra[0].tolist())
            else:
                raise RankFailedError(link.topology.previous, f"sent an unknown op {op}")
            if not self.last:  # rank 0 applied it first
                link.send(op, *header[1:], tensors=extra)

    def _forward(self, header: list[int]) -> None:
        link, model = self.link, self.model
        _, cache_id, T, flags, mask_cols, dtype_code = header[:6]
        if self.stage.first:
            received = link.recv((T,), torch.int64)
        else:
            received = link.recv((T, model.spec.hidden_size), DTYPES[dtype_code])
        positions = link.recv((T,), torch.int64) if flags & HAS_POSITIONS else None
        mask = link.recv((T, mask_cols), torch.uint8) if flags & HAS_MASK else None
        cache = self.caches[cache_id]
        device = model.device
        with out_of_memory_as_error(f"rank {self.rank}'s forward on {device}"):
            try:
                x = model.embed(received.to(device)) if self.stage.first else received.to(device, model.dtype)
                at = positions.to(device) if positions is not None else torch.arange(cache.length, cache.length + T,
                                                                                       device=device)
                m = mask.to(device).bool() if mask is not None else causal_mask(at, cache.length + T)
                x = model.run_layers(x, at, cache, m)
                if model.prefetcher is not None:
                    model.prefetcher.forward_finished()
            finally:
                self.parts.store.end_request()  # nothing is held between commands
        cache.advance(T)
        if self.last:  # rank 0 has the positions and the mask
            link.send(FORWARD, cache_id, T, 0, 0, DTYPES.index(x.dtype), tensors=(x,))
        else:
            extra = tuple(t for t in (positions, mask) if t is not None)
            link.send(FORWARD, cache_id, T, flags, mask_cols, DTYPES.index(x.dtype), tensors=(x, *extra))

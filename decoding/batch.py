"""Continuous batching: the decode steps of many requests in one forward.

A request decoding with a `Batch` does not run its own decode forward: it yields a `Step` (its
next input embedding and position) and is resumed with the hidden state and logits once the batch
has run. Whoever drives the generators (the chat worker) advances each to its next `Step`, then
calls `run()`: a lone step runs on its request's own cache (the compiled step where it covers it);
two or more seat their requests in the batch's cache and run as rows of one forward.

The batch's cache is one transformers `StaticCache`, a row per seated request. Every step writes
the same column for every row, so rows of different lengths are right-aligned: a row's positions
are the last columns it has written, the columns before its first are masked (its attention mask
row is 0 there). Positions are explicit (a row's own), so where its keys sit changes nothing: the
rotary embedding was applied before they were cached. A request joins when it first steps with
others (its keys copied into a new row) and leaves when it finishes (`leave`: its keys copied out
into a cache of its own, for the next turn of its conversation); a join, a leave or a full cache
rebuilds the batch's cache, right-aligned and compact again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator

import torch
from transformers import DynamicCache, StaticCache

from decoding.compiled import fit, static_cache


@dataclass(eq=False)
class Step:
    """One request's next decode forward, parked until the batch runs it with the others."""

    req: object  # a decoding.request.Request of one unpadded row
    embeds: torch.Tensor  # [1, 1, H]
    position: torch.Tensor  # [1, 1], or [4, 1, 1] for mRoPE
    hidden: torch.Tensor | None = None  # [1, H], filled by `Batch.run`
    logits: torch.Tensor | None = None  # [1, V]


def _rows(cache, row: int, columns: torch.Tensor | slice) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One row's keys and values [1, heads, n, d] per layer, at `columns`."""
    return [(layer.keys[row:row + 1, :, columns], layer.values[row:row + 1, :, columns]) for layer in cache.layers]


class Batch:
    """The requests decoding together, and the cache they share."""

    def __init__(self):
        self.pending: list[Step] = []  # steps yielded since the last run
        self.seats: list[object] = []  # requests with a row in `cache`, in row order
        self._static: dict[int, bool] = {}  # id(request) -> whether its own cache was a static one
        self.cache: StaticCache | None = None
        self.mask: torch.Tensor | None = None  # [rows, capacity]: 1 where a column holds one of the row's positions
        self.width = 0  # columns written
        self.forwards = 0  # batched forwards run, and the rows they carried (for measuring)
        self.rows_run = 0

    def step(self, req, embeds: torch.Tensor, position: torch.Tensor) -> Generator[Step, None, tuple]:
        """`yield from` in a request's decode loop: (hidden [1, H], logits [1, V]) of its next position."""
        step = Step(req, embeds, position)
        self.pending.append(step)
        yield step
        if step.hidden is None:
            raise RuntimeError("a decode step was resumed before its batch ran (call Batch.run after each round)")
        return step.hidden, step.logits

    def run(self) -> None:
        """Run every pending step: alone on its own cache, or as rows of one forward."""
        steps, self.pending = self.pending, []
        if not steps:
            return
        fwd = steps[0].req.fwd
        if len(steps) == 1 and not self.seats:
            s = steps[0]
            hidden = fwd.step(s.embeds, s.position, s.req.cache, None)
        else:
            for s in steps:
                if not any(r is s.req for r in self.seats):
                    self._join(s.req)
            hidden = self._forward(fwd, steps)
        logits = fwd.logits(hidden)
        for i, s in enumerate(steps):
            s.hidden, s.logits = hidden[i:i + 1], logits[i:i + 1]

    def _forward(self, fwd, steps: list[Step]) -> torch.Tensor:
        """One forward of every seated row (a seat without a step this round gets a masked column); the
        hidden states of `steps`, in their order [len(steps), H]."""
        if self.width + 1 > self.cache.layers[0].max_cache_len:
            self._rebuild(self._contents())  # a larger bucket
        rows = [next(i for i, r in enumerate(self.seats) if r is s.req) for s in steps]
        embeds = steps[0].embeds.new_zeros((len(self.seats), *steps[0].embeds.shape[1:]))
        pos = steps[0].position
        positions = pos.new_zeros((*pos.shape[:-2], len(self.seats), 1))
        for row, s in zip(rows, steps):
            embeds[row] = s.embeds[0]
            positions[..., row, :] = s.position[..., 0, :]
            self.mask[row, self.width] = 1
        self.width += 1
        hidden = fwd.step(embeds, positions, self.cache, self.mask[:, :self.width])
        self.forwards += 1
        self.rows_run += len(steps)
        return hidden[rows]

    def leave(self, req) -> None:
        """`req` is done decoding: its row's keys and values go back to it (`req.cache`, a cache of the kind
        it came with: static for the compiled step, else dynamic). Nothing happens for a request without a seat."""
        row = next((i for i, r in enumerate(self.seats) if r is req), None)
        self.pending = [s for s in self.pending if s.req is not req]
        if row is None:
            return
        contents = self._contents()
        cache = DynamicCache(config=req.fwd.base.config.get_text_config(decoder=True))
        for layer, (k, v) in enumerate(contents.pop(row)):
            cache.update(k, v, layer)
        req.cache = fit(cache, req.fwd.model, cache.get_seq_length() + 1) if self._static.pop(id(req)) else cache
        del self.seats[row]
        self._rebuild(contents)

    def _join(self, req) -> None:
        """Give `req` a row, with the keys and values of its own cache."""
        held = int(req.cache.get_seq_length())
        own = _rows(req.cache, 0, slice(0, held))
        self._static[id(req)] = isinstance(req.cache, StaticCache)
        self.seats.append(req)
        req.cache = None  # the batch holds its keys and values until it leaves
        self._rebuild([*self._contents(), own])

    def _contents(self) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Every seated row's keys and values, compact (its own columns only)."""
        if self.cache is None:
            return []
        return [_rows(self.cache, row, self.mask[row, :self.width].nonzero()[:, 0]) for row in
                range(self.mask.shape[0])]

    def _rebuild(self, contents: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """A new cache holding `contents` (one entry per seat), right-aligned, with room to grow."""
        if not contents:
            self.cache, self.mask, self.width = None, None, 0
            return
        lengths = [row[0][0].shape[2] for row in contents]
        self.width = max(lengths)
        model = self.seats[0].fwd.model
        self.cache = static_cache(model, self.width + 1)
        capacity = self.cache.layers[0].max_cache_len
        self.mask = torch.zeros((len(contents), capacity), dtype=torch.long, device=contents[0][0][0].device)
        for layer, new in enumerate(self.cache.layers):
            k0, v0 = contents[0][layer]
            new.lazy_initialization(k0.expand(len(contents), -1, -1, -1), v0.expand(len(contents), -1, -1, -1))
            for row, n in enumerate(lengths):
                k, v = contents[row][layer]
                new.keys[row, :, self.width - n:self.width] = k[0]
                new.values[row, :, self.width - n:self.width] = v[0]
            new.cumulative_length.fill_(self.width)
        for row, n in enumerate(lengths):
            self.mask[row, self.width - n:self.width] = 1

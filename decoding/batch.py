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
rebuilds the batch's cache, right-aligned and compact again. The last seat left gets its own cache
back too, and decodes alone again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator

import torch
from transformers import StaticCache

from decoding.compiled import fit, static_cache


class Parked:
    """What a request's decode loop yields to wait for the round (the worker parks it until `Batch.run`). A turn
    run by a runner (not a `Step`) that failed holds its `error`, which the answer raises when it is resumed."""

    error: BaseException | None = None


@dataclass(eq=False)
class Step(Parked):
    """One request's next decode forward, parked until the batch runs it with the others."""

    req: object  # a decoding.request.Request of one unpadded row
    embeds: torch.Tensor  # [1, W, H]: one position, or a memory's W slots (and its suffix)
    position: torch.Tensor  # [1, W], or [4, 1, W] for mRoPE
    hidden: torch.Tensor | None = None  # [1, H], filled by `Batch.run`
    logits: torch.Tensor | None = None  # [1, V]


def _rows(cache, row: int, columns: torch.Tensor | slice) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One row's keys and values [1, heads, n, d] per layer, at `columns`."""
    return [(layer.keys[row:row + 1, :, columns], layer.values[row:row + 1, :, columns]) for layer in cache.layers]


Rows = list[list[tuple[torch.Tensor, torch.Tensor]]]  # per seat, per layer: (keys, values) [1, heads, n, d]


class Batch:
    """The requests decoding together, and the cache they share.

    Every change of the shared cache (a join, a leave, growth) builds the new one first and only then
    replaces the old, so a failure (out of memory) leaves the batch as it was.
    """

    def __init__(self):
        self.pending: list[Step] = []  # steps yielded since the last run
        self.seats: list[object] = []  # requests with a row in `cache`, in row order
        self._static: dict[int, bool] = {}  # id(request) -> whether its own cache was a static one
        self.cache: StaticCache | None = None
        self.mask: torch.Tensor | None = None  # [rows, capacity]: 1 where a column holds one of the row's positions
        self.width = 0  # columns written
        self.forwards = 0  # batched forwards run, and the rows they carried (for measuring)
        self.rows_run = 0
        self.concurrent = 0  # requests in progress beside one another (set by the chat's worker each round): an
        # answer alone may take the single-row graph step; with others, the graph rows (`Engine.stream`)

    def step(self, req, embeds: torch.Tensor, position: torch.Tensor) -> Generator[Step, None, tuple]:
        """`yield from` in a request's decode loop: (hidden [1, H], logits [1, V]) of its next position."""
        step = Step(req, embeds, position)
        self.pending.append(step)
        yield step
        if step.hidden is None:
            raise RuntimeError("a decode step was resumed before its batch ran (call Batch.run after each round)")
        return step.hidden, step.logits

    def park(self, turn: Parked) -> Generator[Parked, None, None]:
        """`yield from` in a decode loop that runs elsewhere (`decoding.graph_rows`): `turn` waits for the round,
        whose `run` runs it with the others of its kind (`turn.runner.run(turns)`)."""
        self.pending.append(turn)
        yield turn
        if turn.error is not None:
            raise turn.error

    @torch.no_grad()
    def run(self) -> None:
        """Run every pending step, as the requests' backend runs a round (`Backend.run_round`; a failure fails the
        round), and every other parked turn by its runner (the graph step's rows: one replay for all of them; the
        prompts read together): a runner that fails fails its own turns only (their `error`)."""
        parked, self.pending = self.pending, []
        steps = [p for p in parked if isinstance(p, Step)]
        others = [p for p in parked if not isinstance(p, Step)]
        for runner in dict.fromkeys(p.runner for p in others):
            turns = [p for p in others if p.runner is runner]
            try:
                runner.run(turns)
            except Exception as e:  # noqa: BLE001 - each of its answers raises it when resumed (`park`)
                for t in turns:
                    t.error = e
        if steps:
            steps[0].req.fwd.run_round(steps, self)

    def run_rows(self, steps: list[Step], fwd) -> None:
        """A transformers round: a lone step on its request's own cache, or the steps as rows of one forward."""
        if len(steps) == 1 and not self.seats:
            s = steps[0]
            hidden, _ = fwd.step(s.embeds, s.position, s.req.cache, None)
        else:
            joining = [s.req for s in steps if self._row(s.req) is None]
            if joining:
                self._join(joining)
            hidden = self._forward(fwd, steps)
        logits = fwd.logits(hidden)
        for i, s in enumerate(steps):
            s.hidden, s.logits = hidden[i:i + 1], logits[i:i + 1]

    def _row(self, req) -> int | None:
        return next((i for i, r in enumerate(self.seats) if r is req), None)

    def _forward(self, fwd, steps: list[Step]) -> torch.Tensor:
        """One forward of every seated row, W columns wide (W = the widest step: one position, or a memory's
        slots); a row's own positions fill its last columns and the rest are masked (all of them for a seat
        without a step this round). The hidden states of `steps`, in their order [len(steps), H]."""
        width = max(s.embeds.shape[1] for s in steps)
        if self.width + width > self.cache.layers[0].max_cache_len:  # a larger bucket
            self.cache, self.mask, self.width = self._build(self._contents(), fwd.model, room=width)
        rows = [self._row(s.req) for s in steps]
        embeds = steps[0].embeds.new_zeros((len(self.seats), width, steps[0].embeds.shape[-1]))
        pos = steps[0].position
        positions = pos.new_zeros((*pos.shape[:-2], len(self.seats), width))
        for row, s in zip(rows, steps):
            w = s.embeds.shape[1]
            embeds[row, width - w:] = s.embeds[0]
            positions[..., row, :] = s.position[..., 0, :1]  # the masked columns repeat the first position
            positions[..., row, width - w:] = s.position[..., 0, :]
            self.mask[row, self.width + width - w:self.width + width] = 1
        self.width += width
        hidden, _ = fwd.step(embeds, positions, self.cache, self.mask[:, :self.width])
        self.forwards += 1
        self.rows_run += len(steps)
        return hidden[rows]

    @torch.no_grad()
    def leave(self, req) -> None:
        """`req` is done decoding: its row's keys and values go back to it (`req.cache`, a cache of the kind
        it came with: static for the compiled step, else dynamic). A last seat left alone gets its own
        cache back too (it then decodes alone, compiled). Nothing happens for a request without a seat."""
        self.pending = [s for s in self.pending if not (isinstance(s, Step) and s.req is req)]
        row = self._row(req)
        if row is None:
            return
        contents, seats = self._contents(), list(self.seats)
        out = [(seats.pop(row), contents.pop(row))]
        if len(seats) == 1:
            out.append((seats.pop(), contents.pop()))
        built = self._build(contents, req.fwd.model)
        caches = [self._own_cache(r, rows) for r, rows in out]
        self.seats, (self.cache, self.mask, self.width) = seats, built
        for (r, _), cache in zip(out, caches):
            r.cache = cache
            del self._static[id(r)]

    def clear(self) -> None:
        """Forget every seat and step (after a round that failed: their requests have failed)."""
        self.pending, self.seats, self._static = [], [], {}
        self.cache, self.mask, self.width = None, None, 0

    def _own_cache(self, req, rows):
        """A request's keys and values as a cache of its own, of the kind it came with."""
        cache = req.fwd.new_cache()
        for layer, (k, v) in enumerate(rows):
            cache.update(k, v, layer)
        return fit(cache, req.fwd.model, cache.get_seq_length() + 1) if self._static[id(req)] else cache

    def _join(self, reqs: list) -> None:
        """Give each of `reqs` a row, with the keys and values of its own cache (one rebuild for all)."""
        own = [_rows(r.cache, 0, slice(0, int(r.cache.get_seq_length()))) for r in reqs]
        built = self._build([*self._contents(), *own], reqs[0].fwd.model)
        for r in reqs:
            self._static[id(r)] = isinstance(r.cache, StaticCache)
            self.seats.append(r)
            r.cache = None  # the batch holds its keys and values until it leaves
        self.cache, self.mask, self.width = built

    def _contents(self) -> Rows:
        """Every seated row's keys and values, compact (its own columns only)."""
        if self.cache is None:
            return []
        return [_rows(self.cache, row, self.mask[row, :self.width].nonzero()[:, 0]) for row in
                range(self.mask.shape[0])]

    @staticmethod
    def _build(contents: Rows, model, room: int = 1) -> tuple[StaticCache | None, torch.Tensor | None, int]:
        """(cache, mask, width) holding `contents` (one entry per seat), right-aligned, with room for at least
        `room` more columns."""
        if not contents:
            return None, None, 0
        lengths = [row[0][0].shape[2] for row in contents]
        width = max(lengths)
        cache = static_cache(model, width + room)
        mask = torch.zeros((len(contents), cache.layers[0].max_cache_len), dtype=torch.long,
                           device=contents[0][0][0].device)
        for layer, new in enumerate(cache.layers):
            k0, v0 = contents[0][layer]
            new.lazy_initialization(k0.expand(len(contents), -1, -1, -1), v0.expand(len(contents), -1, -1, -1))
            for row, n in enumerate(lengths):
                k, v = contents[row][layer]
                new.keys[row, :, width - n:width] = k[0]
                new.values[row, :, width - n:width] = v[0]
            new.cumulative_length.fill_(width)
        for row, n in enumerate(lengths):
            mask[row, width - n:width] = 1
        return cache, mask, width

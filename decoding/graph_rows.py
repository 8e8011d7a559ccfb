"""Concurrent chat answers as rows of one graph step: continuous batching inside the step's static cache.

`GraphRows` holds a `decoding.graph.GraphStep` of B rows in rows mode: each row is its own request, a replay
writes the same columns of every row, and a row's positions are the columns its attention mask holds (`mask`,
with the host's copy `host_mask`), as in the loop's batch (`decoding/batch.py`). The request's values live in its
row of the sampler (`DeviceSampler.configure_row`); a replay runs the union of the seated rows' kinds, a row's
neutral values making the operations it lacks exact no-ops.

An answer (`GraphRows.stream`) reads its prompt on a cache of its own (chunked, `PrefillEvent`s between: the other rows
go on decoding; each chunk parked for the round, whose answers' chunks are read in one forward:
`decoding.prompt_reads`), then takes a free row: its keys and values are copied in, right-aligned at the step's current
column, and its first token is chosen at once. From then on, each round of the chat's worker it yields a `RowTurn`
(`Batch.park`); `Batch.run` hands the round's turns to `GraphRows.run`, one replay for every row, and the answer,
resumed, reads its token of the previous replay (one step late: the device is already busy with the next). A
`<recall>` read back has its query in the state of the replay that took it as input; the memory's slots and suffix
ride the next replays right-aligned in a span graph (several for a memory wider than the widest), while the other
rows decode their one token in the span's last column. A stop, an end or a failure frees the row: the
conversation's positions are copied out into its handle (`GraphCache`, held), which the next turn copies back in,
on this step, the single-row step or the loop.

What it takes (`GraphRows.takes`): unpadded text rows of one request whose processors all have a tensor form, no seed
(a seed promises `generate`'s draws, the loop's), no entropy decoding, guidance or mixture, no kept logits, and an
answer that fits the step's cache with a memory of `max_slots`. The cache is compacted (every row's columns
gathered, right-aligned again) when the next replay would not fit.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterator

import torch
from transformers import DynamicCache

from decoding.batch import Batch, Parked
from decoding.compiled import seq_length
from decoding.device_sampler import Kind, ReadBack
from decoding.events import DoneEvent, Event, PrefillEvent
from decoding.graph import GraphDecoder, unwrap_model
from decoding.graph_stream import TEXT, GraphCache, NoRoom, for_the_loop
from decoding.loop import prefill_embeds
from decoding.memory import Recall
from decoding.prompt_reads import PromptReader, PromptTurn
from decoding.request import Controls, Prompt, Request, prepare
from decoding.settings import GenerationSettings

log = logging.getLogger("decoding.graph_rows")


@dataclass(eq=False)
class RowTurn(Parked):
    """A row's part in the next replay: its pending token (none given), or a part of a memory's span."""

    runner: "GraphRows"
    row: int
    tokens: list[int] | None = None  # a span's part: its tokens, right-aligned in the replay's columns
    vectors: dict[int, torch.Tensor] = field(default_factory=dict)  # offset in `tokens` -> embedded vector [H]
    last: bool = True  # the span's last part: the token the replay chooses for this row is kept
    slot: int | None = None  # set by the run: the read-back slot of the replay
    hidden: torch.Tensor | None = None  # set by the run: the replay's final states [B, H] (a copy)


class GraphRows:
    """The rows of one graph step and what sits in them (driven on the chat worker's thread)."""

    def __init__(self, model: torch.nn.Module, rows: int = 8, **step_options):
        self.decoder = GraphDecoder(model, batch=rows, rows=True, **step_options)  # (its warm-up, ready, stop)
        self.graph = g = self.decoder.graph
        self.seated: list[Request | None] = [None] * rows  # the request decoding in each row
        self.joining: set[int] = set()  # rows taken by a request still reading its prompt
        self.kinds: list[Kind | None] = [None] * rows
        self.kind = Kind()  # what a replay runs: the union of the seated rows' kinds (kept as rows come and go)
        self.states: set[int] = set()  # rows whose requests may recall (the run keeps each replay's states)
        self.readback = ReadBack(g.sampler)
        self.replays = 0
        self.reader = PromptReader()  # the round's prompt chunks, in one forward
        self._ready = threading.Event()

    @property
    def ready(self) -> threading.Event:
        """Set once warmed up and every row free (after the warm-up's own `ready`: nothing is seated before)."""
        return self._ready

    @property
    def error(self) -> str | None:
        return self.decoder.error

    def stop(self) -> None:
        self.decoder.stop()

    @property
    def max_slots(self) -> int:
        return self.decoder.max_slots

    def warm_up(self, settings: tuple[GenerationSettings, ...] = (), eos: list[int] | None = None) -> float:
        seconds = self.decoder.warm_up(settings=settings, eos=eos)
        if self.decoder.ready.is_set():
            self._reset()
            self._ready.set()
        return seconds

    def _reset(self) -> None:
        """Every seated row free (an answer still reading its prompt keeps the row it took), the cache's layers at
        the step's column count (a forward that failed part-way moved some of them), the read-back ring from its
        first slot (the warm-up's commits moved it)."""
        g = self.graph
        for row in range(g.batch):
            if row not in self.joining:
                self.free(row)
        for layer in g.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(g.length)
        g.sampler.step.zero_()
        self.readback = ReadBack(g.sampler)

    def free_rows(self) -> int:
        return sum(r is None and i not in self.joining for i, r in enumerate(self.seated))

    # ----------------------------------------------------------------------------------- an answer

    def takes(self, prompt: Prompt, settings: GenerationSettings, recall: Recall | None, controls: Controls) -> bool:
        """Whether a row answers this request now (see the module's doc)."""
        inputs, g = prompt.inputs, self.graph
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        room = self.max_slots + len(recall.suffix) if recall is not None and recall.active else 0
        return (self.ready.is_set() and self.free_rows() > 0 and ids.shape[0] == 1
                and (mask is None or bool(mask.all())) and set(inputs) <= TEXT and settings.entropy_decoding is None
                and settings.guidance_scale == 1 and not settings.mixture.enabled and settings.seed is None
                and not controls.output_logits
                and ids.shape[1] + settings.max_new_tokens + room + g.spans[-1] < g.max_len)

    def stream(self, batch: Batch, prompt: Prompt, settings: GenerationSettings, recall: Recall | None, tokenizer,
               interrupt: threading.Event | None, controls: Controls,
               otherwise: Callable[[Prompt], Iterator[Event]]) -> Iterator[Event]:
        """The events of one answer, as `decoding.loop.stream_generate` gives them, decoded in a row, its turns
        parked in `batch` (the worker's); or `otherwise(prompt)`'s, the loop's, when its processors have no tensor
        form or no row is free any more when it starts."""
        g = self.graph
        req = prepare(g.model, prompt, settings, recall, tokenizer, controls, cached=False)
        kind = g.sampler.kind_of(req.processors, settings.do_sample)
        if kind is None or not self.free_rows():
            yield from otherwise(for_the_loop(prompt))
            return
        if interrupt is not None and interrupt.is_set():  # stopped while waiting in a queue: the cache stays
            req.cache = prompt.cache
            yield from req.stop_all()
            yield DoneEvent(req.result())
            return
        row = self.take()
        try:
            req.fwd.reset_request_state()
            yield from _answer(self, row, batch, req, prompt, kind, interrupt, controls)
        finally:
            if row in self.joining or self.seated[row] is req:  # (an answer that failed or was closed frees its row)
                self.free(row)
            req.fwd.reset_request_state()
        yield DoneEvent(req.result())

    # ----------------------------------------------------------------------------------- the rows' columns

    def take(self) -> int:
        row = next(i for i, r in enumerate(self.seated) if r is None and i not in self.joining)
        self.joining.add(row)
        return row

    def seat(self, row: int, req: Request, kv: list[tuple[torch.Tensor, torch.Tensor]], kind: Kind,
             states: bool) -> None:
        """Row `row` holds `req` from now on: its `n` positions' keys and values [1, heads, n, dim] a layer, right-
        aligned before the step's next column (the cache compacted first when it has fewer columns)."""
        g, n = self.graph, kv[0][0].shape[2]
        if n > g.length:
            self._compact(room=n)
        c = g.length
        for layer, (k, v) in zip(g.cache.layers, kv):
            layer.keys[row, :, c - n:c] = k[0]
            layer.values[row, :, c - n:c] = v[0]
        g.mask[row] = False
        g.mask[row, c - n:c] = True
        g.host_mask[row] = False
        g.host_mask[row, c - n:c] = True
        g.one.position[row] = n
        self.joining.discard(row)
        self.seated[row], self.kinds[row] = req, kind
        self.kind = Kind.union(k for k in self.kinds if k is not None)
        if states:
            self.states.add(row)

    def leave(self, row: int, keep: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Free the row; the first `keep` of its positions' keys and values (copies), for its conversation."""
        g = self.graph
        kv = []
        if keep > 0 and self.seated[row] is not None:
            columns = g.host_mask[row].nonzero()[:keep, 0].to(g.device)
            kv = [(layer.keys[row:row + 1, :, columns], layer.values[row:row + 1, :, columns])
                  for layer in g.cache.layers]
        self.free(row)
        return kv

    def free(self, row: int) -> None:
        self.seated[row], self.kinds[row] = None, None
        self.kind = Kind.union(k for k in self.kinds if k is not None)
        self.joining.discard(row)
        self.states.discard(row)
        self.graph.sampler.free_row(row)

    def room(self, row: int) -> int:
        """Columns the row holds."""
        return int(self.graph.host_mask[row].sum())

    def _compact(self, room: int = 0) -> None:
        """Every seated row's columns gathered and right-aligned again at the narrowest width (at least `room`); a
        free row attends to every column (what it holds is never read, but it stays finite)."""
        g = self.graph
        held = {r: g.host_mask[r].nonzero()[:, 0] for r, req in enumerate(self.seated) if req is not None}
        width = max([room, 1, *(len(c) for c in held.values())])
        moved = {r: [(layer.keys[r, :, c.to(g.device)].clone(), layer.values[r, :, c.to(g.device)].clone())
                     for layer in g.cache.layers] for r, c in held.items()}
        g.mask.zero_()
        g.host_mask.zero_()
        for r in range(g.batch):
            if r in moved:
                n = len(held[r])
                for layer, (k, v) in zip(g.cache.layers, moved[r]):
                    layer.keys[r, :, width - n:width] = k
                    layer.values[r, :, width - n:width] = v
                g.mask[r, width - n:width] = True
                g.host_mask[r, width - n:width] = True
            else:
                g.mask[r, :width] = True
                g.host_mask[r, :width] = True
        for layer in g.cache.layers:
            layer.cumulative_length.fill_(width)
        g.length = width

    # ----------------------------------------------------------------------------------- a round

    @torch.no_grad()
    def run(self, turns: list[RowTurn]) -> None:
        """One replay for every row: each turn's row its pending token or its span's part, a free row its own."""
        g = self.graph
        spans = {t.row: t for t in turns if t.tokens is not None}
        width = g._width(max(len(t.tokens) for t in spans.values())) if spans else 1
        if g.length + width > g.max_len:
            self._compact()
            if g.length + width > g.max_len:
                raise RuntimeError(f"the graph step's rows hold {g.length} of {g.max_len} columns after compacting: "
                                   f"no room for a replay of {width}")
        if spans:
            n = [width if self.seated[r] is None else len(spans[r].tokens) if r in spans else 1 for r in range(g.batch)]
            inputs = g.wide[width]
            staged = torch.zeros((g.batch, 2 * width + 2), dtype=torch.long)  # ids, flags, n, spanning: one copy
            for r, t in spans.items():
                k = len(t.tokens)
                staged[r, width - k:width] = torch.tensor(t.tokens)
                staged[r, width + width - k + torch.tensor(sorted(t.vectors), dtype=torch.long)] = 1
                staged[r, -1] = 1
            staged[:, -2] = torch.tensor(n)
            staged = staged.to(g.device, non_blocking=True)
            spanning = staged[:, -1] > 0
            inputs.ids.copy_(torch.where(spanning[:, None], staged[:, :width], g.one.ids))  # (others: their token last)
            inputs.flag.copy_(staged[:, width:2 * width] > 0)
            inputs.n.copy_(staged[:, -2])
            inputs.last.fill_(width - 1)
            for r, t in spans.items():
                if t.vectors:
                    order = sorted(t.vectors)
                    at = [width - len(t.tokens) + i for i in order]
                    inputs.vector[r, at] = torch.stack([t.vectors[i] for i in order]).to(inputs.vector.dtype)
            held = [r for r, t in spans.items() if not t.last]
            if held:
                g.sampler.held[held] = True
        else:
            inputs = g.one
        c = g.length
        try:
            with self.decoder.launch_guard():  # (the replay and what follows it on the device: no host sync)
                hidden, _ = g._run(inputs, self.kind)
                if spans and held:
                    g.sampler.held.fill_(False)
                slot = self.readback.pushed()
                states = hidden.clone() if self.states else None  # (a recall's query: the buffer is overwritten)
        except BaseException:  # the round fails, and every answer in it (`chat.worker`): the rows start over
            self._reset()
            raise
        if spans:
            for r in range(g.batch):
                g.host_mask[r, c + width - n[r]:c + width] = True
        else:
            g.host_mask[:, c] = True
        g.length += width
        self.replays += 1
        for t in turns:
            t.slot, t.hidden = slot, states


def _past(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A conversation's cached positions, keys and values [1, heads, n, dim] a layer (none: [])."""
    if isinstance(cache, GraphCache):
        return cache.layers() if cache.valid() else []
    if cache is None or any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        return []
    n = seq_length(cache)
    return [(layer.keys[:1, :, :n], layer.values[:1, :, :n]) for layer in cache.layers] if n else []


def _prefill(rows: GraphRows, batch: Batch, req: Request, prompt: Prompt, chunk: int,
             interrupt: threading.Event | None
             ) -> Generator[PrefillEvent | PromptTurn, None, tuple[DynamicCache, torch.Tensor] | None]:
    """The prompt past its cached positions on a cache of its own, `chunk` tokens a round (each chunk parked in
    `batch`: read with the round's other prompts); (the cache, the last state [1, H]), or None when stopped between
    chunks."""
    fwd, past = req.fwd, _past(prompt.cache)
    cache = fwd.new_cache()
    for i, (k, v) in enumerate(past):
        cache.update(k.clone(), v.clone(), i)
    start = past[0][0].shape[2] if past else 0
    if start >= req.prompt_len:
        raise ValueError(f"the cache covers {start} tokens but the prompt has only {req.prompt_len}")
    req.past_len = start
    embeds = prefill_embeds(fwd, req.input_ids, start, req.rows, req.recall)
    positions = fwd.positions(prompt.inputs, req.input_ids, None)[..., start:]
    todo, hidden = embeds.shape[1], None
    for s in range(0, todo, max(1, chunk)):
        e = min(todo, s + max(1, chunk))
        turn = PromptTurn(rows.reader, fwd, embeds[:, s:e], positions[..., s:e], cache)
        yield from batch.park(turn)
        cache, hidden = turn.cache, turn.hidden
        if e < todo:
            yield PrefillEvent(start + e, req.prompt_len)
            if interrupt is not None and interrupt.is_set():
                return None
    return cache, hidden


def _seat_answer(rows: GraphRows, row: int, batch: Batch, req: Request, prompt: Prompt, kind: Kind,
                 interrupt: threading.Event | None, prefill_chunk: int
                 ) -> Generator[PrefillEvent | PromptTurn, None, torch.Tensor | None]:
    """The prompt read on a cache of its own, then copied into the row, and the row's sampler set for the request;
    the prompt's last state [1, H], or None when stopped while reading."""
    g = rows.graph
    req.rows.seq = req.rows.seq.cpu()  # the criteria and the events read the host's copy
    read = yield from _prefill(rows, batch, req, prompt, prefill_chunk, interrupt)
    req.prefill_s = time.perf_counter() - req.t0
    if read is None:
        return None
    cache, hidden = read
    rows.seat(row, req, [(layer.keys, layer.values) for layer in cache.layers], kind, req.recall_on)
    g.sampler.configure_row(row, req.processors, do_sample=req.settings.do_sample,
                            seed=int(torch.randint(1 << 31, ())), prompt=req.prompt_len)  # (seeded: the loop's)
    if kind.sees:
        g.sampler.see(req.input_ids.to(g.device), rows=slice(row, row + 1))
    return hidden


def _span(rows: GraphRows, row: int, req: Request, tokens: list[int], vectors: dict[int, torch.Tensor]
          ) -> list[RowTurn]:
    """A memory's span (its slots and suffix, from the row's next position on) as the turns that ride the next
    replays, each at most the widest span graph, its value vectors embedded."""
    g = rows.graph
    slots = {p - req.rows.cur: v for p, v in vectors.items()}
    order = sorted(slots)
    embedded = dict(zip(order, req.recall.embed(torch.stack([slots[i] for i in order]), g.device, g.dtype))
                    ) if order else {}
    widest = g.spans[-1]
    return [RowTurn(rows, row, tokens[at:at + widest],
                    {i - at: e for i, e in embedded.items() if at <= i < at + widest}, last=at + widest >= len(tokens))
            for at in range(0, len(tokens), widest)]


def _answer(rows: GraphRows, row: int, batch: Batch, req: Request, prompt: Prompt, kind: Kind,
            interrupt: threading.Event | None, controls: Controls) -> Iterator[Event]:
    g, r = rows.graph, req.rows
    hidden = yield from _seat_answer(rows, row, batch, req, prompt, kind, interrupt, controls.prefill_chunk)
    if hidden is None:  # stopped while reading: the conversation keeps what it had
        req.cache = prompt.cache
        yield from req.stop_all()
        return
    t1 = time.perf_counter()
    max_new, made, queued = req.settings.max_new_tokens, 0, None
    parts: list[RowTurn] = []  # a memory's span, in parts, still to ride the next replays

    def recall(state: torch.Tensor) -> list[Event]:
        """Recall with the query state [H] at the newest position: the span's parts queued to ride the next
        replays; the events (the held `<recall>`, the recall, the span's tokens)."""
        nonlocal made
        tokens, vectors, events = req.recall_row(0, state)
        if rows.room(row) + len(tokens) + g.spans[-1] >= g.max_len:
            if vectors:  # (an empty memory, its close alone, records no injection)
                r.injections.pop()
            raise NoRoom(f"a memory of {len(tokens)} positions: the graph step's rows hold {g.max_len}")
        r.memory[0].update(vectors)
        parts.extend(_span(rows, row, req, tokens, vectors))
        made += len(tokens)
        return [*events, *req.add(tokens)]

    # A seated row rides every replay, so from its seat on the answer parks a turn each round before it yields
    # anything (the worker then advances it to its next turn each round): events are told after the launch.
    stopped, later = False, []
    try:
        if req.recall_on and int(req.input_ids[0, -1]) == req.recall.recall_id:  # the prompt ends with <recall>
            later = recall(hidden[0])
        else:
            first = g.sampler.choose(req.fwd.logits(hidden), kind, rows=slice(row, row + 1))
            g.sampler.commit_row(row, first, g.one.ids)
            made = 1
            later = req.add([int(first)])
        while r.alive[0]:
            if interrupt is not None and interrupt.is_set() and not parts:
                stopped = True
                break
            if parts:  # a span is forced whole, a part a replay (its token dropped but after the last part)
                turn = parts.pop(0)
                yield from batch.park(turn)
                queued = turn.slot if turn.last else None
                yield from later
                later = []
                continue
            if made >= max_new:  # (a span forced past the limit)
                later.append(r.finish(0, "length"))
                break
            launched = None
            if made + (queued is not None) >= max_new:  # the queued token is the last: nothing more is launched
                yield from later
                token, queued, later = rows.readback.read(queued)[row], None, []
            else:
                launched = RowTurn(rows, row)
                yield from batch.park(launched)  # the replay runs; then what is known is told, and the token of the
                yield from later                 # replay before it is read (one step late)
                later = []
                if r.held:  # the first token was `<recall>`: this replay took it, its state is the query
                    later = recall(launched.hidden[row])
                    continue
                before, queued = queued, launched.slot
                if before is None:
                    continue
                token = rows.readback.read(before)[row]
            made += 1
            later = req.add([token])
            if r.held and launched is not None:  # a `<recall>`: the replay that took it has its query state, and
                queued = None  # the token it chose after it is dropped
                later += recall(launched.hidden[row])
    except NoRoom as e:  # the answer ends where the step's cache does, before the `<recall>` it could not read
        log.warning("the answer ends at the graph step's cache (model.graph_max_len): %s", e)
        later.append(req.out_of_room())
    if stopped:
        later += list(req.interrupted())
    # the row is left before the last events are told: an answer that never parked a turn is advanced one event
    # a round, and a seated row rides every replay (its columns would hold what it never wrote)
    keep = min(r.cur - 1, rows.room(row))  # as the loop's: all but the last token (what the row holds of them)
    if req.no_memory is not None:  # NoMemory ran in the graph: its record is on the device (the row's own commits)
        req.no_memory.wanted, req.scored = [g.sampler.wanted_at[row:row + 1] < req.steps], None
    kv = rows.leave(row, keep)
    req.cache = GraphCache(g, keep, held=kv) if kv else None
    req.decode_s = time.perf_counter() - t1
    yield from later


_ATTR = "_recall_graph_rows"


def enable_rows(model: torch.nn.Module, rows: int = 8, max_slots: int = 128, **step_options) -> GraphRows:
    """Attach `GraphRows` of `rows` rows to the model (not warmed up); the chat's engine answers its concurrent
    requests in them from then on."""
    base = unwrap_model(model)
    runner = getattr(base, _ATTR, None)
    if runner is None:
        runner = GraphRows(model, rows=rows, **step_options)
        object.__setattr__(base, _ATTR, runner)
    runner.decoder.max_slots = max_slots
    return runner


def attached_rows(model: torch.nn.Module) -> GraphRows | None:
    return getattr(unwrap_model(model), _ATTR, None)

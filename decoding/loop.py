"""The generation loop with recall (seeds 000 and 001): prefill, then one token a step.

A row recalls when its newest input token is `<recall>` (also when the prompt ends with one): the
hidden state at that position queries the memory head, the next tokens are forced to the memory's
k `<|memory_pad|>` slots (and `Recall.suffix`), and the memory's k value vectors are those slots'
input embeddings in the next forward, which runs all k positions at once on the same KV cache.
Each `<recall>` is the newest input token exactly once, so it fires once (the seed's `recall_pending`).

A step that forwards more than one position for some row (a memory's span) gives the other rows of
a padded batch that many columns too, masked but for their own token in the last one, so every
row's newest state stays in the last column.

A step reads the device once (`tolist()` of the new tokens and the unfinished flags; entropy
decoding reads its layer choice right after, for the `LayerEvent`s); the rest stays on the device.
The request's state (cache, processors, rows) is built in `decoding/request.py`, entropy
decoding's per-step work (seed 002) lives in `decoding/entropy.py`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Generator, Iterator, Mapping

import torch

from decoding.batch import Batch
from decoding.compiled import crop
from decoding.events import DoneEvent, Event, GenerationResult, PrefillEvent
from decoding.backend import Backend
from decoding.forward import vision_suffix
from decoding.memory import Recall
from decoding.request import Controls, Prompt, Request, Rows, prepare
from decoding.sampling import sample
from decoding.settings import GenerationSettings

log = logging.getLogger("decoding.loop")


def prefill_embeds(fwd: Backend, input_ids: torch.Tensor, past_len: int, rows: Rows,
                    recall: Recall | None) -> torch.Tensor:
    """Token embeddings of the uncached prompt [B, S, H], memory vectors at their <|memory_pad|> positions."""
    emb = fwd.embed(input_ids[:, past_len:])
    for row, vectors in enumerate(rows.memory):
        for pos, vec in vectors.items():
            if int(input_ids[row, pos]) != recall.memory_pad_id:
                raise ValueError(f"memory vector given for position {pos} of row {row}, which holds token "
                                 f"{int(input_ids[row, pos])}, not <|memory_pad|>")
            if pos >= past_len:
                emb[row, pos - past_len] = recall.embed(vec[None], fwd.device, fwd.dtype)[0]
    return emb


Span = tuple[list[int], dict[int, torch.Tensor]]  # a recalling row's forced tokens, and its slots' value vectors


def _recall(req: Request, recall_rows: list[int], hidden: torch.Tensor) -> tuple[dict[int, Span], list[Event]]:
    """The recall step (`Request.recall_row`) of each row whose newest input is <recall>: the tokens it is forced to
    next (its memory's slots and the suffix) and the slots' value vectors."""
    spans: dict[int, Span] = {}
    events: list[Event] = []
    for row in recall_rows:
        tokens, vectors, happened = req.recall_row(row, hidden[row])
        spans[row] = tokens, vectors
        events += happened
    return spans, events


def _widths(spans: dict[int, Span], batch: int) -> list[int]:
    """New positions of each row this step: its span's length, or 1 (its sampled token)."""
    return [len(spans[r][0]) if r in spans else 1 for r in range(batch)]


def _columns(rows: Rows, next_tokens: torch.Tensor, spans: dict[int, Span], filler: int) -> torch.Tensor:
    """Write the step's new columns [B, W] into the rows and return them: each row's sampled token, or its
    forced span, right-aligned (its slots' vectors recorded at their columns); rows with fewer tokens than
    W get masked `filler` columns first."""
    widths = _widths(spans, len(next_tokens))
    width = max(widths)
    block = next_tokens[:, None].repeat(1, width)
    block[:, :-1] = filler
    for row, (tokens, vectors) in spans.items():
        shift = width - len(tokens)
        block[row, shift:] = torch.tensor(tokens, device=block.device)
        rows.memory[row].update({p + shift: v for p, v in vectors.items()})
    rows.write(block, [width - w for w in widths])
    return block


def _step_inputs(fwd: Backend, rows: Rows, recall: Recall | None, block: torch.Tensor, position: torch.Tensor,
                 spans: dict[int, Span]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embeddings [B, W, H], position ids [B, W] or [4, B, W]) of the step's columns: memory
    slots carry their value vectors, every row's positions continue its own, right-aligned."""
    width = block.shape[1]
    emb = fwd.embed(block)  # [B, W, H]
    start = rows.cur - width
    for row in spans:
        slots = [c for c in range(width) if start + c in rows.memory[row]]
        if slots:  # (an empty memory, its close alone, has none)
            vectors = torch.stack([rows.memory[row][start + c] for c in slots])  # [k, H]
            emb[row, slots] = recall.embed(vectors, fwd.device, fwd.dtype)
    counts = torch.tensor(_widths(spans, block.shape[0]), device=position.device)
    steps = torch.arange(1, width + 1, device=position.device) - (width - counts)[:, None]  # [B, W]
    return emb, position + steps.clamp(min=1).to(position.dtype)  # fillers (masked) repeat the first position


def _log_injections(req: Request, spans: dict[int, Span], emb: torch.Tensor, hidden: torch.Tensor,
                    logits: torch.Tensor | None) -> torch.Tensor:
    """Seed 001's debug log of each injection of a step, once the forward that read it ran: the memory and its
    similarity, its slots, the input embeddings its value vectors became (shape, dtype, device), the growth of the
    KV cache it was read on, and the shape of that forward's logits. Returns those logits: computed here when the
    backend leaves them to the next step, which then uses them (entropy decoding's: its final layer's, for the log)."""
    if logits is None:
        logits = req.fwd.logits(hidden if req.entropy is None else hidden[:, -1])
    width, cur = emb.shape[1], req.rows.cur
    read = sum(1 for _, vectors in spans.values() if vectors)  # (an empty memory injects nothing)
    for e in req.rows.injections[len(req.rows.injections) - read:]:
        shift = width - len(spans[e.row][0])
        slots = emb[e.row, shift:shift + e.length]  # [k, H]
        log.info("[inject] row %d: memory %d (similarity %.4f) fills the %d <|memory_pad|> slots from position %d; "
                 "its value vectors are input embeddings %s %s on %s of a forward of %d positions on the existing KV "
                 "cache: KV cache and attention %d -> %d positions; logits after it %s", e.row, e.memory_index,
                 e.score, e.length, e.position, tuple(slots.shape), slots.dtype, slots.device, width, cur - width, cur,
                 tuple(logits.shape))
    return logits


def stream_generate(model: torch.nn.Module, prompt: Prompt | Mapping[str, torch.Tensor],
                    settings: GenerationSettings = GenerationSettings(), *, recall: Recall | None = None,
                    tokenizer=None, interrupt: threading.Event | None = None, controls: Controls = Controls(),
                    batch: Batch | None = None) -> Iterator[Event]:
    """Generate from a prompt (`Prompt`, or its inputs alone: `input_ids` [B, L], optional `attention_mask`,
    Qwen3-VL image kwargs), yielding token, recall and finish events, and a `DoneEvent` with the result last.

    `prompt.cache` covers a prefix of `input_ids` (an earlier turn): only the rest is prefilled; its
    `memory_vectors` are placed again at their `<|memory_pad|>` positions. `controls` (`Controls`) brings
    the caller's processors and criteria, EOS / padding, `output_logits` (each step's raw logits in the
    result's `logits`, [B, steps, V]) and `prefill_chunk`: a long unpadded text prompt is prefilled that many
    tokens at a time, with a `PrefillEvent` and an interrupt check between chunks, so a stop ends even a long
    prompt within one chunk.

    With `settings.entropy_decoding` (seed 002, `decoding/entropy.py`) each step decodes from the
    layer its entropy rule picks: a `LayerEvent` follows every `TokenEvent`, the result's `entropy`
    holds the per-step record, and `logits` are the selected layer's. A caller's `logits_processor`
    then scores [B*L] rows at once (each row's ids repeated per layer, row b*L + i is layer i).

    With a `batch` (`decoding/batch.py`) a request of one unpadded row decodes in it: each decode
    forward is a `Step` yielded to the caller, who runs the batch with the other requests' steps
    before resuming this one.
    """
    if settings.mixture.enabled:
        raise ValueError("settings.mixture.enabled: the two-model mixture runs in decoding.stream_mixture, "
                         "not in this loop")
    prompt = Prompt.of(prompt)
    req = prepare(model, prompt, settings, recall, tokenizer, controls)
    if interrupt is not None and interrupt.is_set():  # stopped while waiting in a queue: the model is not touched
        yield from req.stop_all()
        yield DoneEvent(req.result())
        return
    req.fwd.reset_request_state()
    try:
        yield from _generate(req, prompt.inputs, interrupt, controls, batch)
    finally:
        req.fwd.reset_request_state()
    yield DoneEvent(req.result())


@torch.no_grad()  # as a decorator: grad mode is off only while the loop runs, never left off between its yields
def _generate(req: Request, inputs: Mapping[str, torch.Tensor], interrupt: threading.Event | None,
              controls: Controls, batch: Batch | None) -> Iterator[Event]:
    start = yield from _prefill(req, inputs, interrupt, controls.prefill_chunk)  # None: stopped between chunks
    if start is not None:
        yield from _decode(req, *start, interrupt, controls.output_logits, batch)


def read_prompt(model: torch.nn.Module, prompt: Prompt, *, controls: Controls = Controls(),
                interrupt: threading.Event | None = None) -> Generator[PrefillEvent, None, Any]:
    """Read a prompt into its KV cache and choose nothing: the uncached part of `prompt` is prefilled as
    `stream_generate` prefills it (in `controls.prefill_chunk` chunks, a `PrefillEvent` and a stop check between
    them). Returns (as a generator's value) the cache, which then covers the whole prompt, or None when a stop
    came first (the cache then holds a prefix of it). The chat reads a message's prompt (all but its last token)
    while its memory work runs on another thread; the answer then prefills one token."""
    prompt = Prompt.of(prompt)
    req = prepare(model, prompt, GenerationSettings(max_new_tokens=1), None, None, controls)
    req.fwd.reset_request_state()
    reading = _prefill(req, prompt.inputs, interrupt, controls.prefill_chunk)
    try:
        while True:
            with torch.no_grad():  # (only while reading: never left off between the yields)
                event = next(reading)
            if isinstance(event, PrefillEvent):  # (a stop's finish events are the answer's to give, not the read's)
                yield event
    except StopIteration as done:
        return req.cache if done.value is not None else None
    finally:
        req.fwd.reset_request_state()


def _prefill(req: Request, inputs: Mapping[str, torch.Tensor], interrupt: threading.Event | None,
             prefill_chunk: int) -> Iterator[Event]:
    """1. Prefill the uncached part of the prompt, memory vectors at their positions; returns (the last
    position's state, its logits when the backend gives them, its position ids), or None when a stop came between chunks (the cache keeps the prefix)."""
    fwd, rows = req.fwd, req.rows
    positions = fwd.positions(inputs, req.input_ids, req.attention_mask)[..., req.past_len:]
    embeds = prefill_embeds(fwd, req.input_ids, req.past_len, rows, req.recall)
    vision = vision_suffix(inputs, req.past_len, fwd.device)
    todo = embeds.shape[1]
    chunk = todo if vision or req.attention_mask is not None else max(1, prefill_chunk)  # images stay whole
    for start in range(0, todo, chunk):
        end = min(todo, start + chunk)
        hidden, logits = fwd.prefill(embeds[:, start:end], positions[..., start:end], req.cache, req.attention_mask,
                                     vision, layers=req.entropy is not None and end == todo)
        if end < todo:
            yield PrefillEvent(req.past_len + end, req.prompt_len)
            if interrupt is not None and interrupt.is_set():
                yield from req.stop_all()
                req.prefill_s = time.perf_counter() - req.t0
                return None
    req.prefill_s = time.perf_counter() - req.t0
    return hidden, logits, positions[..., -1:]  # [B, H] (entropy decoding: [B, L, H]), [B, V] or None, [B, 1] or [4, B, 1]


def _next_scores(req: Request, hidden: torch.Tensor, logits: torch.Tensor | None):
    """(raw logits [B, V], processed scores [B, V], final-layer state [B, H], the entropy step or None);
    `logits` when the batch already computed them.

    With entropy decoding `hidden` holds every layer's state [B, L, H] and the scores are the chosen
    layer's; the final layer's state stays the memory head's query.
    """
    seen = req.rows.seq[:, :req.rows.cur]
    if req.entropy is None:
        logits = req.fwd.logits(hidden) if logits is None else logits  # [B, V]
        return logits, req.processors(seen, logits) if req.processors else logits, hidden, None
    step = req.entropy.step(hidden, seen, req.processors)
    return step.logits, step.scores, hidden[:, -1], step


def _decode(req: Request, hidden: torch.Tensor, logits: torch.Tensor | None, position: torch.Tensor,
            interrupt: threading.Event | None, output_logits: bool, batch: Batch | None) -> Iterator[Event]:
    """Steps 2-5, one token a row a step, until every row finished or a stop."""
    rows, fwd, recall, entropy = req.rows, req.fwd, req.recall, req.entropy
    t1 = time.perf_counter()
    last = req.input_ids[:, -1].tolist()
    recall_rows = [r for r in range(req.batch) if req.recall_on and last[r] == recall.recall_id]
    unfinished = torch.ones(req.batch, dtype=torch.bool, device=fwd.device)
    if req.batch > 1 or req.attention_mask is not None or entropy is not None or not fwd.joins_batch(req.cache):
        batch = None  # a batch takes requests of one unpadded row decoding from the final layer, on caches it can seat
    stopped = False
    try:
        while True:
            # 2. the next token of every row
            logits, scores, hidden, layer_step = _next_scores(req, hidden, logits)
            if output_logits:
                req.kept_logits.append(logits)
            next_tokens = sample(scores, req.settings.do_sample, req.rng)  # [B]

            # 3. the recall step: rows whose newest input was <recall> get their memory's slots (and suffix)
            spans, events = _recall(req, recall_rows, hidden) if recall_rows else ({}, [])
            if req.eos:
                next_tokens = torch.where(unfinished, next_tokens, req.pad)
            block = _columns(rows, next_tokens, spans, req.pad)  # [B, W], written into the rows
            unfinished &= ~req.criteria(rows.seq[:, :rows.cur], scores)
            tokens = torch.cat((block, unfinished.long()[:, None]), dim=1).tolist()  # the one sync
            still = [row.pop() for row in tokens]
            req.steps += 1

            # 4. events and finish reasons (`Request.events`); a <recall> is streamed with its recall, next step
            alive = list(rows.alive)
            for row, width in enumerate(_widths(spans, req.batch)):
                if alive[row]:
                    events += req.events(row, tokens[row][len(tokens[row]) - width:], bool(still[row]))
                    if not rows.alive[row]:  # (a tool call ended it: no more tokens)
                        unfinished[row] = False
            if layer_step is not None:  # a LayerEvent after each token (one more host copy, after the sync)
                events = entropy.annotate(events, layer_step, alive, [rows.cur - w for w in _widths(spans, req.batch)])
            yield from events
            if not any(rows.alive):
                break
            if interrupt is not None and interrupt.is_set():
                stopped = True
                break

            # 5. forward the new columns; value vectors replace the <|memory_pad|> embeddings
            recall_rows = [r for r in range(req.batch)
                           if req.recall_on and rows.alive[r] and tokens[r][-1] == recall.recall_id]
            emb, positions = _step_inputs(fwd, rows, recall, block, position, spans)  # [B, W, H], [.., B, W]
            position = positions[..., -1:]
            req.cache = fwd.cache_for(req.cache, rows.cur, True)  # a full static cache moves to the next bucket
            if batch is not None:  # run by the batch, with other requests' steps
                hidden, logits = yield from batch.step(req, emb, positions)
            else:
                hidden, logits = fwd.step(emb, positions, req.cache, None if rows.mask is None else
                                          rows.mask[:, :rows.cur], layers=entropy is not None)
            if spans and recall.settings.debug:
                logits = _log_injections(req, spans, emb, hidden, logits)
    finally:
        if batch is not None:
            batch.leave(req)  # its keys and values come back to `req.cache`
    if stopped:
        _drop_held(rows, req.cache, req.pad)
        yield from req.stop_all()
    req.decode_s = time.perf_counter() - t1


def _drop_held(rows: Rows, cache, pad: int) -> None:
    """Stopped right after <recall>: the recall never started, so its token is dropped."""
    if not rows.held:
        return
    if rows.seq.shape[0] == 1:
        rows.cur -= 1
        crop(cache, 1)  # the cache covers all but the last token, as always
    else:
        rows.seq[list(rows.held), rows.cur - 1] = pad
    rows.held.clear()


def generate(*args, **kwargs) -> GenerationResult:
    """`stream_generate` run to the end."""
    for event in stream_generate(*args, **kwargs):
        if isinstance(event, DoneEvent):
            return event.result
    raise RuntimeError("generation ended without a result")

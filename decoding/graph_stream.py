"""The chat's answers on the graph step: `Engine` hands a request to `stream_graph` (and a read to `read_graph`) when
its model has a warmed-up `GraphDecoder` attached (`decoding.graph.enable`: on a CUDA device at start,
`model.graph_step`) and the step can take it.

The request is resolved by `decoding.request.prepare`, as the loop's is (processors, criteria, EOS, rows,
detokenizers), and its lifecycle is the loop's: each block of read-back tokens becomes events and finish reasons
through `Request.events`, a `<recall>` gets its memory through `Request.recall_row`, a stop ends every row, and
the result is `Request.result`. The tokens come from `decoding.graph_loop.HostLoop`, a step behind the device;
the stopping criteria (stop strings, max_time) run over the host's copy of the sequence, so the device never
waits for them.

The KV cache is the step's one static cache, which one conversation owns at a time. A result holds a
`GraphCache`, the conversation's handle on its positions there: the next turn of the same conversation prefills
only its new tokens. When another conversation takes the step, the owner's positions are copied out into its
handle first (`GraphStep.release`: a copy of its keys and values, far cheaper on a GPU than reading the prompt
again), and copied back when it next answers on the step; the loop's cache of an earlier turn is copied in the same
way, and a turn the loop answers gets the handle's positions as a cache of its own (`for_the_loop`).

Images are read at prefill as the loop reads them (Qwen3-VL's vision kwargs and mRoPE positions); the decode
steps then add the rotary offset they left (`GraphStep.delta`).

What the step does not take goes to `otherwise` (`Engine`: the rows of `decoding.graph_rows` when they take it,
else the loop): a request while the step serves another, a video, entropy decoding, guidance, the mixture, rows of
a batch, and a prompt whose answer could outgrow the step's cache.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from typing import Callable, Generator, Iterator

import torch
from transformers import DynamicCache

from decoding.compiled import seq_length
from decoding.events import DoneEvent, Event, PrefillEvent, RecallEvent
from decoding.graph import GraphDecoder, GraphStep
from decoding.graph_loop import Decoded, HostLoop
from decoding.forward import prefill_positions, vision_suffix
from decoding.loop import prefill_embeds
from decoding.memory import Recall
from decoding.request import Controls, Prompt, Request, prepare
from decoding.settings import GenerationSettings


log = logging.getLogger("decoding.graph_stream")


class NoRoom(ValueError):
    """A recalled memory does not fit in what is left of the step's cache."""


@dataclasses.dataclass(eq=False)
class GraphCache:
    """A conversation's KV cache on a graph step, its first `length` positions: in the step's static cache while
    the conversation owns it (`resident`), else `held` here (keys and values [1, heads, length, dim] a layer,
    copied out when another conversation took the step: `GraphStep.release`)."""

    step: GraphStep
    length: int
    held: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def resident(self) -> bool:
        return self.step.owner is not None and self.step.owner() is self

    def valid(self) -> int:
        """Positions it holds: `length`, resident or held; 0 for a handle a later one of its conversation replaced."""
        return self.length if self.held is not None or self.resident() else 0

    def hold(self) -> None:
        self.held = [(k.clone(), v.clone()) for k, v in self.layers()]

    def own(self) -> None:
        """Become the step's owner (its positions are in the static cache)."""
        self.held, self.step.owner = None, weakref.ref(self)

    def cut(self, keep: int) -> None:
        if keep >= self.length:
            return
        self.length = keep
        if self.held is not None:  # (copies: a view would keep the whole of what was held alive)
            self.held = [(k[:, :, :keep].clone(), v[:, :, :keep].clone()) for k, v in self.held]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values [1, heads, length, dim] a layer (of the static cache, when resident)."""
        if self.held is not None:
            return self.held
        return [(layer.keys[:, :, :self.length], layer.values[:, :, :self.length]) for layer in self.step.cache.layers]


def for_the_loop(prompt: Prompt) -> Prompt:
    """The prompt as the loop takes it: a graph handle becomes a cache of the loop's own (a copy of its positions)."""
    handle = prompt.cache
    if not isinstance(handle, GraphCache):
        return prompt
    if not handle.valid():
        return dataclasses.replace(prompt, cache=None)
    cache = DynamicCache(config=handle.step.config)
    kv = handle.held if handle.held is not None else [(k.clone(), v.clone()) for k, v in handle.layers()]
    for i, (k, v) in enumerate(kv):  # (a resident handle's are views of the step's cache: copied)
        cache.update(k, v, i)
    return dataclasses.replace(prompt, cache=cache)


TEXT = {"input_ids", "attention_mask"}
IMAGES = {"pixel_values", "image_grid_thw", "mm_token_type_ids"}


def takes(decoder: GraphDecoder, prompt: Prompt, settings: GenerationSettings, recall: Recall | None) -> bool:
    """Whether the step answers this request now (else the loop does). A seeded draw is the loop's (`generate`'s
    draws for the seed); the answer, a recalled memory of up to `decoder.max_slots` slots forced whole past it, and
    the padding of the widest span must fit in the step's cache."""
    inputs, g = prompt.inputs, decoder.graph
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    room = decoder.max_slots + len(recall.suffix) if recall is not None and recall.active else 0
    return (not decoder.busy and ids.shape[0] == g.batch and (mask is None or bool(mask.all()))
            and set(inputs) <= TEXT | IMAGES and settings.entropy_decoding is None
            and settings.guidance_scale == 1 and not settings.mixture.enabled
            and not (settings.do_sample and settings.seed is not None)
            and ids.shape[1] + settings.max_new_tokens + room + g.spans[-1] < g.max_len)


def reads(decoder: GraphDecoder, prompt: Prompt) -> bool:
    """Whether the step reads this prompt ahead now (a text prompt)."""
    ids = prompt.inputs["input_ids"]
    return (not decoder.busy and set(prompt.inputs) <= TEXT and ids.shape[0] == decoder.graph.batch
            and ids.shape[1] + 1 < decoder.graph.max_len)


def _seat(g: GraphStep, cache) -> int:
    """Put a conversation's cache (its graph handle, or the loop's cache of an earlier turn) in the step's static
    cache, the previous owner's positions copied out first; the positions it covers (0: none to reuse)."""
    if isinstance(cache, GraphCache) and cache.step is g and cache.resident():
        return cache.length
    g.release()
    if isinstance(cache, GraphCache):
        # (a handle of this step, or one held: the rows' step's, `decoding.graph_rows`)
        usable = cache.valid() and (cache.step is g or cache.held is not None)
        kv, n = (cache.layers(), cache.length) if usable else ([], 0)
    elif cache is not None and not any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        n = seq_length(cache)
        kv = [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in cache.layers]
    else:
        kv, n = [], 0
    if not n or not all(layer.is_initialized for layer in g.cache.layers):
        return 0
    for layer, (k, v) in zip(g.cache.layers, kv):
        layer.keys[:, :, :n].copy_(k)
        layer.values[:, :, :n].copy_(v)
        layer.cumulative_length.fill_(n)
    g.length = n
    if isinstance(cache, GraphCache) and cache.step is g:
        cache.own()  # (its positions are in the step again: what it held is let go)
    return n  # (a handle of the rows' step stays as it was: the answer or read makes one of this step)


def _prefill(g: GraphStep, embeds: torch.Tensor, positions: torch.Tensor, vision: dict, past: int, total: int,
             chunk: int, interrupt: threading.Event | None) -> Generator[PrefillEvent, None, tuple | None]:
    """Read prompt embeddings [1, S, H] (position ids [.., 1, S]) from position `past`, `chunk` a forward (a prompt
    with images in one), a `PrefillEvent` and a stop check between chunks; (the last state, its logits), or None
    when stopped (the step then holds a prefix)."""
    todo = embeds.shape[1]
    chunk = todo if vision else max(1, chunk)
    for start in range(0, todo, chunk):
        end = min(todo, start + chunk)
        with torch.no_grad():
            out = g.prefill(embeds[:, start:end], past + start, positions[..., start:end], vision)
        if end < todo:
            yield PrefillEvent(past + end, total)
            if interrupt is not None and interrupt.is_set():
                return None
    return out


def read_graph(decoder: GraphDecoder, prompt: Prompt, interrupt: threading.Event | None,
               chunk: int) -> Generator[PrefillEvent, None, GraphCache | None]:
    """`Engine.read` on the step: the prompt (all of it past what its cache covers; it places no memory vector, as
    the chat reads only prompts whose vectors are cached) into the step; its handle, or None when stopped between
    chunks (the cache given then still covers what it did)."""
    g, ids = decoder.graph, prompt.inputs["input_ids"].to(decoder.graph.device)
    try:
        decoder.busy = True
        past = _seat(g, prompt.cache)
        if past >= ids.shape[1]:
            raise ValueError(f"the cache covers {past} tokens but the prompt has only {ids.shape[1]}")
        positions = prefill_positions(g.backbone, prompt.inputs, ids, None)[..., past:]
        done = yield from _prefill(g, g.embed(ids[:, past:]), positions, {}, past, ids.shape[1], chunk, interrupt)
    finally:
        decoder.busy = False
    if done is None:
        return None
    handle = GraphCache(g, ids.shape[1])
    handle.own()
    return handle


def stream_graph(decoder: GraphDecoder, prompt: Prompt, settings: GenerationSettings, recall: Recall | None,
                 tokenizer, interrupt: threading.Event | None, controls: Controls,
                 otherwise: Callable[[Prompt], Iterator[Event]]) -> Iterator[Event]:
    """The events of one answer, as `decoding.loop.stream_generate` gives them, decoded on the step; or, when the
    step cannot take it at the moment it starts, `otherwise(prompt)`'s (the loop's)."""
    if not takes(decoder, prompt, settings, recall):
        yield from otherwise(for_the_loop(prompt))
        return
    req = prepare(decoder.graph.model, prompt, settings, recall, tokenizer, controls, cached=False)
    if interrupt is None or not interrupt.is_set():
        try:
            decoder.busy = True
            req.fwd.reset_request_state()
            yield from _answer(decoder, req, prompt, interrupt, controls)
        finally:
            decoder.busy = False
            req.fwd.reset_request_state()
    else:  # stopped while waiting in a queue: the step is not touched, the conversation keeps its cache
        req.cache = prompt.cache
        yield from req.stop_all()
    yield DoneEvent(req.result())


def _answer(decoder: GraphDecoder, req: Request, prompt: Prompt, interrupt: threading.Event | None,
            controls: Controls) -> Iterator[Event]:
    g, rows = decoder.graph, req.rows
    req.past_len = past = _seat(g, prompt.cache)
    if past >= req.prompt_len:
        raise ValueError(f"the cache covers {past} tokens but the prompt has only {req.prompt_len}")
    embeds = prefill_embeds(req.fwd, req.input_ids, past, rows, req.recall)
    positions = req.fwd.positions(prompt.inputs, req.input_ids, None)[..., past:]
    vision = vision_suffix(prompt.inputs, past, g.device)
    rows.seq = rows.seq.cpu()  # the criteria and the events read the host's copy
    start = yield from _prefill(g, embeds, positions, vision, past, req.prompt_len, controls.prefill_chunk, interrupt)
    req.cache = GraphCache(g, past)
    req.prefill_s = time.perf_counter() - req.t0
    if start is None:
        req.cache.length = g.length
        req.cache.own()
        yield from req.stop_all()
        return
    t1 = time.perf_counter()
    told: list[Event] = []  # a recall's events (the held `<recall>`, the recall), told with its span

    def recaller(state: torch.Tensor, position: int):
        tokens, vectors, events = req.recall_row(0, state)
        event = events[-1] if events and isinstance(events[-1], RecallEvent) else None  # (None: an empty memory)
        if not g.room_for(len(tokens)):  # a memory longer than `max_slots` near the end of the step's cache
            if event is not None:
                rows.injections.pop()
            raise NoRoom(f"a memory of {len(tokens)} positions at position {position}: the graph step holds "
                         f"{g.max_len}")
        rows.memory[0].update(vectors)
        told.extend(events)
        return tokens, vectors, event

    out = Decoded([], "length")
    run = HostLoop(g, req.input_ids, req.settings, req.recall if req.recall_on else None, req.eos, req.pad,
                   controls.output_logits, out, processors=req.processors, recaller=recaller)
    blocks = run.tokens(*start, None, decoder.launch_guard)
    stopped = False
    try:
        for new, _ in blocks:  # a sampled token, or a memory's forced span
            events, told[:] = [*told, *req.add(new)], []
            yield from events
            if not rows.alive[0]:
                break
            if interrupt is not None and interrupt.is_set():
                stopped = True
                break
        else:  # the host loop ended on its own (the step's cache is full)
            if rows.alive[0]:
                yield rows.finish(0, "length")
    except NoRoom as e:  # the answer ends where its cache does, before the `<recall>` it could not read
        log.warning("the answer ends at the graph step's cache (model.graph_max_len): %s", e)
        told.clear()
        yield req.out_of_room()
    finally:
        blocks.close()
    if stopped:
        yield from req.interrupted()
    req.cache.length = rows.cur - 1  # as the loop's: all but the last token
    req.cache.own()
    req.kept_logits, req.scored = out.logits[:req.steps], req.steps  # (not the step launched after the last read)
    if req.no_memory is not None and run.kind is not None:  # NoMemory ran in the graph: its record is on the device
        req.no_memory.wanted, req.scored = [g.sampler.wanted_at < req.steps], None
    req.decode_s = time.perf_counter() - t1

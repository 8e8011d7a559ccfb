"""The graph decoder's host loop (`decoding.graph.GraphDecoder.stream`): one request on a `GraphStep`, launching
step n + 1 before it reads step n's tokens back, recalls included, and what it reports (`Decoded`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from transformers import LogitsProcessorList

from decoding.device_sampler import ReadBack
from decoding.events import RecallEvent
from decoding.memory import MemorySelector, Recall, recall_step
from decoding.processors import build_logits_processor
from decoding.sampling import draw
from decoding.settings import GenerationSettings


# (the query state [H], the position after `<recall>`) -> the memory's tokens, their vectors by position, its event
Recaller = Callable[[torch.Tensor, int], tuple[list[int], dict[int, torch.Tensor], RecallEvent | None]]


@dataclass
class Decoded:
    """What `GraphDecoder.generate` made: per row its new tokens (sampled and forced), and how it ended."""

    tokens: list[list[int]]
    finish: str  # stop (every row at EOS) | length | interrupted
    recalls: list = field(default_factory=list)  # RecallEvent of each injection
    memory_vectors: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> value vector (row 0)
    logits: list[torch.Tensor] = field(default_factory=list)  # with keep_logits: [B, V] of each sampled step
    positions: list[int] = field(default_factory=list)  # with keep_logits: the position each of them scored from
    steps: int = 0  # replays launched (a dropped step, one after the stop, included)
    ttft: float = 0.0  # seconds to the first token on the host


class HostLoop:
    """One request on `g`, a `decoding.graph.GraphStep`: the sampler configured for its processors (or the host-side fallback), the
    sequence so far (`cur` positions), its recalls, and what it reports into `out`."""

    def __init__(self, g, input_ids: torch.Tensor, settings: GenerationSettings, recall: Recall | None,
                 eos_token_id: int | list[int] | None, pad_token_id: int, keep_logits: bool, out: Decoded,
                 processors: LogitsProcessorList | None = None, recaller: Recaller | None = None):
        self.g, self.settings, self.recall, self.out, self.keep_logits = g, settings, recall, out, keep_logits
        self.t0 = time.perf_counter()
        self.input_ids = input_ids
        rows, length = input_ids.shape
        self.recall_on = recall is not None and recall.active
        self.prompt = input_ids.to(g.device)
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.eos = eos
        if processors is None:
            processors = build_logits_processor(settings, eos_token_id=eos or None, prompt_ids=self.prompt,
                                                vocab_size=g.embed.weight.shape[0])
        self.processors = processors
        seed = settings.seed if settings.seed is not None else int(torch.randint(1 << 31, ()))
        self.masked = rows > 1 and bool(eos)
        self.kind = g.sampler.configure(self.processors, do_sample=settings.do_sample, seed=seed, eos=eos,
                                        pad=pad_token_id, masked=self.masked, prompt=length)
        if self.kind is not None and self.kind.sees:
            g.sampler.see(self.prompt)
        self.host_side = self.kind is None  # the fallback: processors and draw after the replay, on the host's queue
        self.seq = torch.zeros((rows, g.max_len), dtype=torch.long, device=g.device) if self.host_side else None
        if self.host_side:
            self.seq[:, :length] = self.prompt
        self.cur = length  # positions of the sequence so far
        self.generator = None if settings.seed is None else torch.Generator(g.device).manual_seed(settings.seed)
        self.selector = MemorySelector.of(recall, None if settings.seed is None else
                                          torch.Generator().manual_seed(settings.seed)) \
            if self.recall_on and recaller is None else None
        self.readback = ReadBack(g.sampler)
        self.recaller = recaller or (lambda hidden, position: recall_step(self.selector, recall, hidden, 0, position))

    def keep(self, logits: torch.Tensor) -> None:
        if self.keep_logits:
            self.out.logits.append(logits.clone())
            self.out.positions.append(self.cur - 1)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The fallback's choice (host side)."""
        self.keep(logits)
        scores = self.processors(self.seq[:, :self.cur], logits) if self.processors else logits
        return draw(scores, self.settings.do_sample, self.generator)

    def advance(self, logits: torch.Tensor) -> int:
        """A replay was queued whose logits score position `cur - 1` (its token chosen in the graph, or here): the
        token's read-back slot."""
        if self.host_side:
            self.g.sampler.commit(self.pick(logits), self.g.one.ids, self.masked)
            self.seq[:, self.cur].copy_(self.g.one.ids[:, 0])
        else:
            self.keep(logits)
        self.cur += 1
        return self.readback.pushed()

    def recall_span(self, hidden: torch.Tensor) -> tuple[list[int], int]:
        """Recall at the newest position (its final state `hidden` [1, H]); forward the memory's slots and suffix;
        (the forced tokens, the read-back slot of the token sampled after them)."""
        g, recall, start = self.g, self.recall, self.cur
        tokens, vectors, event = self.recaller(hidden[0], start)
        if event is not None:  # (None: an empty memory, its close alone: `recall_step`)
            self.out.recalls.append(event)
        self.out.memory_vectors.update(vectors)
        if self.host_side:
            self.seq[:, self.cur:self.cur + len(tokens)] = torch.tensor(tokens, device=g.device)
        self.cur += len(tokens)
        slots = {p - start: v for p, v in vectors.items()}
        embedded = recall.embed(torch.stack([slots[i] for i in sorted(slots)]), g.device, g.dtype) \
            if slots else []  # [k, H]
        _, logits = g.forward_span(tokens, dict(zip(sorted(slots), embedded)), self.kind)
        self.out.steps += 1
        return tokens, self.advance(logits)

    def start(self, hidden: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], int]:
        """After the prompt's prefill (its last state [B, H] and logits [B, V]): (tokens forced at once, the
        read-back slot of the first sampled token)."""
        g = self.g
        if self.recall_on and int(self.input_ids[0, -1]) == self.recall.recall_id:  # the prompt ends with <recall>
            self.pick(logits) if self.host_side else self.keep(logits)  # drawn and dropped: the span is forced
            return self.recall_span(hidden)
        if not self.host_side:
            g.sampler.commit(g.sampler.choose(logits, self.kind), g.one.ids, self.kind.masked)
        return [], self.advance(logits)

    def forced(self, tokens: list[int]) -> Iterator[tuple[list[int], bool]]:
        if tokens:
            self.out.tokens[0].extend(tokens)
            yield tokens, True

    def tokens(self, hidden: torch.Tensor, logits: torch.Tensor, interrupt: threading.Event | None,
               launch_guard) -> Iterator[tuple[list[int], bool]]:
        """The host loop after the prefill (its last state and logits): launch step n + 1, then read step n's
        tokens; a stop ends it one step later at most. Yields (each row's token [B], False) a step, and
        (a memory's forced span, True) for row 0 after its `<recall>`."""
        g, out, settings = self.g, self.out, self.settings
        out.tokens = [[] for _ in range(self.prompt.shape[0])]
        done = [False] * self.prompt.shape[0]
        first, pending = self.start(hidden, logits)
        yield from self.forced(first)
        made = len(first)
        while True:
            queued = None
            if made + 1 < settings.max_new_tokens and g.length + 1 < g.max_len:
                with launch_guard():
                    hidden, logits = g.step(self.kind)  # input: the pending token, already in `one.ids`
                    if self.recall_on:
                        hidden = hidden.clone()
                    queued = self.advance(logits)
                out.steps += 1
            tokens = self.readback.read(pending)  # the device is already busy with the step queued behind it
            out.ttft = out.ttft or time.perf_counter() - self.t0
            made += 1
            for row, t in enumerate(tokens):
                if not done[row]:
                    out.tokens[row].append(t)
                    done[row] = t in self.eos
            yield tokens, False
            if all(done):
                out.finish = "stop"
                return
            if made >= settings.max_new_tokens or queued is None:
                out.finish = "length"
                return
            if interrupt is not None and interrupt.is_set():
                out.finish = "interrupted"
                return
            if self.recall_on and tokens[0] == self.recall.recall_id:  # the queued step took <recall>: its state
                self.cur -= 1  # is the query, and the token it sampled is dropped
                span, queued = self.recall_span(hidden)
                yield from self.forced(span)
                made += len(span)
                if made >= settings.max_new_tokens:  # (the span is forced whole, as the loop forces it)
                    out.finish = "length"
                    return
            pending = queued

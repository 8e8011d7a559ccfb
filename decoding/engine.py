"""The engine as the chat uses it: one face, `Engine.stream(prompt, settings, recall, interrupt)` -> events.

The engine chooses the decoder a request's settings ask for (the plain loop, which also decodes from
layers by entropy, or the two-model mixture with its target and draft; on a model with a warmed-up graph step,
`decoding.graph_stream` answers what that step takes, `decoding.graph_rows` what comes while it is busy, as rows of
a second step, and the loop the rest), makes once what a decoder needs
(the mixture's target and drafts are kept with the model), and refuses by name what the model's
backend cannot run (`decoding.backend.require`). The chat keeps the conversation (its exact ids, its
memory vectors, its cache, which the engine treats as opaque: `cache_length`, `cut_cache`) and reads the
events. What else the chat needs of the engine is here too: `Prompt`, `Recall`, and `memory_now` (a
memory chosen before the answer, read in the user's message).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Iterator

import torch

from decoding import graph, graph_rows
from decoding.backend import require
from decoding.batch import Batch
from decoding.compiled import crop, seq_length
from decoding.draft_head import draft_head_for
from decoding.events import Event, RecallEvent
from decoding.graph import GraphDecoder
from decoding.graph_stream import GraphCache, for_the_loop, read_graph, reads, stream_graph
from decoding.loop import read_prompt, stream_generate
from decoding.memory import MemorySelector, Recall, recall_step
from decoding.mixture import stream_mixture
from decoding.request import Controls, Prompt, generators
from decoding.settings import GenerationSettings

__all__ = ["Engine", "Prompt", "Recall", "cache_length", "cut_cache", "memory_now"]
from models import LoadedModel
from models.gguf import gguf_draft_for
from models.spec import MIXTURE


@dataclasses.dataclass
class Engine:
    """A loaded model ready to answer: `batch` (`decoding.batch.Batch`) is where its answers decode together
    (None: each alone), `prefill_chunk` how many prompt tokens one forward reads."""

    lm: LoadedModel
    batch: Batch | None = None
    prefill_chunk: int = 512

    def stream(self, prompt: Prompt, settings: GenerationSettings, recall: Recall | None,
               interrupt: threading.Event | None = None) -> Iterator[Event]:
        """The events of one answer to `prompt` (`decoding.request.Prompt`: the conversation's ids, the cache of
        its prefix, its memory vectors), ending with a `DoneEvent` whose result holds the new state."""
        # (the answer's end ids are the loaded model's: its model's and its chat template's turn opener, `LoadedModel`)
        lm = self.lm
        controls = Controls(prefill_chunk=self.prefill_chunk, eos_token_id=list(lm.spec.eos_token_ids))
        mix = settings.mixture
        if not mix.enabled:
            def loop(prompt: Prompt) -> Iterator[Event]:
                return stream_generate(lm.merged(), prompt, settings, recall=recall, tokenizer=lm.tokenizer,
                                       interrupt=interrupt, controls=controls, batch=self.batch)

            rows = graph_rows.attached_rows(lm.merged()) if self.batch is not None else None

            def otherwise(prompt: Prompt) -> Iterator[Event]:  # what the single-row step does not take
                if rows is not None and rows.takes(prompt, settings, recall, controls):
                    return rows.stream(self.batch, prompt, settings, recall, lm.tokenizer, interrupt, controls, loop)
                return loop(for_the_loop(prompt))

            decoder = self._graph()
            # with other answers in progress, the rows first: one replay a round for all of them (the single-row
            # step's answer and the rows' replay one after the other: GPU run 4, 8.6x at 32 sessions, 12.0x rows only)
            together = self.batch is not None and self.batch.concurrent > 1
            if decoder is None or (together and rows is not None and rows.takes(prompt, settings, recall, controls)):
                return otherwise(prompt)
            return stream_graph(decoder, prompt, settings, recall, lm.tokenizer, interrupt, controls, otherwise)
        require(lm.spec, MIXTURE)
        target = lm.mixture_target(mix.target)  # q* of this model and its target (its own base by default), made once
        drafts = dict(draft_head=draft_head_for(lm, mix.head) if mix.speculative and mix.draft == "head" else None,
                      draft_gguf=gguf_draft_for(lm, mix.gguf) if mix.speculative and mix.draft == "gguf" else None)
        # (the whole prompt is read again: the mixture keeps no cache between turns)
        return stream_mixture(
            lm.merged(),
            target,
            dataclasses.replace(prompt, cache=None),
            settings,
            recall=recall,
            tokenizer=lm.tokenizer,
            interrupt=interrupt,
            controls=dataclasses.replace(controls, **drafts),
        )

    def read(self, prompt: Prompt, interrupt: threading.Event | None = None) -> Iterator[Event]:
        """Read `prompt` into its cache and choose nothing (`decoding.loop.read_prompt`: its chunks' events, then
        the cache as the generator's value, or None when stopped first). An answer to the prompt with one more
        token then prefills that token alone."""
        decoder = self._graph()
        if decoder is not None and reads(decoder, prompt):
            return read_graph(decoder, prompt, interrupt, self.prefill_chunk)
        return read_prompt(self.lm.merged(), for_the_loop(prompt), controls=Controls(prefill_chunk=self.prefill_chunk),
                           interrupt=interrupt)

    def _graph(self) -> GraphDecoder | None:
        """The model's graph step when it is warmed up (`decoding.graph.enable`, `decoding.graph_stream`)."""
        decoder = graph.attached(self.lm.merged())
        return decoder if decoder is not None and decoder.ready.is_set() else None


def cache_length(cache: Any) -> int:
    """Positions a conversation's KV cache holds (either backend's, or its handle on the graph step)."""
    if isinstance(cache, GraphCache):
        return cache.valid()
    return seq_length(cache)


def cut_cache(cache: Any, keep: int) -> None:
    """Keep the first `keep` positions of a conversation's KV cache."""
    if isinstance(cache, GraphCache):
        cache.cut(keep)
        return
    crop(cache, seq_length(cache) - keep)


Placed = tuple[list[int], dict[int, torch.Tensor], RecallEvent]  # a memory's tokens, their vectors, its event


def memory_now(recall: Recall, settings: GenerationSettings) -> Callable[[int], Placed]:
    """A memory chosen now, before the answer (recall first for a model never trained to recall, which reads it
    in the user's message): called with the position after `<recall>`, its tokens, vectors and event. The query
    is the message's (`recall.query`); a seed draws the memory from its own random state."""
    selector = MemorySelector.of(recall, generators(settings.seed, "cpu")[1])
    return lambda position: recall_step(selector, recall, None, 0, position)

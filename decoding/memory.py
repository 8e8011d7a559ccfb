"""The memory head and the memory embedding (seed 000), for memories of k >= 1 value slots.

memory head: like `lm_head` over the memory bank. A query is scored against the bank's keys
(cosine similarity = logits) through the bank's own search: exact by default, the FAISS
approximate index when the bank has one (its top-k candidates are then the only ones the warpers
see), then warped and sampled with the same `sample` as tokens. The query is the `<recall>`
position's hidden state, or what `Recall.query` makes of it (a bank keyed by text embeddings is
searched with the embedding of the user's message).
memory embedding: the chosen memory's k value vectors become the input embeddings of k
consecutive `<|memory_pad|>` positions, in order (through the model's memory projector when its
recall training has one), followed by the forced `Recall.suffix` tokens (`</recall>` for a model
trained to read memories between the two). A memory of token ids (a `tokens` bank) is the model's
own input embeddings of those ids, looked up at the recall (`Recall.tokens`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from transformers import LogitsProcessor

from decoding.events import RecallEvent
from decoding.sampling import kept, sample
from decoding.processors import make_memory_warper
from decoding.settings import RecallSettings
from memory.shape import Memory

log = logging.getLogger("decoding.memory")

Embedding = Callable[[torch.Tensor], torch.Tensor]  # value vectors [N, H] -> input embeddings [N, H]
Query = Callable[[torch.Tensor], torch.Tensor]  # the <recall> hidden state [H] -> the query [D] of the bank's keys
MemoryProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (memory ids [1, k], scores [1, k]) -> scores


@dataclass(frozen=True)
class Recall:
    """Everything the loop needs to recall and to place memories.

    `bank` may be None or empty (recall is then off, but memories of earlier turns are still
    placed at their `<|memory_pad|>` positions with `embedding`). `query` turns the `<recall>`
    hidden state into the query (None: the state itself, for a bank whose keys are hidden states).
    `suffix`: token ids forced right after a memory's slots. `tokens`: the model's input embedding of token
    ids (float32 [k, H] on the embedding's device: a recall on a GPU never copies them to the host; the
    conversation keeps what it injected on the host, `chat.session`), for banks whose values are token ids
    (`with_tokens` fills it in).
    `without_memory`: what `<recall>` is while recall is off (no bank, an empty one, or disabled): `token`, a
    plain token the model may write (the seeds' loop); `answer`, suppressed, so the model answers from what it
    knows, and the result says whether it would have recalled (`NoMemory`; what the chat does).
    `close`: the token that ends a memory for a model trained to read memories between `<recall>` and it
    (`</recall>`). A `<recall>` whose search finds no memory at `settings.min_score` (a bank keyed by states, whose
    query is the `<recall>` state itself: nothing can be checked before) then reads nothing: `close` alone is
    forced after it, an empty memory, and the model answers from what it knows (`recall_step`). None: the best
    memory is read then (the step needs one). `processors`: seed 000's optional logits processor over the memory
    logits, before the warpers: `(candidate memory ids [1, k], scores [1, k]) -> scores`, transformers'
    `LogitsProcessor` shape with the memories as the vocabulary (e.g. a penalty on memories read before).
    """

    recall_id: int
    memory_pad_id: int
    bank: object = None  # a MemoryVectorDB
    settings: RecallSettings = RecallSettings()
    embedding: Embedding | None = None
    query: Query | None = None
    suffix: tuple[int, ...] = ()
    tokens: Embedding | None = None
    without_memory: str = "token"
    close: int | None = None
    processors: MemoryProcessor | None = None

    def __post_init__(self) -> None:
        if self.without_memory not in ("token", "answer"):
            raise ValueError(f"without_memory is {self.without_memory!r}; expected token or answer")

    @classmethod
    def from_token_ids(cls, token_ids: Mapping[str, int], bank=None, settings: RecallSettings = RecallSettings(),
                       embedding: Embedding | None = None) -> "Recall":
        """From the seed's `recall_token_ids` mapping; a clear error when a token is missing."""
        missing = [t for t in ("<recall>", "<|memory_pad|>") if token_ids.get(t) is None]
        if missing:
            raise ValueError(f"recall_token_ids has no id for {', '.join(missing)}: recall needs both <recall> "
                             "(the trigger) and <|memory_pad|> (the position the memory is injected at)")
        return cls(int(token_ids["<recall>"]), int(token_ids["<|memory_pad|>"]), bank, settings, embedding)

    @property
    def active(self) -> bool:
        return self.settings.enabled and self.bank is not None and len(self.bank) > 0

    def embed(self, vectors: torch.Tensor, device, dtype) -> torch.Tensor:
        """Value vectors [N, H] as input embeddings [N, H] on the model's device and dtype."""
        vectors = vectors.to(device=device, dtype=torch.float32)
        if self.embedding is not None:
            vectors = self.embedding(vectors)
        return vectors.to(dtype)

    def values(self, memory: Memory) -> torch.Tensor:
        """The memory's value vectors [k, H] float32: its own (on the CPU), or the input embeddings of its token
        ids (on the embedding's device)."""
        if not memory.token_ids:
            return memory.values
        if self.tokens is None:
            raise ValueError("this bank's values are token ids: Recall(tokens=...) must give the model's input "
                             "embeddings of them")
        return self.tokens(memory.values)

    def with_tokens(self, embed: torch.nn.Module) -> "Recall":
        """This recall context with `tokens` looked up in `embed` (the model's input embedding), unless set."""
        if self.tokens is not None:
            return self
        lookup = lambda ids: embed(ids.to(embed.weight.device)).detach().float()  # noqa: E731
        return dataclasses.replace(self, tokens=lookup)

    def span(self, memory: Memory) -> list[int]:
        """The tokens forced after `<recall>` for a memory: a `<|memory_pad|>` a value slot, then the suffix."""
        return [self.memory_pad_id] * memory.slots + list(self.suffix)


class NoMemory(LogitsProcessor):
    """Recall with nothing to read, in `answer` mode: `<recall>` and `<|memory_pad|>` are suppressed, so the model
    answers from what it knows; `wanted` marks, per call, each row whose first choice was `<recall>` (on the
    device: no host sync). Runs where `generate` runs a suppression: after the request's other processors, before
    its warpers (`decoding.processors.before_warpers`), so a top-k, top-p or min-p never keeps `<recall>` alone."""

    def __init__(self, recall: Recall, start: int = -1, eos: Sequence[int] = ()):
        self.recall_id = recall.recall_id
        self.ids = [recall.recall_id, recall.memory_pad_id]
        self.start, self.eos = start, list(eos)  # the prompt's length; the end tokens
        self.wanted: list[torch.Tensor] = []  # per call: [rows] bool

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        first = scores.argmax(-1) == self.recall_id  # [rows]
        self.wanted.append(first)
        scores = scores.clone()
        scores[:, self.ids] = -float("inf")
        if input_ids.shape[1] == self.start and self.eos:  # a row that wanted a memory first answers something:
            ends = scores[:, self.eos]                     # its second choice is often the end (an empty answer)
            scores[:, self.eos] = torch.where(first[:, None], torch.full_like(ends, -float("inf")), ends)
        return scores

    @classmethod
    def of(cls, recall: "Recall | None", recall_on: bool, start: int = -1,
           eos: Sequence[int] = ()) -> "NoMemory | None":
        """The processor a request needs: only with recall off and `without_memory: answer` (`start`, the prompt's
        length, and `eos`: the first answer token of a row that wanted a memory is not the end)."""
        if recall is None or recall_on or recall.without_memory != "answer":
            return None
        return cls(recall, start, eos)

    def rows(self, batch: int, calls: int | None = None) -> list[bool]:
        """Per row of the batch: did the model want a memory, in the first `calls` calls (None: all; a decoder that
        scores a step ahead leaves its last out)? (Entropy decoding scores [B*L] rows: any layer.)"""
        wanted = self.wanted[:calls]
        if not wanted:
            return [False] * batch
        return torch.stack([w.view(batch, -1).any(-1) for w in wanted]).any(0).tolist()


def recall_step(selector: "MemorySelector", recall: Recall, hidden: torch.Tensor, row: int,
                position: int) -> tuple[list[int], dict[int, torch.Tensor], RecallEvent | None]:
    """The one recall step, for the plain loop and the mixture alike: the newest input of `row` is
    `<recall>`, with final hidden state `hidden` [H]. Returns the tokens forced from `position` on
    (`Recall.span`), the value vector of each of their slot positions, and the event of the injection; with no
    memory at `min_score` and a `Recall.close`, an empty memory: `[close]`, no vector and no event."""
    memory = selector.choose(hidden, required=recall.close is None)
    if memory is None:
        return [recall.close], {}, None
    vectors = {position + i: v for i, v in enumerate(recall.values(memory))}
    return recall.span(memory), vectors, RecallEvent(row, position, memory.score, memory.index, memory.text,
                                                     memory.slots, memory.source)


def inject_memories(embeds: torch.Tensor, input_ids: torch.Tensor, pad_id: int,
                    vectors: torch.Tensor) -> torch.Tensor:
    """Memory embedding for a whole input: token embeddings [B, S, H] with the i-th `<|memory_pad|>`
    (in row-major order) replaced by `vectors[i]` ([N, H]). Differentiable in `vectors`: training
    injects memories with the same step the generation loop uses."""
    where = input_ids == pad_id  # [B, S]
    count = int(where.sum())
    if count != vectors.shape[0]:
        raise ValueError(f"the input has {count} <|memory_pad|> positions but {vectors.shape[0]} memory vectors "
                         "were given: every <|memory_pad|> needs exactly one vector")
    return embeds.masked_scatter(where[..., None], vectors.to(device=embeds.device, dtype=embeds.dtype))


class MemorySelector:
    """Scores a query against the bank and picks one memory, per the recall settings.

    Only the top `recall.top_k` scores are fetched from the bank's search: the memory top-k
    warper would set every other score to -inf, so with exact search this is the distribution of
    warping all N scores (top_k=0 fetches all of them, exactly).
    """

    def __init__(self, memory_db, recall: RecallSettings, generator: torch.Generator | None = None,
                 query: Query | None = None, processors: MemoryProcessor | None = None):
        self.db = memory_db
        self.recall = recall
        self.processors = processors  # (`Recall.processors`: before the warpers, over the raw similarities)
        self.warper = make_memory_warper(recall)
        self.generator = generator  # a seeded request's own random state (CPU: the scores are on the CPU)
        self.query = query  # the <recall> state -> the query (None: the state itself)

    @classmethod
    def of(cls, recall: Recall, generator: torch.Generator | None = None) -> "MemorySelector":
        return cls(recall.bank, recall.settings, generator, recall.query, recall.processors)

    def scores(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores [k], memory ids [k]) on the CPU, best first, from the bank's search (a query on an accelerator
        is searched there when the search is exact: only the k scores and ids come back). A greedy choice with no
        processors (and no debug log of the candidates) takes the best, whatever the warpers: it asks for k = 1 (on a
        GPU one reduction over the scores instead of a top-k's radix select)."""
        query = hidden if self.query is None else self.query(hidden)
        r = self.recall
        best_only = not r.use_sampling and self.processors is None and not r.debug
        return self.db.topk(query.detach().float(), 1 if best_only else r.top_k or None)

    def choose(self, hidden: torch.Tensor, required: bool = True) -> Memory | None:
        """The memory read for the query of `hidden`: a memory under `min_score` is not a candidate; with none
        over it, None, or (`required`: the step needs one) the best."""
        scores, ids = self.scores(hidden)  # [k], [k]
        fits = scores >= self.recall.min_score
        if not fits.any() and not required:
            if self.recall.debug:
                log.info("[memory head] no memory scores min_score=%g (best %.4f): nothing is read",
                         self.recall.min_score, float(scores[0]) if len(scores) else float("nan"))
            return None
        fits[0] = True  # (the best always fits when any does: the scores come best first)
        scores, ids = scores[fits], ids[fits]
        logits = scores[None].clone() if self.processors is None else self.processors(ids[None], scores[None].clone())
        warped = self.warper(None, logits) if self.warper else logits  # [1, k]
        pick = int(sample(warped, self.recall.use_sampling, self.generator)[0])
        memory = self.db.memory(int(ids[pick]), float(scores[pick]))
        if self.recall.debug:
            self._log(hidden, scores, ids, warped, pick, memory)
        return memory

    def _log(self, hidden: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor, warped: torch.Tensor, pick: int,
             memory: Memory) -> None:
        """Seed 001's debug log of the search and of the choice."""
        r = self.recall
        log.info("[memory head] search with the query from %s %s on %s, top_k=%d: %d candidates, (memory, similarity) "
                 "%s", tuple(hidden.shape), hidden.dtype, hidden.device, r.top_k, len(scores),
                 [(int(i), round(float(s), 4)) for s, i in zip(scores[:8], ids[:8])])
        how = f"sampled (p={float(torch.softmax(warped, -1)[0, pick]):.4f})" if r.use_sampling else "greedy"
        log.info("[memory head] %d kept after temperature=%g, top_k=%d, top_p=%g; chose memory %d (candidate %d, %s), "
                 "similarity %.4f, %d value slots", int(kept(warped)[0]), r.temperature, r.top_k, r.top_p,
                 memory.index, pick, how, memory.score, memory.slots)

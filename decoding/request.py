"""One generation request, for every decoder (the plain loop, entropy decoding, the two-model mixture).

`prepare` resolves it once before the model is touched: the backend, the prompt on the device, the KV
cache, EOS / padding, the logits processors and stopping criteria, the memory head, entropy decoding's
layer chooser, and every row's sequence, detokenizer and finish state. The lifecycle the decoders
share lives here too: a row's new tokens become events and its finish (`Request.events`), a
`<recall>` gets its memory (`Request.recall_row`), a stop ends every row (`Request.stop_all`), and the
result is made (`Request.result`). A decoder only makes each step's tokens.

`Prompt` (what a request continues) and `Controls` (what a caller brings beyond the settings) are the
public engine's arguments.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch
from transformers import EosTokenCriteria, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

from decoding.compiled import seq_length
from decoding.entropy import EntropyDecoder, repeat_rows
from decoding.events import Event, FinishEvent, GenerationResult, RecallEvent, TokenEvent
from decoding.backend import Backend, backend_for, require
from decoding.memory import MemorySelector, NoMemory, Recall, recall_step
from decoding.processors import NegativePrompt, before_warpers, build_logits_processor, build_stopping_criteria
from decoding.settings import GenerationSettings
from models.spec import GUIDANCE, LAYERS, ROWS


TOOL_CALL_END = "</tool_call>"
log = logging.getLogger("decoding.loop")


@dataclass
class Prompt:
    """What a request continues: its inputs (`input_ids` [B, L], optional `attention_mask`, Qwen3-VL's image
    kwargs), the KV cache of a prefix of them (an earlier turn's: only the rest is prefilled), and the memory
    vectors of earlier turns, by `<|memory_pad|>` position (a mapping, or one a row), placed again at prefill."""

    inputs: Mapping[str, torch.Tensor]
    cache: Any = None
    memory_vectors: Mapping[int, torch.Tensor] | Sequence[Mapping[int, torch.Tensor]] | None = None

    @classmethod
    def of(cls, prompt: "Prompt | Mapping[str, torch.Tensor]") -> "Prompt":
        return prompt if isinstance(prompt, Prompt) else cls(prompt)


@dataclass(frozen=True)
class Controls:
    """What a caller brings to a generation beyond its settings. `logits_processor` replaces the processors built
    from the settings; `stopping_criteria` is added to the built ones; `eos_token_id` / `pad_token_id` replace
    the model's; `output_logits` keeps each step's raw logits in the result; a long prompt is read
    `prefill_chunk` tokens a forward. The mixture's: `draft_head` (a trained `DraftHead`, for draft `head`),
    `draft_gguf` (a llama.cpp model, for draft `gguf`), `batched_pair` (a PEFT pair in one forward)."""

    logits_processor: LogitsProcessorList | None = None
    stopping_criteria: StoppingCriteriaList | None = None
    eos_token_id: int | Sequence[int] | None = None
    pad_token_id: int | None = None
    output_logits: bool = False
    prefill_chunk: int = 512
    draft_head: Any = None
    draft_gguf: Any = None
    batched_pair: bool = True


class Detokenizer:
    """Incremental decoding of one row: each pushed token returns the text it completes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.tail = ""  # the last characters streamed, for stop markers

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(self.ids[self.prefix:self.read])
        after = decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            delta = after[len(before):]
            self.tail = (self.tail + delta)[-128:]  # (the longest stop string, `settings.MAX_STOP_CHARS`, and more)
            return delta
        return ""


def as_list(ids) -> list[int]:
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


def per_row(memory_vectors, batch: int) -> list[dict[int, torch.Tensor]]:
    if memory_vectors is None:
        return [{} for _ in range(batch)]
    if isinstance(memory_vectors, Mapping):
        memory_vectors = [memory_vectors]
    if len(memory_vectors) != batch:
        raise ValueError(f"memory_vectors has {len(memory_vectors)} rows, the batch has {batch}")
    return [dict(m) for m in memory_vectors]


@dataclass
class Rows:
    """The per-request state of every row."""

    seq: torch.Tensor  # [B, L + new] prompt, then generated tokens; `cur` of them are valid
    cur: int
    mask: torch.Tensor | None  # [B, L + new] attention mask, only for a padded batch
    memory: list[dict[int, torch.Tensor]]  # per row: <|memory_pad|> position -> memory vector
    detok: list[Detokenizer] | None
    reasons: list = field(default_factory=list)
    alive: list[bool] = field(default_factory=list)
    held: dict[int, TokenEvent] = field(default_factory=dict)  # <recall> tokens waiting for their recall
    injections: list[RecallEvent] = field(default_factory=list)

    def write(self, block: torch.Tensor, fillers: list[int]) -> None:
        """Append columns [B, W] (growing the buffers when a memory's span needs room); the first
        `fillers[r]` of row r are masked (a padded batch whose other row forwards a span)."""
        width = block.shape[1]
        if self.cur + width > self.seq.shape[1]:
            more = max(width, 64)
            self.seq = torch.cat([self.seq, self.seq.new_zeros((self.seq.shape[0], more))], dim=1)
            if self.mask is not None:
                self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], more))], dim=1)
        if any(fillers):
            if self.mask is None:
                self.mask = torch.ones_like(self.seq)
            for row, n in enumerate(fillers):
                self.mask[row, self.cur:self.cur + n] = 0
        self.seq[:, self.cur:self.cur + width] = block
        self.cur += width

    def finish(self, row: int, reason: str) -> FinishEvent:
        self.reasons[row] = reason
        self.alive[row] = False
        return FinishEvent(row, reason)

    def text(self, row: int, token: int) -> str:
        return self.detok[row].push(token) if self.detok is not None else ""


@dataclass
class Request:
    """What one request runs on, resolved once before the model is touched, and what it measures."""

    fwd: Backend
    settings: GenerationSettings
    input_ids: torch.Tensor  # [B, L] on the device
    attention_mask: torch.Tensor | None  # [B, L], only for a padded batch
    cache: object
    past_len: int  # prompt tokens already in `cache`
    eos: list[int]
    pad: int
    recall: Recall | None
    selector: MemorySelector | None  # only while recall is on
    processors: LogitsProcessorList
    criteria: StoppingCriteriaList
    limit: int  # a stop at this length is "length"
    rows: Rows
    entropy: EntropyDecoder | None  # entropy-based layer choice (seed 002)
    rng: torch.Generator | None = None  # a seeded request's own random state (None: the global one)
    no_memory: NoMemory | None = None  # recall off in `answer` mode: the <recall> suppressor, before the warpers
    tool_call_end: int | None = None  # `</tool_call>`'s id when the tokenizer has it as one token (early stop only)
    t0: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    scored: int | None = None  # steps whose scores count (the graph step scores one more than it keeps; None: all)
    empty: set[int] = field(default_factory=set)  # rows whose recall found no memory at min_score (`recall_row`)
    kept_logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def recall_on(self) -> bool:
        return self.selector is not None

    def stop_all(self) -> Iterator[FinishEvent]:
        return (self.rows.finish(row, "interrupted") for row in range(self.batch) if self.rows.alive[row])

    # A one-row answer whose tokens are read back from the graph step (`decoding.graph_stream`, `graph_rows`): the
    # host's copy of the sequence is the one the criteria and the events read.

    def add(self, new: Sequence[int]) -> list[Event]:
        """A block of new tokens of the row (a sampled one, or a memory's forced span): written, checked by the
        stopping criteria, counted as a step; its events (`events`)."""
        rows = self.rows
        rows.write(torch.tensor([list(new)]), [0])
        length, eos, rest = self._one_row_criteria
        still = not (rows.cur >= length or new[-1] in eos or (rest and bool(rest(rows.seq[:, :rows.cur], None)[0])))
        self.steps += 1
        return self.events(0, new, still)

    @functools.cached_property
    def _one_row_criteria(self) -> tuple[int, set[int], StoppingCriteriaList]:
        """`criteria` for `add`: the length and the EOS ids as ints (transformers' `MaxLengthCriteria` and
        `EosTokenCriteria` over the sequence tensor: `add` took 17.6 µs a token on a CPU, 5.5 now), and the rest
        (max time, stop strings, the caller's) as they are."""
        simple = (MaxLengthCriteria, EosTokenCriteria)
        length = min((c.max_length for c in self.criteria if isinstance(c, MaxLengthCriteria)), default=1 << 62)
        eos = {int(i) for c in self.criteria if isinstance(c, EosTokenCriteria) for i in c.eos_token_id.view(-1)}
        return length, eos, StoppingCriteriaList([c for c in self.criteria if not isinstance(c, simple)])

    def interrupted(self) -> Iterator[FinishEvent]:
        """Stopped: a `<recall>` held right before the stop is dropped (its recall never started), then the finish."""
        rows = self.rows
        if rows.held:
            rows.held.clear()
            rows.cur -= 1
        return self.stop_all()

    def out_of_room(self) -> FinishEvent:
        """The answer ends where the step's cache does, before the `<recall>` whose memory it could not hold: a
        `<recall>` the answer wrote is dropped (the prompt's stays)."""
        rows = self.rows
        rows.held.clear()
        rows.cur -= rows.cur > self.prompt_len
        return rows.finish(0, "length")

    def events(self, row: int, new: Sequence[int], still: bool) -> list[Event]:
        """The events of a row's new tokens, already written into `rows`: a `TokenEvent` each with the text it
        completes, then the row's finish when `still` is False (the criteria, EOS or the length stopped it) or
        a tool call closed. A `<recall>` that does not end the row is held: it is streamed with its recall
        (`recall_row`), so a stop never separates the two."""
        rows, out = self.rows, []
        start = rows.cur - len(new)
        out += [TokenEvent(row, t, start + i, rows.text(row, t)) for i, t in enumerate(new[:-1])]
        token = new[-1]
        if self.recall_on and still and token == self.recall.recall_id:
            rows.held[row] = TokenEvent(row, token, rows.cur - 1, "")
            return out
        out.append(TokenEvent(row, token, rows.cur - 1, rows.text(row, token)))
        if self.settings.early_stop_on_tool_call and self._closes_tool_call(row, token):
            out.append(rows.finish(row, "tool_call"))
        elif not still:
            out.append(rows.finish(row, self._reason(row, token)))
        return out

    def _closes_tool_call(self, row: int, token: int) -> bool:
        """The row's newest token ends a tool call: it is `</tool_call>` as one token (also one the tokenizer marks
        special, which the streamed text leaves out), or the text streamed so far holds the marker."""
        detok = self.rows.detok
        return detok is not None and (token == self.tool_call_end or TOOL_CALL_END in detok[row].tail)

    def _reason(self, row: int, token: int) -> str:
        if token in self.eos:
            return "stop"
        detok = self.rows.detok
        if detok is not None and any(detok[row].tail.endswith(s) for s in self.settings.stop_strings):
            return "stop"  # (also on the last token allowed: its text is cut there, so it said "length")
        late = self.settings.max_time is not None and time.perf_counter() - self.t0 > self.settings.max_time
        return "length" if self.rows.cur >= self.limit or late else "stop"  # else a stop string or a criterion

    def recall_row(self, row: int, hidden: torch.Tensor) -> tuple[list[int], dict[int, torch.Tensor], list[Event]]:
        """The recall step of a row whose newest input is `<recall>`, with final state `hidden` [H] there: the
        tokens forced from the row's next position on (its memory's slots and the suffix), their value vectors
        (the caller places them in `rows.memory`, where its columns put them), and the events (the held
        `<recall>`, then the recall). A search that finds no memory at `min_score` reads an empty one (`recall_step`:
        the close alone, no vector, no recall event): the result then says the row missed its recall."""
        rows, events = self.rows, []
        if row in rows.held:
            token = rows.held.pop(row)
            events.append(TokenEvent(row, token.token_id, token.position, rows.text(row, token.token_id)))
        if self.recall.settings.debug:
            log.info("[recall] row %d: newest input is <recall> (id %d) at position %d; its hidden state %s is "
                     "the query", row, self.recall.recall_id, rows.cur - 1, tuple(hidden.shape))
        tokens, vectors, event = recall_step(self.selector, self.recall, hidden, row, rows.cur)
        if event is None:
            self.empty.add(row)
            return tokens, vectors, events
        rows.injections.append(event)
        return tokens, vectors, [*events, event]

    def missed_recall(self) -> list[bool] | None:
        """Per row: it wanted a memory with none to read (`NoMemory`), or a recall of it found none at `min_score`;
        None when neither could happen."""
        missed = self.no_memory.rows(self.batch, self.scored) if self.no_memory is not None else None
        if self.empty:
            missed = [bool(missed and missed[r]) or r in self.empty for r in range(self.batch)]
        return missed

    def result(self, kind: type[GenerationResult] = GenerationResult, **extra) -> GenerationResult:
        rows = self.rows
        sequences = rows.seq[:, :rows.cur]
        return kind(
            sequences=sequences, prompt_length=self.prompt_len, finish_reasons=rows.reasons,
            injections=rows.injections, memory_vectors=rows.memory, cache=self.cache, prefill_seconds=self.prefill_s,
            decode_seconds=self.decode_s, steps=self.steps,
            logits=torch.stack(self.kept_logits, dim=1) if self.kept_logits else None,
            entropy=self.entropy.trace(sequences) if self.entropy is not None else None,
            missed_recall=self.missed_recall(), **extra,
            attention_mask=None if rows.mask is None else rows.mask[:, :rows.cur])


def generators(seed: int | None, device) -> tuple[torch.Generator | None, torch.Generator | None]:
    """A seeded request's own random states, for its tokens (on the model's device) and its memories (the
    memory head samples on the CPU): one generator on a CPU model, so the draws are those of
    `torch.manual_seed(seed)` followed by the same draws (as `generate` makes them), whatever other
    requests draw meanwhile. (None, None) without a seed: the global random state."""
    if seed is None:
        return None, None
    cpu = torch.Generator().manual_seed(seed)
    if torch.device(device).type == "cpu":
        return cpu, cpu
    return torch.Generator(device).manual_seed(seed), cpu


def prepare(model, prompt: Prompt, settings: GenerationSettings, recall: Recall | None, tokenizer,
            controls: Controls, cached: bool = True) -> Request:
    """Check the request and build what it runs on: the backend, processors, criteria and every row's state, and
    (`cached`: the plain loop) the KV cache; a decoder that keeps caches of its own (the mixture) passes False."""
    inputs = prompt.inputs
    recall_on = recall is not None and recall.active
    fwd = backend_for(model, want_state=recall_on and recall.query is None)
    spec = fwd.spec
    if recall is not None:
        recall = recall.with_tokens(fwd.embed)
    device = fwd.device
    input_ids = inputs["input_ids"].to(device)  # [B, L]
    batch, prompt_len = input_ids.shape
    context = spec.context
    if context is not None and prompt_len >= context:
        raise ValueError(f"the prompt has {prompt_len} tokens but the model's context holds {context}: "
                         "shorten the conversation (or clear it)")
    attention_mask = prompt_mask = inputs.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
        if bool(attention_mask.all()):
            attention_mask = None  # no padding: let attention take the causal fast path
    for capability, asked in ((LAYERS, settings.entropy_decoding is not None), (GUIDANCE, settings.guidance_scale != 1),
                              (ROWS, batch > 1)):
        if asked:
            require(spec, capability)
    cache, past_len = None, 0
    if cached:  # a static cache for the compiled step starts just long enough for the prompt; the loop grows it
        cache = fwd.cache_for(prompt.cache, prompt_len + 1,
                              plain=attention_mask is None and settings.entropy_decoding is None)
        past_len = seq_length(cache)
        if past_len >= prompt_len:
            raise ValueError(f"the cache covers {past_len} tokens but the prompt has only {prompt_len}")
        if past_len and attention_mask is not None:
            raise ValueError("reusing a cache needs an unpadded prompt (batch of one)")

    eos = as_list(controls.eos_token_id if controls.eos_token_id is not None else spec.eos_token_ids)
    pad = controls.pad_token_id if controls.pad_token_id is not None else spec.pad_token_id
    pad = pad if pad is not None else (eos[0] if eos else 0)
    if recall_on:
        spec.check_bank(recall.bank, recall.query)
    rng, memory_rng = generators(settings.seed, device)
    entropy = None
    if settings.entropy_decoding is not None:
        entropy = EntropyDecoder(model, settings.entropy_decoding, settings.entropy_record_tokens, rng)
    processors = controls.logits_processor
    if processors is None:
        processors = _processors(fwd, settings, input_ids, prompt_mask, eos, tokenizer,
                                 entropy.num_layers if entropy is not None else 1)
    if entropy is not None:
        entropy.check(processors)
    no_memory = NoMemory.of(recall, recall_on, prompt_len, eos)
    if no_memory is not None:
        processors = before_warpers(processors, no_memory)
    criteria = build_stopping_criteria(settings, prompt_length=prompt_len, eos_token_id=eos or None,
                                       tokenizer=tokenizer, max_position_embeddings=context)
    if controls.stopping_criteria:
        criteria.extend(controls.stopping_criteria)

    max_len = prompt_len + settings.max_new_tokens
    seq = torch.full((batch, max_len), pad, dtype=torch.long, device=device)
    seq[:, :prompt_len] = input_ids
    mask = None
    if attention_mask is not None:
        mask = torch.ones((batch, max_len), dtype=attention_mask.dtype, device=device)
        mask[:, :prompt_len] = attention_mask
    rows = Rows(seq, prompt_len, mask, per_row(prompt.memory_vectors, batch),
                [Detokenizer(tokenizer) for _ in range(batch)] if tokenizer is not None else None,
                [None] * batch, [True] * batch)
    if recall is None and any(rows.memory):
        raise ValueError("memory_vectors were given without recall=Recall(...): placing them needs the "
                         "<|memory_pad|> id and the model's memory embedding")
    return Request(fwd, settings, input_ids, attention_mask, cache, past_len, eos, pad, recall,
                   MemorySelector.of(recall, memory_rng) if recall_on else None, processors,
                   criteria, min(max_len, context) if context is not None else max_len, rows, entropy, rng,
                   no_memory=no_memory, t0=time.perf_counter(),
                   tool_call_end=_one_token(tokenizer, TOOL_CALL_END) if settings.early_stop_on_tool_call else None)


def _one_token(tokenizer, text: str) -> int | None:
    """The id of `text` when `tokenizer` (None: no tokenizer) has it as one token, an added one for instance."""
    ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else []
    return ids[0] if len(ids) == 1 else None


def _processors(fwd: Backend, settings: GenerationSettings, input_ids: torch.Tensor, prompt_mask, eos: list[int],
                tokenizer, layers: int) -> LogitsProcessorList:
    """The processors `settings` switch on, for this prompt; with `layers` > 1 (entropy decoding) for every row
    repeated once per layer, since the processors then score [B*L] rows at once."""
    negative = None
    if settings.guidance_scale != 1 and settings.negative_prompt is not None:
        if tokenizer is None:
            raise ValueError("negative_prompt needs a tokenizer to be encoded")
        negative = NegativePrompt(tokenizer(settings.negative_prompt, return_tensors="pt").input_ids.to(fwd.device))
    mask = None if prompt_mask is None else prompt_mask.to(fwd.device)
    if layers > 1:
        input_ids, mask = repeat_rows(input_ids, layers), repeat_rows(mask, layers)
    return build_logits_processor(  # (input_ids are on the model's device: the processors' device)
        settings, eos_token_id=eos or None, prompt_ids=input_ids, vocab_size=fwd.spec.vocab_size, model=fwd.model,
        negative_prompt=negative, attention_mask=mask)

"""The state of one generation request, resolved once before the model is touched: the prompt on the
device, the KV cache, EOS / padding, the logits processors and stopping criteria, the memory head,
entropy decoding's layer chooser, and every row's sequence, detokenizer and finish state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from decoding.compiled import seq_length
from decoding.entropy import EntropyDecoder, repeat_rows
from decoding.events import FinishEvent, GenerationResult, RecallEvent, TokenEvent
from decoding.forward import Forward, forward_for
from decoding.memory import MemorySelector, NoMemory, Recall
from decoding.processors import build_logits_processor, build_stopping_criteria
from decoding.settings import GenerationSettings
from models.modeling import check_bank_dim, max_positions


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
            self.tail = (self.tail + delta)[-64:]
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

    fwd: Forward
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
    no_memory: NoMemory | None = None  # recall off in `answer` mode: the <recall> suppressor, last of `processors`
    t0: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
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

    def result(self) -> GenerationResult:
        rows = self.rows
        sequences = rows.seq[:, :rows.cur]
        return GenerationResult(
            sequences=sequences, prompt_length=self.prompt_len, finish_reasons=rows.reasons,
            injections=rows.injections, memory_vectors=rows.memory, cache=self.cache, prefill_seconds=self.prefill_s,
            decode_seconds=self.decode_s, steps=self.steps,
            logits=torch.stack(self.kept_logits, dim=1) if self.kept_logits else None,
            entropy=self.entropy.trace(sequences) if self.entropy is not None else None,
            missed_recall=self.no_memory.rows(self.batch) if self.no_memory is not None else None,
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


def prepare(model, inputs, settings: GenerationSettings, recall: Recall | None, tokenizer, cache, memory_vectors,
            logits_processor, stopping_criteria, eos_token_id, pad_token_id) -> Request:
    """Check the request and build what it runs on: the cache, processors, criteria and every row's state."""
    if settings.mixture.enabled:
        raise ValueError("settings.mixture.enabled: the two-model mixture runs in decoding.stream_mixture, "
                         "not in this loop")
    recall_on = recall is not None and recall.active
    fwd = forward_for(model, want_state=recall_on and recall.query is None)
    if recall is not None:
        recall = recall.with_tokens(fwd.embed)
    device = fwd.device
    input_ids = inputs["input_ids"].to(device)  # [B, L]
    batch, prompt_len = input_ids.shape
    context = max_positions(model)
    if context is not None and prompt_len >= context:
        raise ValueError(f"the prompt has {prompt_len} tokens but the model's context holds {context}: "
                         "shorten the conversation (or clear it)")
    attention_mask = prompt_mask = inputs.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
        if bool(attention_mask.all()):
            attention_mask = None  # no padding: let attention take the causal fast path
    if fwd.runs_steps and (batch > 1 or settings.entropy_decoding is not None or settings.guidance_scale != 1):
        what = ("entropy_decoding (every layer's state)" if settings.entropy_decoding is not None else
                "guidance_scale (a second forward of the model)" if settings.guidance_scale != 1 else
                f"a batch of {batch} rows in one request (send them as requests: they decode together)")
        raise ValueError(f"the llama.cpp backend does not run {what}: set model.backend: transformers")
    # a static cache for the compiled step starts just long enough for the prompt; the loop grows it
    cache = fwd.cache_for(cache, prompt_len + 1, plain=attention_mask is None and settings.entropy_decoding is None)
    past_len = seq_length(cache)
    if past_len >= prompt_len:
        raise ValueError(f"the cache covers {past_len} tokens but the prompt has only {prompt_len}")
    if past_len and attention_mask is not None:
        raise ValueError("reusing a cache needs an unpadded prompt (batch of one)")

    gen_config = fwd.base.generation_config
    eos = as_list(eos_token_id if eos_token_id is not None else gen_config.eos_token_id)
    pad = pad_token_id if pad_token_id is not None else gen_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if eos else 0)
    if recall_on:
        check_bank_dim(model, recall.bank, recall.query)
    rng, memory_rng = generators(settings.seed, device)
    entropy = None
    if settings.entropy_decoding is not None:
        entropy = EntropyDecoder(model, settings.entropy_decoding, settings.entropy_record_tokens, rng)
    if logits_processor is None:
        logits_processor = _processors(fwd, settings, input_ids, prompt_mask, eos, tokenizer,
                                       entropy.num_layers if entropy is not None else 1)
    if entropy is not None:
        entropy.check(logits_processor)
    no_memory = NoMemory.of(recall, recall_on)
    if no_memory is not None:
        logits_processor = LogitsProcessorList([*logits_processor, no_memory])
    criteria = build_stopping_criteria(settings, prompt_length=prompt_len, eos_token_id=eos or None,
                                       tokenizer=tokenizer, max_position_embeddings=context)
    if stopping_criteria:
        criteria.extend(stopping_criteria)

    max_len = prompt_len + settings.max_new_tokens
    seq = torch.full((batch, max_len), pad, dtype=torch.long, device=device)
    seq[:, :prompt_len] = input_ids
    mask = None
    if attention_mask is not None:
        mask = torch.ones((batch, max_len), dtype=attention_mask.dtype, device=device)
        mask[:, :prompt_len] = attention_mask
    rows = Rows(seq, prompt_len, mask, per_row(memory_vectors, batch),
                 [Detokenizer(tokenizer) for _ in range(batch)] if tokenizer is not None else None,
                 [None] * batch, [True] * batch)
    return Request(fwd, settings, input_ids, attention_mask, cache, past_len, eos, pad, recall,
                    MemorySelector.of(recall, memory_rng) if recall_on else None, logits_processor,
                    criteria, min(max_len, context) if context is not None else max_len, rows, entropy, rng,
                    no_memory=no_memory)


def _processors(fwd: Forward, settings: GenerationSettings, input_ids: torch.Tensor, prompt_mask, eos: list[int],
                tokenizer, layers: int) -> LogitsProcessorList:
    """The processors `settings` switch on, for this prompt; with `layers` > 1 (entropy decoding) for every row
    repeated once per layer, since the processors then score [B*L] rows at once."""
    negative = None
    if settings.guidance_scale != 1 and settings.negative_prompt is not None:
        if tokenizer is None:
            raise ValueError("negative_prompt needs a tokenizer to be encoded")
        negative = tokenizer(settings.negative_prompt, return_tensors="pt").input_ids.to(fwd.device)
    mask = None if prompt_mask is None else prompt_mask.to(fwd.device)
    if layers > 1:
        input_ids, mask = repeat_rows(input_ids, layers), repeat_rows(mask, layers)
    return build_logits_processor(
        settings, eos_token_id=eos or None, prompt_ids=input_ids, device=fwd.device,
        vocab_size=fwd.base.config.get_text_config(decoder=True).vocab_size, model=fwd.model,
        negative_prompt_ids=negative, attention_mask=mask)

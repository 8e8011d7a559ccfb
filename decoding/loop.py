"""The generation loop with recall (seeds 000 and 001): prefill, then one token a step.

Every step feeds the model `inputs_embeds` of shape [B, 1, H]: a token's own embedding, or, at
a `<|memory_pad|>` position, the memory vector the memory head chose. A row recalls when its
newest input token is `<recall>` (also when the prompt ends with one): the hidden state at that
position is the query, the next token is forced to `<|memory_pad|>`, and the chosen vector is
that position's input embedding in the next forward, on the same KV cache. Each `<recall>` is
the newest input token exactly once, so it fires once (the seed's `recall_pending`).

The step reads the device once (`tolist()` of the new tokens and the unfinished flags); the
rest stays on the device.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterator, Mapping, Sequence

import torch
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteriaList

from decoding.events import DoneEvent, Event, FinishEvent, GenerationResult, RecallEvent, TokenEvent
from decoding.memory import MemorySelector
from decoding.modeling import backbone_and_head, check_bank_dim, unwrap_model
from decoding.settings import GenerationSettings, RecallSettings, build_logits_processor, build_stopping_criteria

TOOL_CALL_END = "</tool_call>"
log = logging.getLogger("decoding.loop")


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

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)


def _as_list(ids) -> list[int]:
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


def _per_row(memory_vectors, batch: int) -> list[dict[int, torch.Tensor]]:
    if memory_vectors is None:
        return [{} for _ in range(batch)]
    if isinstance(memory_vectors, Mapping):
        memory_vectors = [memory_vectors]
    if len(memory_vectors) != batch:
        raise ValueError(f"memory_vectors has {len(memory_vectors)} rows, the batch has {batch}")
    return [dict(m) for m in memory_vectors]


def _prefill_positions(backbone, inputs: dict, input_ids, attention_mask) -> torch.Tensor:
    """Position ids of the whole prompt as `generate` builds them: [B, L], or [4, B, L] for mRoPE."""
    if attention_mask is not None:
        text = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)  # [B, L]
    else:
        text = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
    if not hasattr(backbone, "get_rope_index"):
        return text
    if inputs.get("image_grid_thw") is not None:
        rope, _ = backbone.get_rope_index(
            input_ids, mm_token_type_ids=inputs["mm_token_type_ids"].to(input_ids.device),
            image_grid_thw=inputs["image_grid_thw"].to(input_ids.device), attention_mask=attention_mask)
    else:
        rope = text[None].expand(3, -1, -1)
    return torch.cat([text[None], rope.to(text.dtype)], dim=0)  # [4, B, L]


def _vision_suffix(inputs: dict, input_ids, past_len: int, device) -> dict:
    """Vision kwargs for the images that lie after the cached prefix."""
    grid = inputs.get("image_grid_thw")
    if grid is None:
        return {}
    types = inputs["mm_token_type_ids"]
    before = 0
    if past_len:  # images wholly inside the cached prefix are already in the cache
        prefix = types[:, :past_len].bool()
        before = int((prefix[:, 1:] & ~prefix[:, :-1]).sum() + prefix[:, 0].sum())
    if before == grid.shape[0]:
        return {}
    rows_before = int(grid[:before].prod(-1).sum())
    return {"pixel_values": inputs["pixel_values"][rows_before:].to(device),
            "image_grid_thw": grid[before:].to(device),
            "mm_token_type_ids": types[:, past_len:].to(device)}


def stream_generate(
    model: torch.nn.Module,
    inputs: Mapping[str, torch.Tensor],
    settings: GenerationSettings = GenerationSettings(),
    *,
    recall: RecallSettings = RecallSettings(),
    recall_token_ids: Mapping[str, int] | None = None,
    memory_db=None,
    tokenizer=None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    interrupt_event: threading.Event | None = None,
    past_key_values=None,
    memory_vectors: Mapping[int, torch.Tensor] | Sequence[Mapping[int, torch.Tensor]] | None = None,
    output_logits: bool = False,
) -> Iterator[Event]:
    """Generate from `inputs` (`input_ids` [B, L], optional `attention_mask`, Qwen3-VL vision
    kwargs), yielding token, recall and finish events, and a `DoneEvent` with the result last.

    `past_key_values` is a cache over a prefix of `input_ids` (an earlier turn): only the rest
    is prefilled. `memory_vectors` maps `<|memory_pad|>` positions of the prompt to the vectors
    injected there in earlier turns; they are placed again at prefill. `logits_processor`
    replaces the list built from `settings`; `stopping_criteria` is added to the built one.
    `output_logits` keeps each step's raw logits in the result (`logits`, [B, steps, V]).
    """
    base = unwrap_model(model)
    backbone, lm_head = backbone_and_head(model)
    embed = base.get_input_embeddings()
    param = next(base.parameters())
    device, dtype = param.device, param.dtype

    input_ids = inputs["input_ids"].to(device)  # [B, L]
    batch, prompt_len = input_ids.shape
    attention_mask = prompt_mask = inputs.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
        if bool(attention_mask.all()):
            attention_mask = None  # no padding: let attention take the causal fast path
    cache = past_key_values if past_key_values is not None else DynamicCache(config=base.config.get_text_config(decoder=True))
    past_len = cache.get_seq_length()
    if past_len >= prompt_len:
        raise ValueError(f"the cache covers {past_len} tokens but the prompt has only {prompt_len}")
    if past_len and attention_mask is not None:
        raise ValueError("reusing a cache needs an unpadded prompt (batch of one)")

    gen_config = base.generation_config
    eos = _as_list(eos_token_id if eos_token_id is not None else gen_config.eos_token_id)
    pad = pad_token_id if pad_token_id is not None else gen_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if eos else 0)

    ids = recall_token_ids or {}
    recall_id, pad_mem_id = ids.get("<recall>"), ids.get("<|memory_pad|>")
    has_bank = memory_db is not None and len(memory_db) > 0
    if has_bank:
        check_bank_dim(base, memory_db.dim)
    recall_on = recall.enabled and has_bank and recall_id is not None and pad_mem_id is not None
    selector = MemorySelector(memory_db, recall) if recall_on else None

    if settings.seed is not None:
        torch.manual_seed(settings.seed)
    if logits_processor is None:
        negative = None
        if settings.guidance_scale != 1 and settings.negative_prompt is not None:
            if tokenizer is None:
                raise ValueError("negative_prompt needs a tokenizer to be encoded")
            negative = tokenizer(settings.negative_prompt, return_tensors="pt").input_ids.to(device)
        logits_processor = build_logits_processor(
            settings, eos_token_id=eos or None, prompt_ids=input_ids, device=device,
            vocab_size=lm_head.weight.shape[0], model=model, negative_prompt_ids=negative,
            attention_mask=None if prompt_mask is None else prompt_mask.to(device))
    criteria = build_stopping_criteria(settings, prompt_length=prompt_len, eos_token_id=eos or None,
                                       tokenizer=tokenizer)
    if stopping_criteria:
        criteria.extend(stopping_criteria)
    has_eos = bool(eos)

    max_len = prompt_len + settings.max_new_tokens
    seq = torch.full((batch, max_len), pad, dtype=torch.long, device=device)  # [B, L + new]
    seq[:, :prompt_len] = input_ids
    mask = None
    if attention_mask is not None:
        mask = torch.ones((batch, max_len), dtype=attention_mask.dtype, device=device)
        mask[:, :prompt_len] = attention_mask
    memory = _per_row(memory_vectors, batch)
    detok = [Detokenizer(tokenizer) for _ in range(batch)] if tokenizer is not None else None
    reasons: list = [None] * batch
    injections: list[RecallEvent] = []
    if hasattr(backbone, "rope_deltas"):
        backbone.rope_deltas = None  # per-request state of Qwen3-VL: never reuse a stale one

    def finish(row: int, reason: str) -> FinishEvent:
        reasons[row] = reason
        return FinishEvent(row, reason)

    t0 = time.perf_counter()
    steps, cur = 0, prompt_len
    if interrupt_event is not None and interrupt_event.is_set():  # stopped while waiting in a queue
        for row in range(batch):
            yield finish(row, "interrupted")
        yield DoneEvent(GenerationResult(input_ids, prompt_len, reasons, [], memory, past_key_values))
        return
    try:
        with torch.no_grad():
            # 1. prefill the uncached part of the prompt, memory vectors at their positions
            emb = embed(input_ids[:, past_len:])  # [B, S, H]
            for row, vectors in enumerate(memory):
                for pos, vec in vectors.items():
                    if pad_mem_id is not None and int(input_ids[row, pos]) != pad_mem_id:
                        raise ValueError(f"memory vector given for position {pos} of row {row}, "
                                         f"which holds token {int(input_ids[row, pos])}, not <|memory_pad|>")
                    if pos >= past_len:
                        emb[row, pos - past_len] = vec.to(device=device, dtype=dtype)
            positions = _prefill_positions(backbone, inputs, input_ids, attention_mask)[..., past_len:]
            out = backbone(inputs_embeds=emb, attention_mask=attention_mask, position_ids=positions,
                           past_key_values=cache, use_cache=True,
                           **_vision_suffix(inputs, input_ids, past_len, device))
            hidden = out.last_hidden_state[:, -1]  # [B, H]
            logits = lm_head(hidden).float()  # [B, V]
            position = positions[..., -1:]  # [B, 1] or [4, B, 1]
            last = input_ids[:, -1].tolist()
            recall_rows = [r for r in range(batch) if recall_on and last[r] == recall_id]
            unfinished = torch.ones(batch, dtype=torch.bool, device=device)
            alive = [True] * batch
            prefill_s = time.perf_counter() - t0
            t1 = time.perf_counter()

            kept_logits: list[torch.Tensor] = []
            held: dict[int, TokenEvent] = {}  # <recall> tokens waiting for their recall
            while True:
                if output_logits:
                    kept_logits.append(logits)
                # 2. the next token of every row
                scores = logits_processor(seq[:, :cur], logits) if logits_processor else logits
                if settings.do_sample:
                    next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
                else:
                    next_tokens = torch.argmax(scores, dim=-1)  # [B]

                # 3. memory head for the rows whose newest input was <recall>: force <|memory_pad|>
                recalled: dict[int, torch.Tensor] = {}
                events: list[Event] = []
                for row in recall_rows:
                    if row in held:
                        token = held.pop(row)
                        text = detok[row].push(token.token_id) if detok is not None else ""
                        events.append(TokenEvent(row, token.token_id, token.position, text))
                    if recall.debug:
                        log.info("[recall] row %d: newest input is <recall> (id %d) at position %d; "
                                 "its hidden state %s is the query", row, recall_id, cur - 1, tuple(hidden[row].shape))
                    choice = selector.choose(hidden[row])
                    recalled[row] = memory_db.vector(choice.index)
                    memory[row][cur] = recalled[row]
                    event = RecallEvent(row, cur, choice.score, choice.index, memory_db.text(choice.index))
                    injections.append(event)
                    events.append(event)
                    if recall.debug:
                        log.info("[inject] row %d: <|memory_pad|> at position %d carries memory %d "
                                 "(similarity %.4f); its vector is the input embedding of the next forward",
                                 row, cur, choice.index, choice.score)
                if recalled:
                    next_tokens[list(recalled)] = pad_mem_id
                if has_eos:
                    next_tokens = torch.where(unfinished, next_tokens, pad)
                seq[:, cur] = next_tokens
                cur += 1
                unfinished &= ~criteria(seq[:, :cur], scores)
                tokens, still = torch.stack((next_tokens, unfinished.long())).tolist()  # the one sync
                steps += 1

                # 4. events, finish reasons; a <recall> token is streamed with its recall, next step
                for row in range(batch):
                    if not alive[row]:
                        continue
                    if recall_on and still[row] and tokens[row] == recall_id:
                        held[row] = TokenEvent(row, tokens[row], cur - 1, "")
                        continue
                    text = detok[row].push(tokens[row]) if detok is not None else ""
                    events.append(TokenEvent(row, tokens[row], cur - 1, text))
                    if settings.early_stop_on_tool_call and detok is not None and TOOL_CALL_END in detok[row].tail:
                        unfinished[row] = False
                        still[row] = 0
                        events.append(finish(row, "tool_call"))
                    elif not still[row]:
                        events.append(finish(row, _stop_reason(tokens[row], eos, cur, max_len, settings, t0)))
                    alive[row] = bool(still[row])
                yield from events
                if not any(alive):
                    break
                if interrupt_event is not None and interrupt_event.is_set():
                    if held:  # stopped right after <recall>: the recall never started, drop its token
                        if batch == 1:
                            cur -= 1
                            cache.crop(-1)  # the cache covers all but the last token, as always
                        else:
                            seq[list(held), cur - 1] = pad
                    for row in range(batch):
                        if alive[row]:
                            yield finish(row, "interrupted")
                    break

                # 5. forward the new tokens; memory vectors replace the <|memory_pad|> embeddings
                recall_rows = [r for r in range(batch) if recall_on and alive[r] and tokens[r] == recall_id]
                emb = embed(next_tokens[:, None])  # [B, 1, H]
                for row, vec in recalled.items():
                    emb[row, 0] = vec.to(device=device, dtype=dtype)
                position = position + 1
                out = backbone(inputs_embeds=emb, position_ids=position, past_key_values=cache, use_cache=True,
                               attention_mask=None if mask is None else mask[:, :cur])
                hidden = out.last_hidden_state[:, -1]  # [B, H]
                logits = lm_head(hidden).float()  # [B, V]
    finally:
        if hasattr(backbone, "rope_deltas"):
            backbone.rope_deltas = None
    decode_s = time.perf_counter() - t1
    yield DoneEvent(GenerationResult(
        sequences=seq[:, :cur], prompt_length=prompt_len, finish_reasons=reasons, injections=injections,
        memory_vectors=memory, cache=cache, prefill_seconds=prefill_s, decode_seconds=decode_s, steps=steps,
        logits=torch.stack(kept_logits, dim=1) if output_logits else None))


def _stop_reason(token: int, eos: list[int], cur: int, max_len: int, settings: GenerationSettings, t0: float) -> str:
    if token in eos:
        return "stop"
    if cur >= max_len or settings.max_time is not None and time.perf_counter() - t0 > settings.max_time:
        return "length"
    return "stop"  # a stop string or a caller's criterion


def generate(*args, **kwargs) -> GenerationResult:
    """`stream_generate` run to the end."""
    for event in stream_generate(*args, **kwargs):
        if isinstance(event, DoneEvent):
            return event.result
    raise RuntimeError("generation ended without a result")

"""Turn `GenerationSettings` into transformers' processors (seed 004's catalogue, all of it but
`HammingDiversityLogitsProcessor`: it works only inside diverse group beam search, which the settings
refuse and transformers 5 no longer ships either: it moved to the Hub).

`build_logits_processor` / `build_stopping_criteria` build, once per request, only what is
switched on, from transformers' own classes and in the order `GenerationMixin.generate` (5.23)
uses. `to_generation_config` maps the same settings onto a `GenerationConfig`, so
`model.generate` decodes with identical processors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList, WatermarkingConfig
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor, EncoderRepetitionPenaltyLogitsProcessor, EpsilonLogitsWarper,
    EtaLogitsWarper, ExponentialDecayLengthPenalty, ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
    NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor, PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor, SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    TypicalLogitsWarper, UnbatchedClassifierFreeGuidanceLogitsProcessor, WatermarkLogitsProcessor,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria, StopStringCriteria,
)

from decoding.settings import GenerationSettings, RecallSettings


def _eos_tensor(eos_token_id, device) -> torch.Tensor | None:
    """EOS id(s) as the 1-D tensor `generate` passes around (`_prepare_special_tokens`)."""
    if eos_token_id is None:
        return None
    return torch.as_tensor(eos_token_id, dtype=torch.long, device=device).reshape(-1)


@dataclass(frozen=True)
class NegativePrompt:
    """The unconditional prompt of classifier-free guidance, tokenized: ids [1, L] and their attention mask."""

    ids: torch.LongTensor
    attention_mask: torch.Tensor | None = None


class Guidance(UnbatchedClassifierFreeGuidanceLogitsProcessor):
    """transformers' classifier-free guidance, its unconditional branch fed every token added since its last call:
    transformers' own feeds only the last one, which is the same while a step adds one token, but a recalled
    memory's span adds k `<|memory_pad|>` slots and its suffix at once (its branch then missed k positions). The
    unconditional branch reads the slots as their token, not the memory's vectors: the memory conditions the answer,
    as the prompt does."""

    def get_unconditional_logits(self, input_ids):
        ctx, first = self.unconditional_context, self.unconditional_context["first_pass"]
        seen, self.seen = getattr(self, "seen", input_ids.shape[1] - 1), input_ids.shape[1]
        if first or ctx["use_cache"] is False or seen == input_ids.shape[1] - 1:
            return super().get_unconditional_logits(input_ids)  # (one new token: transformers' own step)
        new = input_ids[:, seen:]
        ctx["attention_mask"] = torch.cat([ctx["attention_mask"], torch.ones_like(new, dtype=torch.long)], dim=1)
        ctx["input_ids"] = new
        out = self.model(new, attention_mask=ctx["attention_mask"], use_cache=True, cache=ctx["cache"])
        ctx["cache"] = out.get("cache", None)
        return out.logits


def build_logits_processor(
    settings: GenerationSettings, *, eos_token_id: int | list[int] | None, prompt_ids: torch.LongTensor,
    vocab_size: int, model: Any = None, negative_prompt: NegativePrompt | None = None,
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
    attention_mask: torch.Tensor | None = None,
) -> LogitsProcessorList:
    """The processors `generate` would build for `settings`, same classes, arguments and order.

    `prompt_ids` [B, L] is the encoder input of the encoder-side penalties, gives L, and is on the device
    the processors work on; `attention_mask` [B, L] (left padding) keeps the repetition penalty off pad
    tokens; `model` computes the unconditional branch of classifier-free guidance, from `negative_prompt`
    when the settings name one.
    """
    s, procs = settings, LogitsProcessorList()
    if prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids has shape {tuple(prompt_ids.shape)}: must be [batch, length]")
    device = prompt_ids.device
    length, eos = prompt_ids.shape[1], _eos_tensor(eos_token_id, device)
    max_length = length + s.max_new_tokens
    if s.guidance_scale != 1:
        if model is None:
            raise ValueError(f"guidance_scale is {s.guidance_scale}: classifier-free guidance needs model=...")
        if s.negative_prompt is not None and negative_prompt is None:
            raise ValueError(f"negative_prompt is {s.negative_prompt!r} but no NegativePrompt was given: "
                             "tokenize the negative prompt and pass negative_prompt=NegativePrompt(ids)")
        negative = negative_prompt or NegativePrompt(None)
        procs.append(Guidance(
            s.guidance_scale, model, unconditional_ids=negative.ids,
            unconditional_attention_mask=negative.attention_mask, use_cache=True))
    if s.sequence_bias:
        procs.append(SequenceBiasLogitsProcessor(sequence_bias=[[list(ids), b] for ids, b in s.sequence_bias]))
    if s.encoder_repetition_penalty != 1.0:
        procs.append(EncoderRepetitionPenaltyLogitsProcessor(s.encoder_repetition_penalty, prompt_ids))
    if s.repetition_penalty != 1.0:
        padded = attention_mask is not None and not bool((attention_mask == 1).all())  # generate drops all-ones masks
        pads = (attention_mask != 0).int().argmax(dim=1) if padded else None
        procs.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty, prompt_ignore_length=pads))
    if s.no_repeat_ngram_size > 0:
        procs.append(NoRepeatNGramLogitsProcessor(s.no_repeat_ngram_size))
    if s.encoder_no_repeat_ngram_size > 0:
        procs.append(EncoderNoRepeatNGramLogitsProcessor(s.encoder_no_repeat_ngram_size, prompt_ids))
    if s.bad_words_ids:
        procs.append(NoBadWordsLogitsProcessor([list(ids) for ids in s.bad_words_ids], eos))
    # generate: min_new_tokens takes precedence and rewrites min_length to L + min_new_tokens
    min_length = length + s.min_new_tokens if s.min_new_tokens > 0 else s.min_length
    if eos is not None and min_length > 0:
        procs.append(MinLengthLogitsProcessor(min_length, eos, device=device))
    if eos is not None and s.min_new_tokens > 0:
        procs.append(MinNewTokensLengthLogitsProcessor(length, s.min_new_tokens, eos, device=device))
    if prefix_allowed_tokens_fn is not None:
        procs.append(PrefixConstrainedLogitsProcessor(prefix_allowed_tokens_fn, 1))
    if s.forced_bos_token_id is not None:
        procs.append(ForcedBOSTokenLogitsProcessor(s.forced_bos_token_id))
    if s.forced_eos_token_id is not None:
        procs.append(ForcedEOSTokenLogitsProcessor(max_length, s.forced_eos_token_id, device=device))
    if s.remove_invalid_values:
        procs.append(InfNanRemoveLogitsProcessor())
    if s.exponential_decay_length_penalty is not None:
        if eos is None:
            raise ValueError(f"exponential_decay_length_penalty is {s.exponential_decay_length_penalty} but "
                             "eos_token_id is None: it raises the EOS score, so pass eos_token_id=...")
        procs.append(ExponentialDecayLengthPenalty(s.exponential_decay_length_penalty, eos, length))
    if s.suppress_tokens:
        procs.append(SuppressTokensLogitsProcessor(s.suppress_tokens, device=device))
    if s.begin_suppress_tokens:
        begin = length if (length > 1 or s.forced_bos_token_id is None) else length + 1
        procs.append(SuppressTokensAtBeginLogitsProcessor(s.begin_suppress_tokens, begin, device=device))
    if s.do_sample:
        procs.extend(_warpers(s, device))
    if s.watermark:  # after all other processing (transformers #34630)
        procs.append(WatermarkLogitsProcessor(vocab_size=vocab_size, device=device, bias=s.watermark_bias,
                                              greenlist_ratio=s.watermark_greenlist_ratio))
    return procs


WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
           EpsilonLogitsWarper, EtaLogitsWarper, WatermarkLogitsProcessor)  # (and the watermark, after them)


def before_warpers(procs: LogitsProcessorList, proc) -> LogitsProcessorList:
    """`procs` with `proc` inserted where a suppression goes in `generate`'s order: before the warpers (so a
    top-k, top-p or min-p never keeps only what it then suppresses)."""
    at = next((i for i, p in enumerate(procs) if isinstance(p, WARPERS)), len(procs))
    return LogitsProcessorList([*procs[:at], proc, *procs[at:]])


def _warpers(s: GenerationSettings, device: torch.device) -> list:
    """The former "warpers" of a sampled answer, in `generate`'s order; min_tokens_to_keep is 1 without beams."""
    warpers = []
    if s.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(s.temperature))
    if s.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=s.top_k, min_tokens_to_keep=1))
    if s.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=s.top_p, min_tokens_to_keep=1))
    if s.min_p > 0:
        warpers.append(MinPLogitsWarper(min_p=s.min_p, min_tokens_to_keep=1))
    if s.typical_p < 1.0:
        warpers.append(TypicalLogitsWarper(mass=s.typical_p, min_tokens_to_keep=1))
    if s.epsilon_cutoff > 0:
        warpers.append(EpsilonLogitsWarper(epsilon=s.epsilon_cutoff, min_tokens_to_keep=1))
    if s.eta_cutoff > 0:
        warpers.append(EtaLogitsWarper(epsilon=s.eta_cutoff, min_tokens_to_keep=1, device=device))
    return warpers


def make_memory_warper(recall: RecallSettings) -> LogitsProcessorList:
    """Warpers for the memory head's [1, N] similarity scores; empty when recall is greedy."""
    warpers = LogitsProcessorList()
    if not recall.use_sampling:
        return warpers
    if recall.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(recall.temperature))
    if recall.top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=recall.top_k))  # clamps to N itself
    if recall.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=recall.top_p))
    return warpers


def build_stopping_criteria(
    settings: GenerationSettings, *, prompt_length: int, eos_token_id: int | list[int] | None,
    tokenizer: Any = None, max_position_embeddings: int | None = None,
) -> StoppingCriteriaList:
    """Max length, max time, stop strings, EOS: `generate`'s criteria and order."""
    criteria = StoppingCriteriaList([MaxLengthCriteria(prompt_length + settings.max_new_tokens,
                                                       max_position_embeddings=max_position_embeddings)])
    if settings.max_time is not None:
        criteria.append(MaxTimeCriteria(max_time=settings.max_time))
    if settings.stop_strings:
        if tokenizer is None:
            raise ValueError(f"stop_strings is {settings.stop_strings!r} but tokenizer is None: matching stop "
                             "strings needs the model's tokenizer, pass tokenizer=...")
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=list(settings.stop_strings)))
    if eos_token_id is not None:
        criteria.append(EosTokenCriteria(eos_token_id=_eos_tensor(eos_token_id, "cpu")))
    return criteria


def to_generation_config(settings: GenerationSettings, **ids: Any) -> GenerationConfig:
    """`settings` as a `GenerationConfig` (plus `eos_token_id=`, `pad_token_id=`, ... in `ids`).

    Every field is set, so `generate` builds what `build_logits_processor` builds. Greedy maps the
    sampling-only fields to transformers' neutral defaults (they are unused, and this keeps
    `generate` quiet). Fields that are off and only have None for "off" stay None, which
    `generate` fills from `model.generation_config`; `seed` is not part of it (seed yourself).
    """
    s, sampling = settings, settings.do_sample
    return GenerationConfig(
        do_sample=s.do_sample, num_beams=1, num_return_sequences=1, use_cache=True, renormalize_logits=False,
        temperature=s.temperature if sampling else 1.0, top_k=s.top_k if sampling else 50,
        top_p=s.top_p if sampling else 1.0, min_p=s.min_p if sampling and s.min_p > 0 else None, top_h=None,
        typical_p=s.typical_p if sampling else 1.0, epsilon_cutoff=s.epsilon_cutoff if sampling else 0.0,
        eta_cutoff=s.eta_cutoff if sampling else 0.0,
        repetition_penalty=s.repetition_penalty, encoder_repetition_penalty=s.encoder_repetition_penalty,
        no_repeat_ngram_size=s.no_repeat_ngram_size, encoder_no_repeat_ngram_size=s.encoder_no_repeat_ngram_size,
        bad_words_ids=[list(ids) for ids in s.bad_words_ids] or None,
        sequence_bias=[[list(ids), b] for ids, b in s.sequence_bias] or None,
        min_length=s.min_length, min_new_tokens=s.min_new_tokens or None,
        forced_bos_token_id=s.forced_bos_token_id, forced_eos_token_id=s.forced_eos_token_id,
        suppress_tokens=list(s.suppress_tokens) or None, begin_suppress_tokens=list(s.begin_suppress_tokens) or None,
        exponential_decay_length_penalty=s.exponential_decay_length_penalty,
        remove_invalid_values=s.remove_invalid_values, guidance_scale=s.guidance_scale,
        watermarking_config=WatermarkingConfig(greenlist_ratio=s.watermark_greenlist_ratio, bias=s.watermark_bias)
        if s.watermark else None,
        max_new_tokens=s.max_new_tokens, max_time=s.max_time, stop_strings=list(s.stop_strings) or None,
        **ids,
    )

"""Decoding settings and the factories that turn them into transformers' processors.

`GenerationSettings` holds every token-decoding knob with `GenerationConfig`'s meaning;
`build_logits_processor` / `build_stopping_criteria` build, once per request, only what is
switched on, from transformers' own classes and in the order `GenerationMixin.generate` (5.23)
uses. `to_generation_config` maps the same settings onto a `GenerationConfig`, so
`model.generate` decodes with identical processors. Change a frozen settings object with
`dataclasses.replace(settings, **changes)`, which validates again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
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

# ---- validation -------------------------------------------------------------------------------

_KIND = {bool: "a bool", int: "an int", float: "a number", str: "a string"}


def _bad(name: str, value: Any, requirement: str) -> ValueError:
    return ValueError(f"{name} is {value!r}: {requirement}")


def _typed(name: str, value: Any, kind: type, optional: bool = False) -> Any:
    """`value` checked to be of `kind` (ints pass as floats, bools never as numbers)."""
    if value is None and optional:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {bool: isinstance(value, bool), int: isinstance(value, int) and not isinstance(value, bool),
          float: number and math.isfinite(value), str: isinstance(value, str)}[kind]
    if not ok:
        raise _bad(name, value, f"must be {_KIND[kind]}{' or None' if optional else ''}"
                                f" (got {type(value).__name__})")
    return float(value) if kind is float else value


def _ids(name: str, value: Any, *, nonempty: bool = False) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise _bad(name, value, "must be a list of token ids")
    ids = tuple(_typed(name, i, int) for i in value)
    if any(i < 0 for i in ids) or (nonempty and not ids):
        raise _bad(name, value, "token ids must be >= 0" + (" and the list non-empty" if nonempty else ""))
    return ids


def _validate(obj: Any, rules: Mapping[str, tuple]) -> None:
    """Apply `rules` {field: (kind, optional, predicate | None, requirement)} to a frozen dataclass."""
    for name, (kind, optional, check, requirement) in rules.items():
        value = _typed(name, getattr(obj, name), kind, optional)
        if value is not None and check is not None and not check(value):
            raise _bad(name, value, requirement)
        object.__setattr__(obj, name, value)


_GE0, _GE1, _GT0 = (lambda v: v >= 0), (lambda v: v >= 1), (lambda v: v > 0)
_UNIT, _HALF_OPEN = (lambda v: 0 <= v <= 1), (lambda v: 0 <= v < 1)
_ID = (int, True, _GE0, "must be a token id >= 0, or None")

_GENERATION_RULES = {
    "do_sample": (bool, False, None, ""),
    "temperature": (float, False, _GE0, "must be >= 0 (and > 0 when sampling)"),
    "top_k": (int, False, _GE0, "must be >= 0 (0 turns it off)"),
    "top_p": (float, False, _UNIT, "must be in [0, 1] (1 turns it off)"),
    "min_p": (float, False, _UNIT, "must be in [0, 1] (0 turns it off)"),
    "typical_p": (float, False, lambda v: 0 < v <= 1, "must be in (0, 1] (1 turns it off)"),
    "epsilon_cutoff": (float, False, _HALF_OPEN, "must be in [0, 1) (0 turns it off)"),
    "eta_cutoff": (float, False, _HALF_OPEN, "must be in [0, 1) (0 turns it off)"),
    "repetition_penalty": (float, False, _GT0, "must be > 0 (1 turns it off, > 1 penalises repeats)"),
    "encoder_repetition_penalty": (float, False, _GT0, "must be > 0 (1 turns it off)"),
    "no_repeat_ngram_size": (int, False, _GE0, "must be >= 0 (0 turns it off)"),
    "encoder_no_repeat_ngram_size": (int, False, _GE0, "must be >= 0 (0 turns it off)"),
    "min_length": (int, False, _GE0, "must be >= 0"),
    "min_new_tokens": (int, False, _GE0, "must be >= 0"),
    "forced_bos_token_id": _ID,
    "forced_eos_token_id": _ID,
    "remove_invalid_values": (bool, False, None, ""),
    "guidance_scale": (float, False, _GE0, "must be >= 0 (1 turns classifier-free guidance off)"),
    "negative_prompt": (str, True, None, ""),
    "watermark": (bool, False, None, ""),
    "watermark_greenlist_ratio": (float, False, lambda v: 0 < v < 1, "must be in (0, 1)"),
    "watermark_bias": (float, False, None, ""),
    "max_new_tokens": (int, False, _GE1, "must be >= 1"),
    "max_time": (float, True, _GT0, "must be > 0 seconds, or None for no limit"),
    "seed": (int, True, _GE0, "must be >= 0, or None"),
    "early_stop_on_tool_call": (bool, False, None, ""),
}


def _bad_words(name, value):
    if not isinstance(value, (list, tuple)):
        raise _bad(name, value, "must be a list of token-id lists")
    return tuple(_ids(name, seq, nonempty=True) for seq in value)


def _sequence_bias(name, value):
    pairs = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(pairs, (list, tuple)) or any(not isinstance(p, (list, tuple)) or len(p) != 2 for p in pairs):
        raise _bad(name, value, "must be a list of [token ids, bias] pairs")
    return tuple((_ids(name, ids, nonempty=True), _typed(name, bias, float)) for ids, bias in pairs)


def _stop_strings(name, value):
    value = (value,) if isinstance(value, str) else value
    if not isinstance(value, (list, tuple)) or any(not isinstance(s, str) or not s for s in value):
        raise _bad(name, value, "must be a list of non-empty strings")
    return tuple(value)


def _decay(name, value):
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise _bad(name, value, "must be a (start_index, decay_factor) pair, or None")
    start, factor = _typed(name, value[0], int), _typed(name, value[1], float)
    if start < 0 or factor <= 0:
        raise _bad(name, value, "needs start_index >= 0 and decay_factor > 0 (> 1 makes EOS likelier)")
    return start, factor


_GENERATION_SEQUENCES = {
    "bad_words_ids": _bad_words, "sequence_bias": _sequence_bias, "stop_strings": _stop_strings,
    "suppress_tokens": _ids, "begin_suppress_tokens": _ids, "exponential_decay_length_penalty": _decay,
}

# ---- settings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationSettings:
    """Token-decoding parameters, with `transformers.GenerationConfig`'s names and meanings.

    Lists are accepted where tuples are declared (YAML/JSON) and stored as tuples. `min_length`
    counts the prompt; `seed` and `early_stop_on_tool_call` are for our own loop only.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    repetition_penalty: float = 1.0
    encoder_repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    encoder_no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] = ()
    min_length: int = 0
    min_new_tokens: int = 0
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = None
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    exponential_decay_length_penalty: tuple[int, float] | None = None
    remove_invalid_values: bool = False
    guidance_scale: float = 1.0
    negative_prompt: str | None = None
    watermark: bool = False
    watermark_greenlist_ratio: float = 0.25
    watermark_bias: float = 2.0
    max_new_tokens: int = 256
    max_time: float | None = None
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    early_stop_on_tool_call: bool = False

    def __post_init__(self):
        _validate(self, _GENERATION_RULES)
        for name, normalise in _GENERATION_SEQUENCES.items():
            object.__setattr__(self, name, normalise(name, getattr(self, name)))
        if self.do_sample and self.temperature <= 0:
            raise ValueError(f"temperature is {self.temperature} with do_sample=True: temperature must be > 0 "
                             "when sampling; for greedy decoding set do_sample=False")
        if self.negative_prompt is not None and self.guidance_scale == 1:
            raise _bad("negative_prompt", self.negative_prompt, "is only used by classifier-free guidance, which "
                       "guidance_scale=1.0 turns off; set guidance_scale != 1 or negative_prompt=None")


@dataclass(frozen=True)
class RecallSettings:
    """How the memory head picks a memory (`memory.autoregressive_recall` in the YAML).

    Greedy (`use_sampling=False`) takes the argmax of the raw similarity scores; sampling warps
    them with `make_memory_warper` first. `top_k=0` keeps all memories.
    """

    enabled: bool = True
    top_k: int = 5
    top_p: float = 1.0
    temperature: float = 1.0
    use_sampling: bool = False
    debug: bool = False

    def __post_init__(self):
        _validate(self, {
            "enabled": (bool, False, None, ""), "use_sampling": (bool, False, None, ""),
            "debug": (bool, False, None, ""),
            "top_k": (int, False, _GE0, "must be >= 0 (0 keeps all memories)"),
            "top_p": (float, False, lambda v: 0 < v <= 1, "must be in (0, 1] (1 turns it off)"),
            "temperature": (float, False, _GE0, "must be >= 0 (and > 0 when sampling)"),
        })
        if self.use_sampling and self.temperature <= 0:
            raise ValueError(f"temperature is {self.temperature} with use_sampling=True: temperature must be > 0 "
                             "when sampling; for greedy recall set use_sampling=False")


# ---- factories --------------------------------------------------------------------------------


def _eos_tensor(eos_token_id, device) -> torch.Tensor | None:
    """EOS id(s) as the 1-D tensor `generate` passes around (`_prepare_special_tokens`)."""
    if eos_token_id is None:
        return None
    return torch.as_tensor(eos_token_id, dtype=torch.long, device=device).reshape(-1)


def build_logits_processor(
    settings: GenerationSettings, *, eos_token_id: int | list[int] | None, prompt_ids: torch.LongTensor,
    device: torch.device | str, vocab_size: int, model: Any = None,
    negative_prompt_ids: torch.LongTensor | None = None, negative_prompt_attention_mask: torch.Tensor | None = None,
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
    attention_mask: torch.Tensor | None = None,
) -> LogitsProcessorList:
    """The processors `generate` would build for `settings`, same classes, arguments and order.

    `prompt_ids` [B, L] is the encoder input of the encoder-side penalties and gives L;
    `attention_mask` [B, L] (left padding) keeps the repetition penalty off pad tokens;
    `model` computes the unconditional branch of classifier-free guidance.
    """
    s, procs = settings, LogitsProcessorList()
    if prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids has shape {tuple(prompt_ids.shape)}: must be [batch, length]")
    length, eos = prompt_ids.shape[1], _eos_tensor(eos_token_id, device)
    max_length = length + s.max_new_tokens
    if s.guidance_scale != 1:
        if model is None:
            raise ValueError(f"guidance_scale is {s.guidance_scale}: classifier-free guidance needs model=...")
        if s.negative_prompt is not None and negative_prompt_ids is None:
            raise ValueError(f"negative_prompt is {s.negative_prompt!r} but negative_prompt_ids is None: "
                             "tokenize the negative prompt and pass negative_prompt_ids=...")
        procs.append(UnbatchedClassifierFreeGuidanceLogitsProcessor(
            s.guidance_scale, model, unconditional_ids=negative_prompt_ids,
            unconditional_attention_mask=negative_prompt_attention_mask, use_cache=True))
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
    if s.do_sample:  # the former "warpers"; min_tokens_to_keep is 1 without beams
        if s.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(s.temperature))
        if s.top_k != 0:
            procs.append(TopKLogitsWarper(top_k=s.top_k, min_tokens_to_keep=1))
        if s.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=s.top_p, min_tokens_to_keep=1))
        if s.min_p > 0:
            procs.append(MinPLogitsWarper(min_p=s.min_p, min_tokens_to_keep=1))
        if s.typical_p < 1.0:
            procs.append(TypicalLogitsWarper(mass=s.typical_p, min_tokens_to_keep=1))
        if s.epsilon_cutoff > 0:
            procs.append(EpsilonLogitsWarper(epsilon=s.epsilon_cutoff, min_tokens_to_keep=1))
        if s.eta_cutoff > 0:
            procs.append(EtaLogitsWarper(epsilon=s.eta_cutoff, min_tokens_to_keep=1, device=device))
    if s.watermark:  # after all other processing (transformers #34630)
        procs.append(WatermarkLogitsProcessor(vocab_size=vocab_size, device=device, bias=s.watermark_bias,
                                              greenlist_ratio=s.watermark_greenlist_ratio))
    return procs


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

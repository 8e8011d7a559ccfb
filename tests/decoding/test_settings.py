"""decoding.settings: validation, and processors / criteria identical to what `generate` builds."""

from __future__ import annotations

import dataclasses

import math
import time

import pytest
import torch
from transformers.generation.logits_process import (
    SuppressTokensLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria, StopStringCriteria,
)

from decoding.processors import (
    Guidance, NegativePrompt, build_logits_processor, build_stopping_criteria, make_memory_warper, to_generation_config,
)
from chat.config import ConfigError, load_config, request_settings
from decoding.settings import BEAM_SEARCH, GenerationSettings, RecallSettings

EOS = 2  # SmolLM2's <|im_end|>, also the pad token of the tiny model


class _Built(Exception):
    """Raised by the spy once `generate` has built its processors and criteria (no decoding runs)."""


def generate_built(model, settings, prompt_ids, **generate_kwargs):
    """The (processors, criteria) `model.generate` builds for `to_generation_config(settings)`."""
    built = {}
    get_processors, get_criteria = model._get_logits_processor, model._get_stopping_criteria

    def processors(**kwargs):
        built["processors"] = get_processors(**kwargs)
        return built["processors"]

    def criteria(**kwargs):
        built["criteria"] = get_criteria(**kwargs)
        raise _Built

    config = to_generation_config(settings, eos_token_id=EOS, pad_token_id=EOS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "_get_logits_processor", processors)
        mp.setattr(model, "_get_stopping_criteria", criteria)
        with pytest.raises(_Built):
            model.generate(prompt_ids, generation_config=config, **generate_kwargs)
    return built["processors"], built["criteria"]


def allow_even(batch_id, ids):
    return list(range(0, 60, 2))


PENALTIES = dict(
    repetition_penalty=1.3, encoder_repetition_penalty=1.1, no_repeat_ngram_size=2, encoder_no_repeat_ngram_size=2,
    bad_words_ids=[[5], [6, 7]], sequence_bias=[[[8], 2.0], [[3, 4], -1.5]], min_new_tokens=2,
    suppress_tokens=[9, 10], begin_suppress_tokens=[11, EOS], exponential_decay_length_penalty=(1, 1.5),
    remove_invalid_values=True, forced_eos_token_id=12,
)
SAMPLE = dict(do_sample=True, top_k=0)
COMBOS = {
    "greedy": dict(),
    "greedy_ignores_warpers": dict(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2),
    "temperature_top_k_top_p": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9),
    "min_p": dict(SAMPLE, temperature=1.5, min_p=0.1),
    "typical": dict(SAMPLE, typical_p=0.8),
    "epsilon": dict(SAMPLE, epsilon_cutoff=3e-5),
    "eta": dict(SAMPLE, eta_cutoff=1e-3),
    "penalties": PENALTIES,
    "penalties_sampled": dict(PENALTIES, do_sample=True, temperature=0.8, top_k=40, top_p=0.95),
    "min_length_forced_bos": dict(min_length=8, forced_bos_token_id=1, begin_suppress_tokens=[13]),
    "watermark": dict(SAMPLE, watermark=True, watermark_greenlist_ratio=0.5, watermark_bias=3.0),
    "cfg_negative_prompt": dict(guidance_scale=1.5, negative_prompt="a rude reply"),
    "cfg_no_negative_prompt": dict(guidance_scale=3.0, do_sample=True, top_k=10),
}


def _prompt(batch, length=6, seed=0):
    return torch.randint(3, 40, (batch, length), generator=torch.Generator().manual_seed(seed))


# classifier-free guidance runs unbatched in transformers, so it has no padded-batch variant
CASES = [(name, variant) for name in COMBOS for variant in ("plain", "padded", "prefix_fn")
         if not (variant == "padded" and COMBOS[name].get("guidance_scale", 1) != 1)]


@pytest.mark.parametrize("name, variant", CASES)
def test_processors_match_generate(tiny_llama, name, variant):
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    settings = GenerationSettings(max_new_tokens=5, **COMBOS[name])
    cfg = settings.guidance_scale != 1
    prompt = _prompt(1 if cfg else 2)
    extra = {}
    if variant == "padded":
        extra["attention_mask"] = torch.ones_like(prompt)
        extra["attention_mask"][0, :2] = 0
        prompt[0, :2] = EOS
    if variant == "prefix_fn":
        extra["prefix_allowed_tokens_fn"] = allow_even
    if settings.negative_prompt is not None:
        extra["negative_prompt_ids"] = tok(settings.negative_prompt, return_tensors="pt").input_ids
    theirs, _ = generate_built(model, settings, prompt, **extra)
    if "negative_prompt_ids" in extra:  # generate's keyword, our NegativePrompt
        extra["negative_prompt"] = NegativePrompt(extra.pop("negative_prompt_ids"))
    ours = build_logits_processor(settings, eos_token_id=EOS, prompt_ids=prompt,
                                  vocab_size=model.config.vocab_size, model=model, **extra)
    # (ours: transformers' classes; guidance's subclass feeds a memory's whole span, the same one token at a time)
    assert [UnbatchedClassifierFreeGuidanceLogitsProcessor if isinstance(p, Guidance) else type(p)
            for p in ours] == [type(p) for p in theirs]
    if name not in ("greedy", "greedy_ignores_warpers"):
        assert len(ours) > 0

    # the real proof: identical scores step by step (stateful ones, e.g. CFG, see the same history)
    gen = torch.Generator().manual_seed(1)
    ids = torch.cat([prompt, torch.randint(3, 40, (prompt.shape[0], settings.max_new_tokens), generator=gen)], 1)
    changed = False
    for step in range(settings.max_new_tokens):
        cur = ids[:, : prompt.shape[1] + step]
        scores = 3 * torch.randn(prompt.shape[0], model.config.vocab_size, generator=gen)
        if settings.remove_invalid_values:
            scores[:, 20], scores[:, 21] = math.nan, math.inf
        out_ours, out_theirs = ours(cur, scores.clone()), theirs(cur, scores.clone())
        torch.testing.assert_close(out_ours, out_theirs, rtol=0, atol=0, equal_nan=True)
        changed |= not torch.equal(out_ours.nan_to_num(), scores.nan_to_num())
    assert changed == (len(ours) > 0)


def test_min_new_tokens_overrides_min_length_like_generate(tiny_llama):
    prompt = _prompt(1)
    settings = GenerationSettings(min_length=20, min_new_tokens=2, max_new_tokens=4)
    theirs, _ = generate_built(tiny_llama.model, settings, prompt)
    ours = build_logits_processor(settings, eos_token_id=EOS, prompt_ids=prompt, vocab_size=100)
    assert [p.min_length for p in ours[:1]] == [p.min_length for p in theirs[:1]] == [prompt.shape[1] + 2]


def _our_decode(model, settings, prompt, **extra):
    """A plain loop over our processors and criteria, sampling like `generate`'s `_sample`."""
    procs = build_logits_processor(settings, eos_token_id=EOS, prompt_ids=prompt,
                                   vocab_size=model.config.vocab_size, model=model, **extra)
    stops = build_stopping_criteria(settings, prompt_length=prompt.shape[1], eos_token_id=EOS)
    ids = prompt
    while True:
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float()  # [B, V]
        scores = procs(ids, logits)
        if settings.do_sample:
            token = torch.multinomial(torch.softmax(scores, -1), 1)[:, 0]
        else:
            token = scores.argmax(-1)
        ids = torch.cat([ids, token[:, None]], 1)
        if stops(ids, None).all():
            return ids


@pytest.mark.parametrize("kwargs", [
    dict(repetition_penalty=1.5, no_repeat_ngram_size=2, suppress_tokens=[EOS]),
    dict(do_sample=True, temperature=0.7, top_k=30, top_p=0.9, min_new_tokens=3, sequence_bias=[[[17], 4.0]]),
], ids=["greedy", "sampled"])
def test_generate_with_to_generation_config_decodes_like_our_processors(tiny_llama, kwargs):
    model = tiny_llama.model
    settings = GenerationSettings(max_new_tokens=8, seed=3, **kwargs)
    prompt = _prompt(1, seed=5)
    torch.manual_seed(settings.seed)
    ours = _our_decode(model, settings, prompt)
    torch.manual_seed(settings.seed)
    theirs = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                            generation_config=to_generation_config(settings, eos_token_id=EOS, pad_token_id=EOS))
    assert ours.shape[1] > prompt.shape[1]
    assert ours.tolist() == theirs.tolist()


def test_builder_errors_name_what_is_missing(tiny_llama):
    prompt = _prompt(1)
    build = dict(eos_token_id=EOS, prompt_ids=prompt, vocab_size=100)
    with pytest.raises(ValueError, match="guidance_scale is 1.5.*model="):
        build_logits_processor(GenerationSettings(guidance_scale=1.5), **build)
    with pytest.raises(ValueError, match="negative_prompt is 'no'.*NegativePrompt"):
        build_logits_processor(GenerationSettings(guidance_scale=1.5, negative_prompt="no"), model=object(), **build)
    with pytest.raises(ValueError, match="exponential_decay_length_penalty.*eos_token_id"):
        build_logits_processor(GenerationSettings(exponential_decay_length_penalty=(2, 1.2)),
                               **dict(build, eos_token_id=None))
    with pytest.raises(ValueError, match=r"prompt_ids has shape \(6,\)"):
        build_logits_processor(GenerationSettings(), **dict(build, prompt_ids=prompt[0]))


# ---- validation -------------------------------------------------------------------------------

INVALID = [  # field, value, text the message must show
    ("do_sample", "true", "'true'"), ("temperature", "hot", "'hot'"), ("temperature", -0.5, "-0.5"),
    ("temperature", math.nan, "nan"), ("top_k", -3, "-3"), ("top_k", True, "True"), ("top_k", 2.5, "2.5"),
    ("top_p", 1.5, "1.5"), ("top_p", -0.1, "-0.1"), ("top_p", None, "None"), ("min_p", 1.2, "1.2"),
    ("typical_p", 0.0, "0.0"), ("typical_p", 1.5, "1.5"), ("epsilon_cutoff", 1.0, "1.0"),
    ("eta_cutoff", -0.1, "-0.1"), ("eta_cutoff", 1.0, "1.0"), ("repetition_penalty", 0.0, "0.0"),
    ("encoder_repetition_penalty", -1.0, "-1.0"), ("no_repeat_ngram_size", -1, "-1"),
    ("encoder_no_repeat_ngram_size", -2, "-2"), ("bad_words_ids", [[1, -5]], "-5"), ("bad_words_ids", [[]], "[]"),
    ("bad_words_ids", "abc", "'abc'"), ("sequence_bias", [[[1], "x"]], "'x'"), ("sequence_bias", [[[-1], 1.0]], "-1"),
    ("sequence_bias", [[1, 2, 3]], "[1, 2, 3]"), ("min_length", -1, "-1"), ("min_new_tokens", -1, "-1"),
    ("forced_bos_token_id", -1, "-1"), ("forced_eos_token_id", "2", "'2'"), ("suppress_tokens", [-4], "-4"),
    ("begin_suppress_tokens", [1.5], "1.5"), ("suppress_tokens", 7, "7"),
    ("exponential_decay_length_penalty", (5,), "(5,)"), ("exponential_decay_length_penalty", (-1, 1.5), "(-1, 1.5)"),
    ("exponential_decay_length_penalty", (3, 0.0), "(3, 0.0)"), ("remove_invalid_values", "yes", "'yes'"),
    ("guidance_scale", -0.5, "-0.5"), ("negative_prompt", 5, "5"), ("watermark", 1, "1"),
    ("watermark_greenlist_ratio", 1.0, "1.0"), ("watermark_greenlist_ratio", 0.0, "0.0"),
    ("watermark_bias", "big", "'big'"), ("max_new_tokens", 0, "0"), ("max_new_tokens", 10.0, "10.0"),
    ("max_time", 0.0, "0.0"), ("max_time", -1, "-1"), ("stop_strings", [""], "['']"), ("stop_strings", [3], "[3]"),
    ("seed", -1, "-1"), ("seed", "1", "'1'"), ("seed", 2 ** 70, str(2 ** 70)), ("early_stop_on_tool_call", None, "None"),
]


@pytest.mark.parametrize("field, value, shown", INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_invalid_generation_settings_name_field_and_value(field, value, shown):
    with pytest.raises(ValueError) as err:
        GenerationSettings(**{field: value})
    message = str(err.value)
    assert message.startswith(field) and shown in message and ("must" in message or "needs" in message), message


BEAMS = [("num_beams", 4), ("num_beam_groups", 2), ("diversity_penalty", 0.5), ("diversity_penalty", -1.0)]


@pytest.mark.parametrize("field, value", BEAMS, ids=[f"{f}={v!r}" for f, v in BEAMS])
def test_beam_search_settings_are_refused_by_name_wherever_settings_come_in(field, value):
    """Seed 004's HammingDiversityLogitsProcessor needs diverse group beam search, which a streaming recall chat
    does not offer: the settings, the YAML / command line and a request's values refuse it with the setting, the
    value and why, rather than decoding without beams."""
    why = rf"{field} is {value!r}: must be .*beam search is not offered in a streaming recall chat: each token .*recall"
    with pytest.raises(ValueError, match="^" + why):
        GenerationSettings(**{field: value})
    with pytest.raises(ConfigError, match="^generation: " + why):
        load_config(overrides=[f"generation.{field}={value}"], environ={})
    with pytest.raises(ValueError, match="^" + why):
        request_settings(load_config(environ={}), {f"generation.{field}": value})
    assert set(BEAM_SEARCH) == {f for f, _ in BEAMS}
    assert GenerationSettings(num_beams=1, num_beam_groups=1, diversity_penalty=0) == GenerationSettings()  # off


def test_cross_field_errors_say_what_to_do():
    with pytest.raises(ValueError, match=r"^temperature is 0.0 with do_sample=True: .*set do_sample=False"):
        GenerationSettings(do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match=r"^negative_prompt is 'meh'.*guidance_scale"):
        GenerationSettings(negative_prompt="meh")
    GenerationSettings(temperature=0.0)  # fine for greedy decoding
    with pytest.raises(ValueError, match=r"^min_new_tokens is 50: must be at most max_new_tokens \(10\)"):
        GenerationSettings(min_new_tokens=50, max_new_tokens=10)  # (its answer was empty, ended by max_new_tokens)
    GenerationSettings(min_new_tokens=10, max_new_tokens=10)


def test_lists_become_tuples_numbers_floats_and_settings_stay_hashable():
    s = GenerationSettings(temperature=1, bad_words_ids=[[1, 2], [3]], sequence_bias={(4, 5): -1},
                           suppress_tokens=[6], stop_strings="END", exponential_decay_length_penalty=[3, 2],
                           max_time=2)
    assert s.bad_words_ids == ((1, 2), (3,)) and s.sequence_bias == (((4, 5), -1.0),)
    assert s.suppress_tokens == (6,) and s.stop_strings == ("END",)
    assert s.exponential_decay_length_penalty == (3, 2.0) and isinstance(s.temperature, float)
    assert isinstance(s.max_time, float) and hash(s) == hash(GenerationSettings(**vars(s)))


def test_dataclasses_replace_validates_again():
    s = GenerationSettings()
    assert dataclasses.replace(s, top_p=0.5).top_p == 0.5 and s.top_p == 1.0
    with pytest.raises(ValueError, match="top_p is 2.0"):
        dataclasses.replace(s, top_p=2.0)
    with pytest.raises(ValueError, match="top_k is -1"):
        dataclasses.replace(RecallSettings(), top_k=-1)


def test_to_generation_config_sets_every_decoding_field():
    s = GenerationSettings(do_sample=True, top_k=0, min_p=0.05, stop_strings=["x"], watermark=True, max_time=3.0)
    config = to_generation_config(s, eos_token_id=EOS, pad_token_id=EOS)
    assert (config.top_k, config.min_p, config.stop_strings, config.max_time) == (0, 0.05, ["x"], 3.0)
    assert config.watermarking_config.greenlist_ratio == 0.25 and config.eos_token_id == EOS
    greedy = to_generation_config(GenerationSettings(temperature=0.0, top_k=3))
    assert (greedy.do_sample, greedy.temperature, greedy.top_k, greedy.min_p) == (False, 1.0, 50, None)


# ---- recall -----------------------------------------------------------------------------------

RECALL_INVALID = [
    ("top_k", -1, "-1"), ("top_k", 1.5, "1.5"), ("top_p", 0.0, "0.0"), ("top_p", 1.5, "1.5"),
    ("temperature", -1.0, "-1.0"), ("temperature", "warm", "'warm'"), ("enabled", "yes", "'yes'"),
    ("use_sampling", 1, "1"), ("debug", None, "None"),
]


@pytest.mark.parametrize("field, value, shown", RECALL_INVALID, ids=[f"{f}={v!r}" for f, v, _ in RECALL_INVALID])
def test_invalid_recall_settings_name_field_and_value(field, value, shown):
    with pytest.raises(ValueError) as err:
        RecallSettings(**{field: value})
    assert str(err.value).startswith(field) and shown in str(err.value)


def test_recall_temperature_must_be_positive_only_when_sampling():
    with pytest.raises(ValueError, match="temperature is 0.0 with use_sampling=True.*use_sampling=False"):
        RecallSettings(use_sampling=True, temperature=0.0)
    assert RecallSettings(temperature=0).temperature == 0.0


SCORES = torch.tensor([[3.0, 1.0, 2.0, 0.5]])  # [1, N] memory similarities


def _kept(warpers):
    return torch.isfinite(warpers(None, SCORES.clone()))[0].tolist()


def test_memory_warper_is_empty_for_greedy_recall():
    assert len(make_memory_warper(RecallSettings(top_k=2, top_p=0.5, temperature=0.5))) == 0


@pytest.mark.parametrize("top_k, top_p, kept", [
    (2, 1.0, [True, False, True, False]),
    (10, 1.0, [True, True, True, True]),  # top_k > N clamps to N
    (0, 0.7, [True, False, True, False]),  # p = .61, .08, .22, .05
    (0, 0.5, [True, False, False, False]),
    (3, 0.7, [True, False, True, False]),
])
def test_memory_warper_masks(top_k, top_p, kept):
    assert _kept(make_memory_warper(RecallSettings(use_sampling=True, top_k=top_k, top_p=top_p))) == kept


def test_memory_warper_order_and_temperature():
    warpers = make_memory_warper(RecallSettings(use_sampling=True, temperature=0.5, top_k=3, top_p=0.9))
    assert [type(w) for w in warpers] == [TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper]
    only_temperature = make_memory_warper(RecallSettings(use_sampling=True, temperature=0.5, top_k=0))
    torch.testing.assert_close(only_temperature(None, SCORES.clone()), SCORES * 2)


# ---- stopping criteria ------------------------------------------------------------------------


def test_stopping_criteria_match_generate(tiny_llama):
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    settings = GenerationSettings(max_new_tokens=7, max_time=30.0, stop_strings=["DONE", "\n\n"])
    prompt = _prompt(1)
    _, theirs = generate_built(model, settings, prompt, tokenizer=tok)
    ours = build_stopping_criteria(settings, prompt_length=prompt.shape[1], eos_token_id=EOS, tokenizer=tok,
                                   max_position_embeddings=model.config.max_position_embeddings)
    assert [type(c) for c in ours] == [type(c) for c in theirs] == [
        MaxLengthCriteria, MaxTimeCriteria, StopStringCriteria, EosTokenCriteria]
    assert (ours[0].max_length, ours[0].max_position_embeddings) == (theirs[0].max_length, 512)
    ids = tok(["the answer is DONE", "the answer is none"], return_tensors="pt", padding=True).input_ids
    assert ours[2](ids, None).tolist() == theirs[2](ids, None).tolist() == [True, False]


def test_max_length_and_eos():
    criteria = build_stopping_criteria(GenerationSettings(max_new_tokens=3), prompt_length=4, eos_token_id=[EOS, 7])
    assert [type(c) for c in criteria] == [MaxLengthCriteria, EosTokenCriteria]
    assert criteria(torch.tensor([[5, 5, 5, 5, 5, 5]]), None).tolist() == [False]
    assert criteria(torch.tensor([[5, 5, 5, 5, 5, 5, 5]]), None).tolist() == [True]
    assert criteria(torch.tensor([[5, 5, 5, 5, 7], [5, 5, 5, 5, 5], [5, 5, 5, 5, EOS]]), None).tolist() == [
        True, False, True]
    assert len(build_stopping_criteria(GenerationSettings(), prompt_length=4, eos_token_id=None)) == 1


def test_stop_strings_with_real_tokenizer(tiny_llama):
    tok = tiny_llama.tokenizer
    criteria = build_stopping_criteria(GenerationSettings(stop_strings=["</tool_call>"]), prompt_length=1,
                                       eos_token_id=None, tokenizer=tok)
    assert criteria(tok("call <tool_call>{}</tool_call>", return_tensors="pt").input_ids, None).tolist() == [True]
    assert criteria(tok("call <tool_call>{}", return_tensors="pt").input_ids, None).tolist() == [False]
    with pytest.raises(ValueError, match=r"stop_strings is \('</tool_call>',\).*tokenizer="):
        build_stopping_criteria(GenerationSettings(stop_strings=["</tool_call>"]), prompt_length=1, eos_token_id=None)


def test_max_time():
    settings = GenerationSettings(max_time=5.0)
    (max_time,) = [c for c in build_stopping_criteria(settings, prompt_length=1, eos_token_id=None)
                   if isinstance(c, MaxTimeCriteria)]
    assert max_time.max_time == 5.0
    ids = torch.tensor([[1, 2]])
    max_time.initial_timestamp = time.time() + 1000  # started "in the future": not over
    assert max_time(ids, None).tolist() == [False]
    max_time.initial_timestamp = time.time() - 1000
    assert max_time(ids, None).tolist() == [True]


def test_cfg_processor_gets_the_negative_prompt(tiny_llama):
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    negative = tok("a rude reply", return_tensors="pt").input_ids
    procs = build_logits_processor(GenerationSettings(guidance_scale=2.0, negative_prompt="a rude reply",
                                                      suppress_tokens=[3]),
                                   eos_token_id=EOS, prompt_ids=_prompt(1), vocab_size=1, model=model,
                                   negative_prompt=NegativePrompt(negative))
    assert [type(p) for p in procs] == [Guidance, SuppressTokensLogitsProcessor]
    assert procs[0].unconditional_context["input_ids"] is negative and procs[0].model is model

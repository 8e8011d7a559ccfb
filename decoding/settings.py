"""Decoding settings: frozen, validated dataclasses (`decoding.processors` turns them into
transformers' processors).

`GenerationSettings` holds every token-decoding knob with `GenerationConfig`'s meaning, plus our
loop's own (seed, entropy layer decoding, the two-model mixture). Change a frozen settings object
with `dataclasses.replace(settings, **changes)`, which validates again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from decoding.gamma import GAMMA_MAX, GAMMA_MIN

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


# Entropy-based intermediate-layer decoding (seed 002, `decoding/entropy.py`); None turns it off.
ENTROPY_MODES = ("trough", "random_after")

# Beam search's settings (`GenerationConfig`'s names), refused unless off: seed 004's HammingDiversityLogitsProcessor
# works only inside diverse group beam search, which a streaming recall loop does not offer.
BEAM_SEARCH = ("num_beams", "num_beam_groups", "diversity_penalty")
_NO_BEAMS = ("beam search is not offered in a streaming recall chat: each token is streamed as it is chosen and may "
             "trigger a recall that changes the KV cache of one sequence, so there are no beams to keep, compare "
             "or diversify (HammingDiversityLogitsProcessor needs diverse group beam search)")

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
    "watermark_bias": (float, False, lambda v: 0 <= v <= 100, "must be in [0, 100] (the logit added to the green "
                       "list's tokens, as logit_bias is bounded)"),
    "max_new_tokens": (int, False, _GE1, "must be >= 1"),
    "max_time": (float, True, _GT0, "must be > 0 seconds, or None for no limit"),
    "seed": (int, True, lambda v: 0 <= v < 2 ** 64, "must be from 0 to 2**64 - 1 (a generator's seed), or None"),
    "early_stop_on_tool_call": (bool, False, None, ""),
    "entropy_decoding": (str, True, lambda v: v in ENTROPY_MODES,
                         f"must be None (off) or one of {', '.join(map(repr, ENTROPY_MODES))}"),
    "entropy_record_tokens": (bool, False, None, ""),
    "num_beams": (int, False, lambda v: v == 1, f"must be 1, because {_NO_BEAMS}"),
    "num_beam_groups": (int, False, lambda v: v == 1, f"must be 1, because {_NO_BEAMS}"),
    "diversity_penalty": (float, False, lambda v: v == 0, f"must be 0.0, because {_NO_BEAMS}"),
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


MAX_STOPS, MAX_STOP_CHARS = 16, 100  # (transformers' StopStringCriteria reads the vocabulary for each: 100 stop
# strings held the model 2.5-11 s before an answer began, 1,000 for 17 s; 16 of 100 characters: under a second)


def _stop_strings(name, value):
    value = (value,) if isinstance(value, str) else value
    if not isinstance(value, (list, tuple)) or any(not isinstance(s, str) or not s for s in value):
        raise _bad(name, value, "must be a list of non-empty strings")
    if len(value) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in value):
        raise ValueError(f"{name}: expected at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters, got "
                         f"{len(value)} of up to {max(map(len, value))} characters")
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


DRAFTS = ("ngram", "theta", "target", "head", "gguf")
GAMMA_RULES = ("fixed", "seed", "acceptance")  # decoding/gamma.py
GAMMA_LIMIT = 64  # the most drafts a verify checks (one forward of γ + 1 positions)


@dataclass(frozen=True)
class MixtureSettings:
    """Sampling q* of two models. `target`: π_t's model folder, or None for the PEFT model's own base
    (its adapter off). `alpha`: "auto" (α* per step) or a fixed weight of π_θ in [0, 1].
    `speculative`: exact speculative sampling with `gamma` drafts per verify from `draft` ("ngram":
    prompt lookup over `ngram`-grams, free; "theta" / "target": one of the two models, whose logits
    the verify reuses when the pair runs as two forwards; "head": an EAGLE draft head over θ's features
    from the folder `head`, written by `python -m training.draft`; "gguf": a quantized model with the
    same tokenizer run by llama.cpp, the file `gguf` or, when None, the embedded SmolLM2's own Q4_1
    GGUF). `gamma_rule`: "fixed" (γ every round), "seed" (seed 003's adaptive k: γ from α* of the last
    verified position) or "acceptance" (γ from the kept share of the last rounds' drafts), each within
    max(3, γ − 2) .. min(10, γ + 3) (decoding/gamma.py). `tol`: α*'s solver tolerance."""

    enabled: bool = False
    target: str | None = None
    alpha: str | float = "auto"
    speculative: bool = False  # the app config turns it on, draft gguf: 1.6-1.7x of direct q* (bench/mixture.py)
    gamma: int = 4
    gamma_rule: str = "fixed"
    draft: str = "theta"
    ngram: int = 3
    head: str | None = None
    gguf: str | None = None
    tol: float = 1e-6

    def __post_init__(self):
        a, number = self.alpha, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        checks = [("enabled", isinstance(self.enabled, bool), "must be a bool"),
                  ("speculative", isinstance(self.speculative, bool), "must be a bool"),
                  ("target", self.target is None or isinstance(self.target, str) and self.target != "",
                   "must be a model folder path, or None for the PEFT model's own base"),
                  ("alpha", a == "auto" or number(a) and 0 <= a <= 1, 'must be "auto" or a number in [0, 1] (the weight of π_θ)'),
                  ("gamma", isinstance(self.gamma, int) and not isinstance(self.gamma, bool)
                   and 1 <= self.gamma <= GAMMA_LIMIT, f"must be an int from 1 to {GAMMA_LIMIT}"),
                  ("ngram", isinstance(self.ngram, int) and not isinstance(self.ngram, bool) and self.ngram >= 1,
                   "must be an int >= 1"),
                  ("head", self.head is None or isinstance(self.head, str) and self.head != "",
                   "must be a draft head folder (written by python -m training.draft), or None"),
                  ("gguf", self.gguf is None or isinstance(self.gguf, str) and self.gguf != "",
                   "must be a .gguf file with the models' tokenizer, or None for the embedded SmolLM2's own"),
                  ("gamma_rule", self.gamma_rule in GAMMA_RULES, f"must be one of {', '.join(GAMMA_RULES)}"),
                  ("draft", self.draft in DRAFTS, f"must be one of {', '.join(DRAFTS)}"),
                  ("tol", number(self.tol) and 0 < self.tol <= 0.01, "must be a number in (0, 0.01]"),
                  ("gamma", self.gamma_rule == "fixed" or not isinstance(self.gamma, int)
                   or GAMMA_MIN <= self.gamma <= GAMMA_MAX,
                   f"must be from {GAMMA_MIN} to {GAMMA_MAX} with gamma_rule={self.gamma_rule!r} (seed 003's bounds "
                   "on k: its lengths max(3, γ − 2) and min(10, γ + 3) would invert outside them)")]
        for name, ok, requirement in checks:
            if not ok:
                raise ValueError(f"mixture {name} is {getattr(self, name)!r}: {requirement}")
        object.__setattr__(self, "alpha", a if a == "auto" else float(a))


@dataclass(frozen=True)
class GenerationSettings:
    """Token-decoding parameters, with `transformers.GenerationConfig`'s names and meanings.

    Lists are accepted where tuples are declared (YAML/JSON) and stored as tuples. `min_length`
    counts the prompt; `seed`, `early_stop_on_tool_call` and the entropy fields are for our own
    loop only. `entropy_decoding` ("trough" | "random_after", seed 002) decodes each step from an
    intermediate layer chosen by the entropy of its processed distribution; `entropy_record_tokens`
    also keeps every layer's raw argmax (it does nothing while `entropy_decoding` is None).
    `num_beams`, `num_beam_groups` and `diversity_penalty` exist to be refused by name unless off
    (`BEAM_SEARCH`): there is no beam search in a streaming recall chat.
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
    entropy_decoding: str | None = None
    entropy_record_tokens: bool = False
    num_beams: int = 1
    num_beam_groups: int = 1
    diversity_penalty: float = 0.0
    mixture: MixtureSettings = MixtureSettings()

    def token_ids(self) -> dict[str, list[int]]:
        """The token ids each setting that names tokens names (for a check against the model's vocabulary)."""
        named = {"bad_words_ids": [t for ids in self.bad_words_ids for t in ids],
                 "sequence_bias": [t for ids, _ in self.sequence_bias for t in ids],
                 "suppress_tokens": list(self.suppress_tokens), "begin_suppress_tokens": list(self.begin_suppress_tokens),
                 "forced_bos_token_id": [self.forced_bos_token_id], "forced_eos_token_id": [self.forced_eos_token_id]}
        return {name: [t for t in ids if t is not None] for name, ids in named.items()}

    def __post_init__(self):
        _validate(self, _GENERATION_RULES)
        for name, normalise in _GENERATION_SEQUENCES.items():
            object.__setattr__(self, name, normalise(name, getattr(self, name)))
        if self.do_sample and self.temperature <= 0:
            raise ValueError(f"temperature is {self.temperature} with do_sample=True: temperature must be > 0 "
                             "when sampling; for greedy decoding set do_sample=False")
        if self.min_new_tokens > self.max_new_tokens:  # (the answer could only end at max_new_tokens, empty of its end)
            raise _bad("min_new_tokens", self.min_new_tokens, f"must be at most max_new_tokens ({self.max_new_tokens})")
        if self.negative_prompt is not None and self.guidance_scale == 1:
            raise _bad("negative_prompt", self.negative_prompt, "is only used by classifier-free guidance, which "
                       "guidance_scale=1.0 turns off; set guidance_scale != 1 or negative_prompt=None")
        if isinstance(self.mixture, Mapping):  # from YAML / JSON
            object.__setattr__(self, "mixture", MixtureSettings(**self.mixture))
        if not isinstance(self.mixture, MixtureSettings):
            raise _bad("mixture", self.mixture, "must be MixtureSettings or a mapping of its fields")
        if self.mixture.enabled and (self.entropy_decoding is not None or self.guidance_scale != 1):
            raise ValueError(f"mixture enabled is True with entropy_decoding={self.entropy_decoding!r} and "
                             f"guidance_scale={self.guidance_scale}: the mixture decodes from both models' final "
                             "layers and runs no third forward; expected entropy_decoding=None and guidance_scale=1.0, "
                             "or the mixture off")
        if self.entropy_decoding is not None and self.guidance_scale != 1:
            raise ValueError(f"entropy_decoding is {self.entropy_decoding!r} with guidance_scale="
                             f"{self.guidance_scale}: entropy decoding cannot run with classifier-free guidance (its "
                             "processor runs its own forward with a cache and cannot score one row per layer); set "
                             "guidance_scale=1.0 or entropy_decoding=None")


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
    min_score: float = -1.0  # "nothing fits": a memory scored under it is never read (-1: every memory may be)
    fit_check: bool = False  # the chat's: a question about the user reads only memories its fit check admits

    def __post_init__(self):
        _validate(self, {
            "min_score": (float, False, lambda v: -1 <= v <= 1, "must be in [-1, 1] (a cosine similarity)"),
            "enabled": (bool, False, None, ""), "use_sampling": (bool, False, None, ""),
            "debug": (bool, False, None, ""), "fit_check": (bool, False, None, ""),
            "top_k": (int, False, _GE0, "must be >= 0 (0 keeps all memories)"),
            "top_p": (float, False, lambda v: 0 < v <= 1, "must be in (0, 1] (1 turns it off)"),
            "temperature": (float, False, _GE0, "must be >= 0 (and > 0 when sampling)"),
        })
        if self.use_sampling and self.temperature <= 0:
            raise ValueError(f"temperature is {self.temperature} with use_sampling=True: temperature must be > 0 "
                             "when sampling; for greedy recall set use_sampling=False")

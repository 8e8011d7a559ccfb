"""The q* mixture (seed 003) and its exact speculative sampling: α* solves the KL balance, the
acceptance rule reproduces q* (and the seed's scheme would not), speculative and direct sampling
agree in distribution and under greedy, caches roll back exactly, recall injects into both models."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TopKLogitsWarper

from conftest import make_tiny_llama
from decoding.request import Controls, Prompt
from decoding import GenerationSettings, Recall, RecallEvent, RecallSettings, generate
from decoding.mixture import (
    MixtureEvent, MixtureResult, OptimalSpeculativeDecoder, generate_mixture, mixture_log_probs, stream_mixture,
)
from decoding.draft_head import DraftHead, draft_head_for, head_config
from decoding.gamma import GammaSchedule, acceptance_gamma, adaptive_k
from decoding.settings import MixtureSettings
from decoding.drafts import HeadDraft, point_masses
from decoding.speculative import ModelPair, Sampling, accept_draft, speculative_round
from memory import MemoryVectorDB
from models.gguf import gguf_draft_for
from models.modeling import adapter_merged, backbone_and_head, is_peft, set_adapter_merged
from tests_helpers import ForceTokens

P_MIN = 1e-3  # chi-square p-value below which a distribution test fails


class AllowOnly(LogitsProcessor):
    """Masks every token but `ids` and puts the rest on one scale (standardised, times `scale`): tiny random
    models are nearly uniform, the real GGUF draft is sharp, and both then give spread distributions."""

    def __init__(self, ids, scale=2.0):
        self.ids, self.scale = torch.tensor(ids), scale

    def __call__(self, input_ids, scores):
        kept = scores[:, self.ids]
        out = torch.full_like(scores, -float("inf"))
        out[:, self.ids] = (kept - kept.mean(-1, keepdim=True)) / kept.std(-1, keepdim=True) * self.scale
        return out


class Sharpen(LogitsProcessor):
    def __init__(self, scale=25.0):
        self.scale = scale

    def __call__(self, input_ids, scores):
        return scores * self.scale


class BiasAt(LogitsProcessor):
    """+bias on `token` when the input has `length` tokens: forces it at one position only."""

    def __init__(self, length, token, bias=100.0):
        self.length, self.token, self.bias = length, token, bias

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.length:
            scores = scores.clone()
            scores[:, self.token] += self.bias
        return scores


def chi2_p(samples, probs):
    """Chi-square p-value of integer samples against `probs`, cells with expected < 5 merged."""
    probs = np.asarray(probs, dtype=float)
    observed = np.bincount(np.asarray(samples), minlength=len(probs)).astype(float)
    expected = probs / probs.sum() * len(samples)
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return chisquare(observed, expected).pvalue


# ------------------------------------------------------------------ fixtures and references


@pytest.fixture(scope="module")
def pair2(smollm2_dir):
    """Two different tiny Llamas with one tokenizer."""
    return make_tiny_llama(smollm2_dir, seed=0), make_tiny_llama(smollm2_dir, seed=1)


@pytest.fixture(scope="module")
def peft_lm(smollm2_dir):
    """A tiny Llama with a LoRA adapter (random B) and trainable recall tokens: θ = adapter, t = base."""
    from peft import LoraConfig, get_peft_model
    lm = make_tiny_llama(smollm2_dir, seed=7)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        trainable_token_indices=[lm.tokens.recall, lm.tokens.memory_pad])
    model = get_peft_model(lm.model, config).eval()
    torch.manual_seed(3)
    for name, p in model.named_parameters():
        if "lora_B" in name or "trainable_tokens_delta" in name:
            p.data.normal_(0, 0.5)
    lm.model = model
    return lm


@pytest.fixture(scope="module")
def gguf(smollm2_dir, pair2):
    """The real llama.cpp draft: the Q4_1 SmolLM2 GGUF, which shares the tiny models' tokenizer (its drafts
    are nothing like the tiny models' q*, so rounds keep and reject drafts)."""
    from models.gguf import load_gguf_draft
    return load_gguf_draft(None, pair2[0].tokenizer, n_ctx=512)


@pytest.fixture(scope="module")
def head(pair2):
    """An untrained EAGLE head of the tiny models' width: its drafts are poor, and exactness must not care."""
    torch.manual_seed(5)
    return DraftHead(head_config(pair2[0].model.config)).eval()


def models_of(case, pair2, peft_lm):
    return (pair2[0].model, pair2[1].model) if case == "two" else (peft_lm.model, None)


SMALL_VOCAB = 1024  # the distribution tests' models, but for the llama.cpp draft's: the same tiny Llamas with a
                    # vocabulary of 1024 (a 49k-token head and softmax are most of a tiny model's time)


def small_llama(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=SMALL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)).eval()


@pytest.fixture(scope="module")
def small_pair():
    return small_llama(0), small_llama(1)


@pytest.fixture(scope="module")
def small_peft():
    """As `peft_lm`, with the small vocabulary (two of its tokens trainable)."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        trainable_token_indices=[SMALL_VOCAB - 3, SMALL_VOCAB - 1])
    model = get_peft_model(small_llama(7), config).eval()
    torch.manual_seed(3)
    for name, p in model.named_parameters():
        if "lora_B" in name or "trainable_tokens_delta" in name:
            p.data.normal_(0, 0.5)
    return model


def distribution_models(case, mode, pair2, peft_lm, small_pair, small_peft):
    """(θ, t) of a distribution test: the llama.cpp draft needs the real SmolLM2 vocabulary, the other drafts
    run on the small one (exactness does not depend on the vocabulary's size)."""
    if mode == "gguf":
        return models_of(case, pair2, peft_lm)
    return small_pair if case == "two" else (small_peft, None)


def side(model_theta, model_t, which):
    """(module, context) of θ (0) or t (1): for a PEFT pair t is the same model with its adapter off."""
    if which == 0 or model_t is not None:
        return (model_theta, model_t)[which], contextlib.nullcontext()
    return model_theta, model_theta.disable_adapter()


def full_logits(model_theta, model_t, ids, embeds=(None, None)):
    """Last-position logits of both models by a plain uncached forward: [2, V]."""
    out = []
    for which in (0, 1):
        model, context = side(model_theta, model_t, which)
        kw = {"inputs_embeds": embeds[which]} if embeds[which] is not None else {"input_ids": torch.tensor([ids])}
        with context, torch.no_grad():
            out.append(model(**kw).logits[0, -1])
    return torch.stack(out)


def embed_of(model_theta, model_t, which, ids):
    """Input embeddings [1, S, H] of `ids` in θ (0) or t (1)."""
    model, context = side(model_theta, model_t, which)
    with context, torch.no_grad():
        return model.get_input_embeddings()(torch.tensor([ids])).clone()


def reference_q(model_theta, model_t, ids, processors=None, alpha="auto"):
    logits = full_logits(model_theta, model_t, ids)
    if processors:
        logits = processors(torch.tensor([ids]).expand(2, -1), logits)
    return mixture_log_probs(logits[0], logits[1], alpha)


def reference_greedy(model_theta, model_t, ids, steps, alpha="auto"):
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(reference_q(model_theta, model_t, ids, alpha=alpha)[0].argmax()))
    return ids


def conditioned_kls(scores_theta, scores_t, log_q):
    """KL(q‖π_θ|S), KL(q‖π_t|S) computed from scratch in float64."""
    s = torch.isfinite(scores_theta) & torch.isfinite(scores_t)
    lp = torch.log_softmax(scores_theta.double().masked_fill(~s, -float("inf")), -1)
    lr = torch.log_softmax(scores_t.double().masked_fill(~s, -float("inf")), -1)
    q, lq = log_q.double().exp(), log_q.double()
    kl = lambda other: torch.where(q > 0, q * (lq - other), torch.zeros_like(q)).sum(-1)  # noqa: E731
    return kl(lp), kl(lr)


# ------------------------------------------------------------------ α* and q*


@pytest.mark.parametrize("scale", [0.3, 1.0, 4.0, 12.0])
def test_alpha_balances_the_two_kls(scale):
    torch.manual_seed(int(scale * 10))
    theta, t = torch.randn(16, 3000) * scale, torch.randn(16, 3000) * scale + torch.randn(16, 1)
    log_q, alpha = mixture_log_probs(theta, t)
    kl_theta, kl_t = conditioned_kls(theta, t, _mix(theta, t, alpha))
    assert ((alpha >= 0) & (alpha <= 1)).all()
    assert (kl_theta - kl_t).abs().max() < 1e-5
    assert torch.allclose(log_q.exp().double(), _mix(theta, t, alpha).exp(), atol=1e-6)
    # and it is the root plain bisection finds
    lo, hi = torch.zeros(16, dtype=torch.float64), torch.ones(16, dtype=torch.float64)
    for _ in range(50):  # δ = KL(q‖π_θ) - KL(q‖π_t) decreases in α
        mid = (lo + hi) / 2
        kl_theta, kl_t = conditioned_kls(theta, t, _mix(theta, t, mid))
        lo, hi = torch.where(kl_theta > kl_t, mid, lo), torch.where(kl_theta > kl_t, hi, mid)
    assert (alpha - lo).abs().max() < 1e-5


def _mix(theta, t, alpha):
    """log q_α in float64 from scratch: α log π_θ|S + (1-α) log π_t|S, renormalised, on S only."""
    s = torch.isfinite(theta) & torch.isfinite(t)
    lp = torch.log_softmax(theta.double().masked_fill(~s, -float("inf")), -1)
    lr = torch.log_softmax(t.double().masked_fill(~s, -float("inf")), -1)
    a = alpha[:, None]
    return torch.log_softmax((a * lp.masked_fill(~s, 0) + (1 - a) * lr.masked_fill(~s, 0)).masked_fill(~s, -float("inf")), -1)


def test_equal_models_any_alpha_returns_half_and_the_model():
    scores = torch.randn(3, 500) * 3
    log_q, alpha = mixture_log_probs(scores, scores.clone())
    assert torch.allclose(alpha, torch.full((3,), 0.5, dtype=torch.float64))
    assert torch.allclose(log_q, torch.log_softmax(scores, -1), atol=1e-5)


def test_one_hot_and_peaked_distributions():
    t = torch.randn(2, 400)
    one_hot = torch.full((2, 400), -float("inf"))
    one_hot[:, 7] = 0.0
    log_q, alpha = mixture_log_probs(one_hot, t)
    assert torch.allclose(log_q.exp()[:, 7], torch.ones(2)) and alpha.tolist() == [0.5, 0.5]
    peaked = torch.zeros(2, 400)
    peaked[:, 3] = 100.0  # finite but ~one-hot: stable in log space
    log_q, alpha = mixture_log_probs(peaked, t)
    assert torch.isfinite(alpha).all() and not torch.isnan(log_q).any()
    kl_theta, kl_t = conditioned_kls(peaked, t, _mix(peaked, t, alpha))
    assert (kl_theta - kl_t).abs().max() < 1e-5


def test_masking_processors_zero_q_outside_the_common_support():
    torch.manual_seed(5)
    theta, t = torch.randn(4, 300) * 2, torch.randn(4, 300) * 2
    theta[:, :3] += 10  # both keep tokens 0..2 among their top 8
    t[:, :3] += 10
    top = TopKLogitsWarper(8)
    ids = torch.zeros(4, 1, dtype=torch.long)
    s_theta, s_t = top(ids, theta.clone()), top(ids, t.clone())
    log_q, alpha = mixture_log_probs(s_theta, s_t)
    common = torch.isfinite(s_theta) & torch.isfinite(s_t)
    assert (log_q.exp()[~common] == 0).all() and (log_q.exp()[common] > 0).all()
    assert torch.allclose(log_q.exp().double(), _mix(s_theta, s_t, alpha).exp(), atol=1e-6)
    kl_theta, kl_t = conditioned_kls(s_theta, s_t, _mix(s_theta, s_t, alpha))
    assert (kl_theta - kl_t).abs().max() < 1e-5


def test_disjoint_supports_fall_back_to_theta():
    theta, t = torch.full((1, 50), -float("inf")), torch.full((1, 50), -float("inf"))
    theta[0, :3], t[0, 10:13] = torch.tensor([1.0, 2.0, 3.0]), 0.0
    log_q, alpha = mixture_log_probs(theta, t)
    assert alpha.tolist() == [1.0]
    assert torch.allclose(log_q.exp(), torch.softmax(theta, -1))


def test_fixed_alpha_is_the_geometric_mixture():
    theta, t = torch.randn(3, 200), torch.randn(3, 200)
    assert torch.allclose(mixture_log_probs(theta, t, 1.0)[0], torch.log_softmax(theta, -1), atol=1e-5)
    assert torch.allclose(mixture_log_probs(theta, t, 0.0)[0], torch.log_softmax(t, -1), atol=1e-5)
    expected = _mix(theta, t, torch.full((3,), 0.3, dtype=torch.float64)).float()
    assert torch.allclose(mixture_log_probs(theta, t, 0.3)[0], expected, atol=1e-5)


@pytest.mark.parametrize("kwargs, words", [
    ({"alpha": 1.5}, ["1.5", '"auto"', "[0, 1]"]), ({"alpha": "max"}, ["'max'", '"auto"']),
    ({"gamma": 0}, ["gamma", "0", "from 1 to 64"]),
    ({"gamma": 2, "gamma_rule": "seed"}, ["gamma", "2", "from 3 to 10"]),
    ({"draft": "medusa"}, ["'medusa'", "ngram", "theta", "target"]),
    ({"target": ""}, ["target", "None"]), ({"speculative": "yes"}, ["speculative", "bool"]),
    ({"gamma_rule": "often"}, ["gamma_rule", "'often'", "fixed, seed, acceptance"]),
])
def test_settings_name_the_value_and_what_is_allowed(kwargs, words):
    with pytest.raises(ValueError) as err:
        MixtureSettings(**kwargs)
    assert all(w in str(err.value) for w in words)


# ------------------------------------------------------------------ the acceptance rule, no model

Q_CASES = {  # (target q over 5 tokens, draft d)
    "d=pi_theta": ([.30, .25, .20, .15, .10], [.60, .05, .05, .20, .10]),
    "far draft": ([.05, .10, .15, .30, .40], [.90, .04, .03, .02, .01]),
    "point mass": ([.20, .20, .20, .20, .20], [0., 0., 1., 0., 0.]),
}


@pytest.mark.parametrize("case", Q_CASES)
@pytest.mark.parametrize("gamma", [1, 3])
def test_one_speculative_step_is_distributed_as_q(case, gamma):
    q0, d0 = (torch.tensor(v) for v in Q_CASES[case])
    n_draws = 40000
    g = torch.Generator().manual_seed(11 + gamma)
    q1 = torch.tensor([.1, .4, .1, .3, .1])  # the next position's target
    q = torch.stack([q0] + [q1] * gamma)[None].expand(n_draws, -1, -1)  # [N, γ+1, V]
    d = torch.stack([d0] + [d0.roll(1)] * (gamma - 1))[None].expand(n_draws, -1, -1)  # [N, γ, V]
    x = torch.stack([torch.multinomial(d[0, i], n_draws, replacement=True, generator=g) for i in range(gamma)], 1)
    n, y = accept_draft(q, d, x, generator=g)
    first = torch.where(n >= 1, x[:, 0], y)
    assert chi2_p(first.numpy(), q0) > P_MIN
    if gamma > 1:  # the token after a kept first draft follows q_1
        kept = n >= 1
        second = torch.where(n >= 2, x[:, 1], y)[kept]
        assert chi2_p(second.numpy(), q1) > P_MIN


def seed_scheme(p_theta, q_star, k, generator):
    """Seed 003's rule (for contrast only): k candidates from π_θ, first kept with min(1, q*/π_θ)."""
    for c in torch.multinomial(p_theta, k, replacement=True, generator=generator):
        if float(torch.rand(1, generator=generator)) < min(1.0, float(q_star[c] / p_theta[c])):
            return int(c)
    return int(torch.multinomial(q_star, 1, generator=generator))


class _StubPair:
    """A pair whose forward is free: the target is given, caches are a counter."""

    def __init__(self):
        self.length, self.runs = 0, 0

    def run(self, tokens, inject={}, logits=True):
        self.runs += 1
        self.length += len(tokens)
        return torch.zeros(2, len(tokens), 2), None

    def crop(self, length):
        self.length = min(self.length, length)


class _PiThetaDraft:
    def __init__(self, p):
        self.p = p

    def propose(self, seq, gamma, **_):
        return torch.multinomial(self.p, gamma, replacement=True).tolist(), self.p[None].expand(gamma, -1)


def test_seed_scheme_is_not_used_pi_theta_draft_gives_q_star():
    """π_θ = (.9, .1), q* = (.5, .5): our round samples (.5, .5); the seed's rule gives (.7, .3)."""
    p, q = torch.tensor([.9, .1]), torch.tensor([.5, .5])
    torch.manual_seed(0)
    target = lambda seq, drafts, logits: (q.log()[None].expand(len(drafts) + 1, -1), torch.zeros(len(drafts) + 1))  # noqa: E731
    pair = _StubPair()
    ours = [speculative_round([0], pair, _PiThetaDraft(p), 1, target, Sampling(True)).tokens[0] for _ in range(6000)]
    assert pair.runs == 6000  # one verify forward per round
    assert chi2_p(ours, q) > P_MIN
    g = torch.Generator().manual_seed(0)
    seeds = [seed_scheme(p, q, 1, g) for _ in range(6000)]
    assert chi2_p(seeds, q) < 1e-9  # the contrast: the test has the power to catch the seed's scheme
    assert abs(np.mean(np.asarray(seeds) == 0) - 0.70) < 0.03


# ------------------------------------------------------------------ end to end on models

ALLOWED_WORDS = 4


def allowed_setup(model_theta, model_t):
    """Four allowed tokens A B C D (sharpened), and a prompt [A, k, B, C, A] whose n-gram lookup proposes
    k, chosen as q*'s likeliest first token so that drafts are both kept and rejected."""
    ids = list(range(1000, 1000 + ALLOWED_WORDS))
    processors = LogitsProcessorList([AllowOnly(ids)])
    a, b, c = ids[:3]
    best = max(ids[1:], key=lambda k: float(reference_q(model_theta, model_t, [a, k, b, c, a], processors)[0][k]))
    return ids, [a, best, b, c, a], processors


def sequence_distribution(model_theta, model_t, prompt, allowed, processors, length):
    """Exact P(x1 .. x_length) over allowed^length (the first token varies slowest: `cell`), from uncached
    forwards."""
    if length == 0:
        return np.ones(1)
    q = reference_q(model_theta, model_t, prompt, processors)[0].exp()
    return np.concatenate([float(q[a]) * sequence_distribution(model_theta, model_t, prompt + [a], allowed,
                                                               processors, length - 1) for a in allowed])


def cell(tokens, allowed):
    """The index of a drawn sequence in `sequence_distribution`'s order."""
    index = 0
    for token in tokens:
        index = index * len(allowed) + allowed.index(token)
    return index


# The distribution tests draw thousands of answers, the suite's longest tests: each is a class of its own, which
# pytest-xdist (--dist loadscope) gives a process of its own.

class TestTwoModels:
    def test_speculative_and_direct_sample_the_same_two_tokens(self, pair2, peft_lm, small_pair, small_peft, head,
                                                               gguf):
        """Against the exact P(x1, x2) of q*: direct; the n-gram draft; θ drafting on its own cache in the pair
        with its logits reused; an EAGLE head; llama.cpp on a GGUF."""
        sample_the_same_two_tokens("two", ["direct", "ngram", "theta", "head", "gguf"], pair2, peft_lm, small_pair,
                                   small_peft, head, gguf)


class TestAPeftPair:
    def test_speculative_and_direct_sample_the_same_two_tokens(self, pair2, peft_lm, small_pair, small_peft, head,
                                                               gguf):
        """θ (the adapter) and t (its base) in one batched forward: the n-gram draft, θ drafting on a separate
        cache, an EAGLE head, llama.cpp on a GGUF."""
        sample_the_same_two_tokens("peft", ["ngram", "theta", "head", "gguf"], pair2, peft_lm, small_pair, small_peft,
                                   head, gguf)


def sample_the_same_two_tokens(case, modes, pair2, peft_lm, small_pair, small_peft, head, gguf):
    """Each mode's 500 draws of (x1, x2) against q*'s exact P(x1, x2) (chi-square)."""
    for mode in modes:
        model_theta, model_t = distribution_models(case, mode, pair2, peft_lm, small_pair, small_peft)
        allowed, prompt, processors = allowed_setup(model_theta, model_t)
        exact = sequence_distribution(model_theta, model_t, prompt, allowed, processors, 2)
        mixture = MixtureSettings(enabled=True, speculative=mode != "direct", draft=mode if mode != "direct" else "ngram",
                                  gamma=3)
        draws, accepted = [], 0
        for seed in range(500):
            settings = GenerationSettings(do_sample=True, top_k=0, max_new_tokens=2, seed=seed)
            r = generate_mixture(
                model_theta,
                model_t,
                {"input_ids": torch.tensor([prompt])},
                dataclasses.replace(settings, mixture=mixture),
                controls=Controls(
                    logits_processor=processors, draft_head=head if mode == "head" else None, draft_gguf=gguf
                ),
            )
            draws.append(cell(r.new_tokens[0].tolist(), allowed))
            accepted += r.accepted
        assert chi2_p(draws, exact) > P_MIN, mode
        if mode != "direct":
            assert 0 < accepted < len(draws)  # drafts were kept in some runs and rejected in others


class TestTheGGUFDraft:
    def test_keeps_q_star_over_three_tokens(self, pair2, gguf):
        """γ = 2: the second draft's distribution comes after llama.cpp evaluated the first draft alone, and
        the round keeps both drafts, one, or none; P(x1, x2, x3) is still q*'s (chi-square)."""
        model_theta, model_t = pair2[0].model, pair2[1].model
        allowed, prompt, processors = allowed_setup(model_theta, model_t)
        exact = sequence_distribution(model_theta, model_t, prompt, allowed, processors, 3)
        draws, kept = [], []
        for seed in range(600):
            settings = GenerationSettings(do_sample=True, top_k=0, max_new_tokens=3, seed=seed)
            r = generate_mixture(
                model_theta,
                model_t,
                {"input_ids": torch.tensor([prompt])},
                dataclasses.replace(
                    settings, mixture=MixtureSettings(enabled=True, speculative=True, draft="gguf", gamma=2)
                ),
                controls=Controls(logits_processor=processors, draft_gguf=gguf),
            )
            draws.append(cell(r.new_tokens[0].tolist(), allowed))
            kept.append(r.accepted)
        assert chi2_p(draws, exact) > P_MIN
        assert {0, 1, 2} <= set(kept)  # answers kept no draft, one, and two


# ------------------------------------------------------------------ adaptive γ (mixture.gamma_rule, decoding/gamma.py)


@pytest.mark.parametrize("alpha, base, gamma", [
    (0.5, 5, 3), (0.36, 5, 3), (0.64, 5, 3),  # r̂ = 2·min(α*, 1 - α*) > 0.7: max(3, γ - 2)
    (0.35, 5, 5), (0.15, 5, 5), (0.85, 5, 5),  # r̂ in [0.3, 0.7] (0.7 and 0.3 themselves): γ
    (0.14, 5, 8), (0.86, 5, 8), (0.0, 5, 8), (1.0, 5, 8),  # r̂ < 0.3: min(10, γ + 3)
    (0.5, 1, 3), (0.5, 4, 3), (0.5, 12, 10), (0.0, 8, 10), (0.0, 12, 10), (0.25, 12, 12),  # the bounds 3 and 10
])
def test_the_seed_rule_at_its_boundaries(alpha, base, gamma):
    assert adaptive_k(alpha, base) == gamma


def test_the_seed_rule_keeps_its_default_base_and_the_seed_class_takes_the_mean_alpha():
    assert (adaptive_k(0.5), adaptive_k(0.3), adaptive_k(0.1)) == (3, 5, 8)  # base_k = 5, as in the seed
    decoder = OptimalSpeculativeDecoder(None, None, k=5, gamma_rule="seed")
    assert decoder.mixture.gamma_rule == "seed" and decoder.mixture.gamma == 5
    assert decoder._adaptive_k(torch.tensor([0.2, 0.8])) == 3 and decoder._adaptive_k(0.05) == 8


@pytest.mark.parametrize("rate, base, gamma", [
    (1.0, 4, 7), (0.71, 4, 7), (0.7, 4, 4), (0.3, 4, 4), (0.29, 4, 3), (0.0, 4, 3),
    (1.0, 9, 10), (0.0, 1, 3), (0.0, 6, 4),
])
def test_the_acceptance_rule_at_its_boundaries(rate, base, gamma):
    assert acceptance_gamma(rate, base) == gamma


def test_a_schedule_reads_the_last_verified_alpha_and_the_last_four_rounds_that_drafted():
    seed = GammaSchedule("seed", 5)
    assert seed.gamma == 5  # the first round: the configured γ
    seed.update([0.05, 0.5], 2, 1)
    assert seed.gamma == 3  # from the last position's α* (0.5), not the first's (0.05)
    seed.update([0.5, 0.05], 2, 1)
    assert seed.gamma == 8
    measured, gammas = GammaSchedule("acceptance", 4), []
    for drafted, kept in [(4, 4), (4, 0), (4, 0), (0, 0), (4, 0), (4, 4), (4, 4)]:
        measured.update([0.5], drafted, kept)
        gammas.append(measured.gamma)
    # kept shares 4/4, 4/8, 4/12, (no draft: unchanged), 4/16, then the window drops the first: 4/16, 8/16
    assert gammas == [7, 4, 4, 4, 3, 3, 4]
    fixed = GammaSchedule("fixed", 4)
    fixed.update([0.5], 4, 0)
    assert fixed.gamma == 4


def test_the_gamma_rule_is_set_by_the_config_and_set_and_refused_by_name():
    from chat.config import ConfigError, load_config
    assert load_config(environ={}).generation.mixture.gamma_rule == "fixed"  # the app's configuration
    assert load_config(overrides=["generation.mixture.gamma_rule=seed"], environ={}).generation.mixture.gamma_rule == "seed"
    assert load_config(environ={"RECALL_CHAT__GENERATION__MIXTURE__GAMMA_RULE": "acceptance"}
                       ).generation.mixture.gamma_rule == "acceptance"
    with pytest.raises(ConfigError, match="gamma_rule is 'often': must be one of fixed, seed, acceptance"):
        load_config(overrides=["generation.mixture.gamma_rule=often"], environ={})


def expected_gamma(rule: str, base: int, before: list) -> int:
    """What the rule gives after the MixtureEvents `before` (written apart from GammaSchedule)."""
    drafted = [e for e in before if e.drafted][-4:]
    if rule == "seed" and before:
        return adaptive_k(before[-1].alphas[-1], base)
    if rule == "acceptance" and drafted:
        return acceptance_gamma(sum(e.accepted for e in drafted) / sum(e.drafted for e in drafted), base)
    return base


@pytest.mark.parametrize("rule", ["seed", "acceptance"])
def test_each_round_drafts_the_rules_gamma_within_the_length_limit(pair2, monkeypatch, rule):
    """γ of every round is the rule's, from the rounds before it (the seed's: α* of the last verified position),
    cut to the room left (a round never drafts past max_new_tokens); greedy answers stay the reference's."""
    model_theta, model_t = pair2[0].model, pair2[1].model
    prompt, new, base = [504, 1813, 314, 253], 24, 5
    given = []
    monkeypatch.setattr("decoding.mixture.speculative_round",
                        lambda seq, pair, draft, gamma, *a, **kw: given.append(gamma) or speculative_round(
                            seq, pair, draft, gamma, *a, **kw))
    mixture = MixtureSettings(enabled=True, speculative=True, draft="theta", gamma=base, gamma_rule=rule)
    capped = adapted = False
    for seed in range(3):
        given.clear()
        settings = GenerationSettings(do_sample=True, top_k=0, max_new_tokens=new, seed=seed, mixture=mixture)
        events = list(stream_mixture(model_theta, model_t, {"input_ids": torch.tensor([prompt])}, settings,
                                     controls=Controls(eos_token_id=[])))
        rounds = [e for e in events if isinstance(e, MixtureEvent)]
        assert len(given) == len(rounds) and events[-1].result.new_tokens.shape[1] == new
        for i, (gamma, event) in enumerate(zip(given, rounds)):
            wanted, room = expected_gamma(rule, base, rounds[:i]), len(prompt) + new - event.position - 1
            assert gamma == min(wanted, room), (seed, i)
            capped, adapted = capped or room < wanted, adapted or wanted != base
    assert capped and adapted  # the limit cut some round, and the rule moved γ off the configured one
    greedy = generate_mixture(model_theta, model_t, {"input_ids": torch.tensor([prompt])},
                              GenerationSettings(max_new_tokens=10, mixture=mixture), controls=Controls(eos_token_id=[]))
    assert greedy.sequences[0].tolist() == reference_greedy(model_theta, model_t, prompt, 10)


class TestAdaptiveGamma:
    @pytest.mark.parametrize("rule", ["seed", "acceptance"])
    def test_keeps_q_star_over_four_tokens(self, small_pair, rule):
        """With an adaptive rule (γ = 3, the least one takes: in 4 tokens the limit caps every later round to it; that
        the rule moves γ between rounds is `test_each_round_drafts_the_rules_gamma_within_the_length_limit`'s), θ
        drafting in the pair: P(x1 .. x4) over three allowed tokens is still q*'s (chi-square, p 0.93 here under 1
        and 2 threads)."""
        model_theta, model_t = small_pair
        allowed = [1000, 1001, 1002]
        processors = LogitsProcessorList([AllowOnly(allowed, scale=1.0)])
        prompt = [1000, 1001, 1002, 1000]
        exact = sequence_distribution(model_theta, model_t, prompt, allowed, processors, 4)
        mixture = MixtureSettings(enabled=True, speculative=True, draft="theta", gamma=3, gamma_rule=rule)
        draws, drafted, accepted, longer = [], 0, 0, 0
        for seed in range(400):
            settings = GenerationSettings(do_sample=True, top_k=0, max_new_tokens=4, seed=seed, mixture=mixture)
            r = generate_mixture(model_theta, model_t, {"input_ids": torch.tensor([prompt])}, settings,
                                 controls=Controls(logits_processor=processors, eos_token_id=[]))
            draws.append(cell(r.new_tokens[0].tolist(), allowed))
            drafted, accepted, longer = drafted + r.drafted, accepted + r.accepted, longer + (r.drafted > r.rounds)
        assert chi2_p(draws, exact) > P_MIN
        assert 0 < accepted < drafted and longer > 40  # drafts kept and rejected; many answers drafted several


@pytest.mark.parametrize("case", ["two", "peft", "peft-two-forwards"])
@pytest.mark.parametrize("draft", ["ngram", "theta", "target", "head", "gguf"])
def test_greedy_speculative_equals_direct_equals_reference(pair2, peft_lm, head, gguf, case, draft):
    model_theta, model_t = models_of(case.split("-")[0], pair2, peft_lm)
    prompt = peft_lm.tokenizer("the sea the sea the sea the").input_ids
    settings = GenerationSettings(max_new_tokens=10)
    batched = case != "peft-two-forwards"
    runs = [
        generate_mixture(
            model_theta,
            model_t,
            {"input_ids": torch.tensor([prompt])},
            dataclasses.replace(
                settings, mixture=MixtureSettings(enabled=True, speculative=spec, draft=draft, gamma=3)
            ),
            controls=Controls(eos_token_id=[], batched_pair=batched, draft_head=head, draft_gguf=gguf),
        )
        for spec in (False, True)
    ]
    expected = reference_greedy(model_theta, model_t, prompt, 10)
    assert runs[0].sequences[0].tolist() == expected == runs[1].sequences[0].tolist()
    assert runs[1].drafted > 0 and len(runs[1].alphas) == 10
    assert np.allclose(runs[0].alphas, runs[1].alphas, atol=1e-5)


@pytest.mark.parametrize("case", ["two", "peft"])  # θ drafting in the pair, or on its own cache (batched PEFT pair)
def test_a_seeded_mixture_draws_from_its_own_random_state(pair2, peft_lm, case):
    """A seed gives the answer its own generator: the global random state is not touched, and another
    answer's draws in between change nothing."""
    model_theta, model_t = models_of(case, pair2, peft_lm)
    prompt = torch.tensor([[504, 1813, 314, 253]])
    settings = GenerationSettings(do_sample=True, top_k=0, max_new_tokens=8, seed=11)
    mixture = MixtureSettings(enabled=True, speculative=True, draft="theta", gamma=3)
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    first = generate_mixture(
        model_theta,
        model_t,
        {"input_ids": prompt},
        dataclasses.replace(settings, mixture=mixture),
        controls=Controls(eos_token_id=[]),
    )
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.rand(100)
    again = generate_mixture(
        model_theta,
        model_t,
        {"input_ids": prompt},
        dataclasses.replace(settings, mixture=mixture),
        controls=Controls(eos_token_id=[]),
    )
    assert first.sequences.tolist() == again.sequences.tolist() and first.drafted > 0


def test_the_base_copy_is_the_adapter_switched_off_and_theta_stays_as_it_was(peft_lm, pair2):
    """The app's π_t for a PEFT model: a copy of its base, so the pair runs as two plain forwards and θ
    keeps its adapter merged."""
    lm, was_merged = peft_lm, adapter_merged(peft_lm.model)
    ids = torch.tensor([lm.tokenizer("the sea at night").input_ids + [lm.tokens.recall, lm.tokens.memory_pad]])
    try:
        with torch.no_grad():
            set_adapter_merged(lm.model, False)
            with lm.model.disable_adapter():
                off = lm.model(ids).logits
            set_adapter_merged(lm.model, True)
            theta = lm.model(ids).logits
            base = lm.mixture_target(None)
            assert base is lm.mixture_target(None) and not is_peft(base)  # made once, a plain model
            torch.testing.assert_close(base(ids).logits, off, atol=1e-5, rtol=0)
            assert adapter_merged(lm.model)
            torch.testing.assert_close(lm.model(ids).logits, theta, atol=0, rtol=0)
            assert (theta - off).abs().max() > 0.1  # the adapter matters here, so the test can tell them apart
    finally:
        set_adapter_merged(lm.model, was_merged)
    with pytest.raises(ValueError, match="has no adapter"):
        pair2[0].mixture_target(None)


def test_the_base_copy_drops_modules_to_save_and_shares_what_no_adapter_touches(smollm2_dir):
    """An adapter that saves a whole trained `lm_head` (common when tokens are added): PEFT's `unload()`
    would keep the trained copy, so π_t would be half θ. The MLPs, which no adapter wraps, are shared."""
    from peft import LoraConfig, get_peft_model

    lm = make_tiny_llama(smollm2_dir, seed=9)
    model = get_peft_model(lm.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
    torch.manual_seed(4)
    for name, p in model.named_parameters():
        if "lora_B" in name or "modules_to_save" in name:
            p.data.normal_(0, 0.5)
    lm.model = model.eval()
    ids = torch.tensor([lm.tokenizer("the sea at night").input_ids])
    with torch.no_grad():
        with lm.model.disable_adapter():
            off = lm.model(ids).logits
        theta = lm.model(ids).logits
        base = lm.mixture_target(None)
        torch.testing.assert_close(base(ids).logits, off, atol=1e-5, rtol=0)
        torch.testing.assert_close(lm.model(ids).logits, theta, atol=0, rtol=0)
    mlp = lm.model.get_base_model().model.layers[0].mlp.down_proj.weight
    assert base.model.layers[0].mlp.down_proj.weight is mlp  # shared, not copied
    assert base.model.layers[0].self_attn.q_proj.weight is not lm.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight


def test_the_base_copy_shares_a_fused_groups_joined_weights(smollm2_dir):
    """A model whose gate/up the graph step joined in place (`model.graph_fuse`, `decoding.fused`; the adapter wraps
    q/k/v, so those stay): its base copy shares the joined tensor, as it shares the modules' weights (a copy of it
    was 40 % of the weights more on the GPU), and gives the base's logits."""
    from peft import LoraConfig, get_peft_model

    from decoding.fused import fuse_projections
    from models.loading import base_copy

    lm = make_tiny_llama(smollm2_dir, seed=9)
    model = get_peft_model(lm.model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])).eval()
    assert fuse_projections(model) == len(model.get_base_model().model.layers)  # (gate/up only: q/k/v are LoRA's)
    base = base_copy(model)
    mlp, copied = model.get_base_model().model.layers[0].mlp, base.model.layers[0].mlp
    assert copied.gate_proj._whole[0] is mlp.gate_proj._whole[0] and copied.up_proj.weight is mlp.up_proj.weight
    ids = torch.tensor([lm.tokenizer("the sea at night").input_ids])
    with torch.no_grad(), model.disable_adapter():
        torch.testing.assert_close(base(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


class _FixedDraft:
    def __init__(self, tokens, vocab):
        self.tokens, self.vocab = tokens, vocab

    def propose(self, seq, gamma, **_):
        return self.tokens, point_masses(self.tokens, self.vocab)


@pytest.mark.parametrize("case", ["two", "peft", "peft-two-forwards"])
@pytest.mark.parametrize("keep", [0, 1, 2])
def test_caches_after_a_rejection_equal_a_fresh_prefill(pair2, peft_lm, case, keep):
    model_theta, model_t = models_of(case.split("-")[0], pair2, peft_lm)
    batched = case != "peft-two-forwards"
    prompt = peft_lm.tokenizer("a quiet harbour at dawn").input_ids
    good = reference_greedy(model_theta, model_t, prompt, keep)[len(prompt):]
    wrong = [t for t in (11, 12, 13, 14) if t != reference_greedy(model_theta, model_t, prompt + good, 1)[-1]][:3 - keep]
    pair = ModelPair(model_theta, model_t, batched=batched)
    pair.run(prompt[:-1], logits=False)
    target = lambda seq, drafts, logits: mixture_log_probs(logits[0], logits[1])  # noqa: E731
    rnd = speculative_round(list(prompt), pair, _FixedDraft(good + wrong, pair.vocab), 3, target, Sampling(False))
    assert rnd.accepted == keep and rnd.tokens[:keep] == good
    seq = prompt + rnd.tokens
    assert pair.length == len(seq) - 1
    fresh = ModelPair(model_theta, model_t, batched=batched)
    fresh.run(seq[:-1], logits=False)
    after, expected = pair.run(seq[-1:])[0], fresh.run(seq[-1:])[0]
    assert torch.allclose(after, expected, atol=1e-4)
    assert torch.allclose(after[:, -1], full_logits(model_theta, model_t, seq), atol=1e-4)


def test_peft_pair_is_one_batched_forward_per_round(peft_lm):
    """The shipped default: adapter on and off in one forward (PEFT mixed adapter batch)."""
    calls = []
    backbone = peft_lm.model.get_base_model().model
    handle = backbone.register_forward_hook(lambda m, a, kw_out: calls.append(1))
    try:
        prompt = peft_lm.tokenizer("one two one two one").input_ids
        r = generate_mixture(
            peft_lm.model,
            None,
            {"input_ids": torch.tensor([prompt])},
            dataclasses.replace(
                GenerationSettings(max_new_tokens=6),
                mixture=MixtureSettings(enabled=True, speculative=True, draft="ngram", gamma=2),
            ),
            controls=Controls(eos_token_id=[]),
        )
    finally:
        handle.remove()
    assert r.drafted > 0 and len(calls) == 1 + r.rounds  # the prefill, then one forward per verify round


# ------------------------------------------------------------------ recall inside the mixture


def _bank(dim, n=6):
    torch.manual_seed(2)
    db = MemoryVectorDB(dim)
    db.add(torch.randn(n, dim), texts=[f"fact {i}" for i in range(n)])
    return db


@pytest.mark.parametrize("case", ["two", "peft"])
@pytest.mark.parametrize("speculative", [False, True, "head", "gguf"])  # True: the θ draft
def test_recall_injects_the_memory_into_both_models(pair2, peft_lm, head, gguf, case, speculative):
    model_theta, model_t = models_of(case, pair2, peft_lm)
    lm = peft_lm
    db = _bank(64)
    recall = Recall(lm.tokens.recall, lm.tokens.memory_pad, db, RecallSettings())
    prompt = lm.tokenizer("tell me what you remember").input_ids
    L = len(prompt)
    processors = LogitsProcessorList([Sharpen(), BiasAt(L, lm.tokens.recall, 1e4)])
    events = list(
        stream_mixture(
            model_theta,
            model_t,
            {"input_ids": torch.tensor([prompt])},
            dataclasses.replace(
                GenerationSettings(max_new_tokens=3),
                mixture=MixtureSettings(
                    enabled=True,
                    speculative=bool(speculative),
                    draft=speculative if isinstance(speculative, str) else "theta",
                ),
            ),
            recall=recall,
            tokenizer=lm.tokenizer,
            controls=Controls(eos_token_id=[], logits_processor=processors, draft_head=head, draft_gguf=gguf),
        )
    )
    result = events[-1].result
    assert isinstance(result, MixtureResult) and any(isinstance(e, MixtureEvent) for e in events)
    recalls = [e for e in events if isinstance(e, RecallEvent)]
    assert len(recalls) == 1 and recalls[0].position == L + 1
    seq = result.sequences[0].tolist()
    assert seq[L:L + 2] == [lm.tokens.recall, lm.tokens.memory_pad] and np.isnan(result.alphas[1])
    # θ's hidden state at <recall> chose the memory
    with torch.no_grad():
        hidden = model_theta(torch.tensor([seq[:L + 1]]), output_hidden_states=True).hidden_states[-1][0, -1]
    assert recalls[0].memory_index == int(db.topk(hidden, 1)[1][0])
    vector = db.vector(recalls[0].memory_index)
    # the third token's α* is the one of both models seeing the memory, and not of one alone
    alphas = {}
    for who in ("both", "theta", "t", "none"):
        embeds = [embed_of(model_theta, model_t, which, seq[:L + 2]) for which in (0, 1)]
        for which, name in enumerate(("theta", "t")):
            if who in ("both", name):
                embeds[which][0, L + 1] = vector
        logits = processors(torch.tensor([seq[:L + 2]]).expand(2, -1), full_logits(model_theta, model_t, None, embeds))
        alphas[who] = float(mixture_log_probs(logits[0], logits[1])[1])
    assert abs(result.alphas[2] - alphas["both"]) < 1e-4, alphas
    assert all(abs(alphas["both"] - alphas[w]) > 1e-3 for w in ("theta", "t", "none")), alphas


@pytest.mark.parametrize("case", ["two", "peft"])
@pytest.mark.parametrize("speculative", [False, True, "gguf"])
def test_a_k_slot_memory_reaches_both_models_whole(pair2, peft_lm, gguf, case, speculative):
    """A memory of three value slots and `</recall>`: the span follows <recall> whole, and the next token's α*
    is that of both models reading all three vectors at their slots (a full forward over the sequence)."""
    model_theta, model_t = models_of(case, pair2, peft_lm)
    lm = peft_lm
    torch.manual_seed(3)
    db = MemoryVectorDB(8, value_dim=64)
    db.add(torch.randn(2, 8), ["a", "b"], values=[torch.randn(3, 64), torch.randn(3, 64)])
    proj = torch.randn(64, 8)
    recall = Recall(lm.tokens.recall, lm.tokens.memory_pad, db, RecallSettings(),
                    query=lambda h: h.float().cpu() @ proj, suffix=(lm.tokens.recall_end,))
    prompt = lm.tokenizer("tell me what you remember").input_ids
    L = len(prompt)
    processors = LogitsProcessorList([Sharpen(), BiasAt(L, lm.tokens.recall, 1e4)])
    result = generate_mixture(
        model_theta,
        model_t,
        {"input_ids": torch.tensor([prompt])},
        dataclasses.replace(
            GenerationSettings(max_new_tokens=7),
            mixture=MixtureSettings(
                enabled=True,
                speculative=bool(speculative),
                draft=speculative if isinstance(speculative, str) else "theta",
            ),
        ),
        recall=recall,
        tokenizer=lm.tokenizer,
        controls=Controls(eos_token_id=[], logits_processor=processors, draft_gguf=gguf),
    )
    seq = result.sequences[0].tolist()
    pad, end = lm.tokens.memory_pad, lm.tokens.recall_end
    assert seq[L:L + 5] == [lm.tokens.recall, pad, pad, pad, end] and len(seq) == L + 7
    (r,) = result.injections
    assert (r.position, r.length) == (L + 1, 3) and all(np.isnan(a) for a in result.alphas[1:5])
    values = db.values(r.memory_index)
    embeds = [embed_of(model_theta, model_t, which, seq[:L + 5]) for which in (0, 1)]
    for which in (0, 1):
        embeds[which][0, L + 1:L + 4] = values
    logits = processors(torch.tensor([seq[:L + 5]]).expand(2, -1), full_logits(model_theta, model_t, None, embeds))
    assert abs(result.alphas[5] - float(mixture_log_probs(logits[0], logits[1])[1])) < 1e-4


def test_a_drafted_recall_cuts_the_round(pair2, peft_lm):
    """α = 1 makes θ's draft always right, so <recall> arrives inside a kept block of drafts."""
    model_theta, model_t = pair2[0].model, pair2[1].model
    lm = peft_lm
    recall = Recall(lm.tokens.recall, lm.tokens.memory_pad, _bank(64), RecallSettings())
    prompt = lm.tokenizer("remember this").input_ids
    processors = LogitsProcessorList([BiasAt(len(prompt) + 1, lm.tokens.recall)])
    runs = [
        generate_mixture(
            model_theta,
            model_t,
            {"input_ids": torch.tensor([prompt])},
            dataclasses.replace(
                GenerationSettings(max_new_tokens=6),
                mixture=MixtureSettings(enabled=True, alpha=1.0, speculative=spec, draft="theta", gamma=4),
            ),
            recall=recall,
            controls=Controls(eos_token_id=[], logits_processor=processors),
        )
        for spec in (False, True)
    ]
    assert runs[0].sequences.tolist() == runs[1].sequences.tolist()
    assert runs[1].sequences[0, len(prompt) + 1] == lm.tokens.recall and runs[1].accepted >= 2
    assert [e.memory_index for e in runs[0].injections] == [e.memory_index for e in runs[1].injections]


def theta_only(speculative: bool, max_new_tokens: int, **kw) -> GenerationSettings:
    """α = 1 (q* = π_θ: θ's drafts are always kept), greedy, `gamma` 4."""
    mixture = MixtureSettings(enabled=True, speculative=speculative, alpha=1.0, gamma=4)
    return dataclasses.replace(GenerationSettings(max_new_tokens=max_new_tokens, **kw), mixture=mixture)


@pytest.mark.parametrize("speculative", [False, True])
def test_a_tool_call_inside_a_kept_block_stops_there(pair2, speculative):
    """`</tool_call>` (five tokens) closes from the second new token on, across two rounds of kept drafts: the
    answer ends right after it (`_Run.emit` cuts the round), finished by "tool_call"."""
    (lm, _), model_t = pair2, pair2[1].model
    end = lm.tokenizer("</tool_call>", add_special_tokens=False)["input_ids"]
    prompt = lm.tokenizer('<tool_call>{"name": "weather"}').input_ids
    force = ForceTokens(len(prompt) + 1, end)
    r = generate_mixture(lm.model, model_t, {"input_ids": torch.tensor([prompt])},
                         theta_only(speculative, 12, early_stop_on_tool_call=True), tokenizer=lm.tokenizer,
                         controls=Controls(eos_token_id=[], logits_processor=LogitsProcessorList([force])))
    assert r.finish_reasons == ["tool_call"] and r.new_tokens[0].tolist()[1:] == end
    assert len(r.alphas) == 1 + len(end) and (not speculative or r.accepted >= len(end))


@pytest.mark.parametrize("speculative", [False, True])
def test_a_recall_drawn_at_the_length_limit_is_left_unanswered(pair2, speculative):
    """As in the plain loop: the answer ends with the <recall>, "length", and no memory is read."""
    (lm, _), model_t = pair2, pair2[1].model
    recall = Recall(lm.tokens.recall, lm.tokens.memory_pad, _bank(64), RecallSettings())
    prompt = lm.tokenizer("remember this").input_ids
    force = LogitsProcessorList([ForceTokens(len(prompt) + 3, [lm.tokens.recall])])  # the fourth and last new token
    r = generate_mixture(lm.model, model_t, {"input_ids": torch.tensor([prompt])}, theta_only(speculative, 4),
                         recall=recall, controls=Controls(eos_token_id=[], logits_processor=force))
    assert r.finish_reasons == ["length"] and r.new_tokens.shape[1] == 4 and r.sequences[0, -1] == lm.tokens.recall
    assert r.injections == [] and r.memory_vectors == [{}] and not np.isnan(r.alphas).any()


@pytest.mark.parametrize("speculative", [False, True])
def test_a_prompt_ending_with_recall_recalls_first_as_the_plain_loop(pair2, speculative):
    """The prompt's <recall> is answered before the first round: with α = 1 the mixture is θ alone, so its answer is
    the plain loop's on θ (the same memory at the same position, the same tokens)."""
    (lm, _), model_t = pair2, pair2[1].model
    recall = Recall(lm.tokens.recall, lm.tokens.memory_pad, _bank(64), RecallSettings())
    inputs = {"input_ids": torch.tensor([lm.tokenizer("remember this").input_ids + [lm.tokens.recall]])}
    r = generate_mixture(lm.model, model_t, inputs, theta_only(speculative, 5), recall=recall,
                         controls=Controls(eos_token_id=[]))
    plain = generate(lm.model, inputs, GenerationSettings(max_new_tokens=5), recall=recall,
                     controls=Controls(eos_token_id=[]))
    assert r.sequences.tolist() == plain.sequences.tolist() and r.new_tokens[0, 0] == lm.tokens.memory_pad
    assert [(e.position, e.memory_index) for e in r.injections] == [(e.position, e.memory_index)
                                                                    for e in plain.injections]
    assert np.isnan(r.alphas[0])


@pytest.mark.slow
def test_the_real_pair_drafted_by_its_own_gguf_answers_as_direct(smollm2):
    """The embedded SmolLM2 with its recall adapter (θ) against its base copy (t), drafted by llama.cpp on the
    Q4_1 GGUF both come from: greedy equals direct, and the draft is close enough to q* to pay (with the adapter
    trained on people's memories: 10 of 20 drafts kept, 16 tokens in 6 verifies; the adapter before it kept more)."""
    tok = smollm2.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three colours of the sea."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    runs = [
        generate_mixture(
            smollm2.merged(),
            smollm2.mixture_target(None),
            {"input_ids": ids},
            dataclasses.replace(
                GenerationSettings(max_new_tokens=16, repetition_penalty=1.0),
                mixture=MixtureSettings(enabled=True, speculative=spec, draft="gguf", gamma=4),
            ),
            controls=Controls(eos_token_id=[], draft_gguf=gguf_draft_for(smollm2, None)),
        )
        for spec in (False, True)
    ]
    assert runs[0].sequences.tolist() == runs[1].sequences.tolist()
    assert runs[1].accepted / runs[1].drafted >= 0.4 and runs[1].rounds <= 8  # at least 2 tokens a verify


@pytest.mark.slow
def test_a_seeded_answer_drafted_by_the_gguf_repeats(smollm2):
    """llama.cpp's numbers depend a little on how a position was evaluated (alone or in a batch), so each
    answer's draft starts from an empty cache: the same seed gives the same answer again, right after
    itself (when the draft's cache holds its whole prompt) and after another answer."""
    tok = smollm2.tokenizer

    def answer(text, seed):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        settings = GenerationSettings(do_sample=True, top_k=0, max_new_tokens=16, seed=seed, repetition_penalty=1.0)
        return (
            generate_mixture(
                smollm2.merged(),
                smollm2.mixture_target(None),
                {"input_ids": ids},
                dataclasses.replace(settings, mixture=MixtureSettings(enabled=True, speculative=True, draft="gguf")),
                controls=Controls(eos_token_id=[], draft_gguf=gguf_draft_for(smollm2, None)),
            )
            .sequences[0]
            .tolist()
        )

    first = answer("Tell me about the sea.", 3)
    assert answer("Tell me about the sea.", 3) == first
    answer("Tell me about the mountains.", 5)
    assert answer("Tell me about the sea.", 3) == first


# ------------------------------------------------------------------ seed 003's class


@pytest.mark.parametrize("draft", ["theta", "gguf"])
def test_seed_class_shapes_and_greedy_tokens(pair2, gguf, draft):
    model_theta, model_t = pair2[0].model, pair2[1].model
    ids = torch.tensor([[504, 1813, 314, 253], [253, 2593, 3719, 504]])
    decoder = OptimalSpeculativeDecoder(model_theta, model_t, k=3, draft=draft, gguf=gguf)
    greedy = decoder.generate(ids, max_length=6, temperature=0.0)
    assert greedy.shape == (2, ids.shape[1] + 6)
    for row in range(2):
        assert greedy[row].tolist() == reference_greedy(model_theta, model_t, ids[row].tolist(), 6)
    sampled = decoder.generate(ids, max_length=6, temperature=1.0, seed=4)
    assert sampled.shape == (2, ids.shape[1] + 6) and sampled[:, :ids.shape[1]].equal(ids)
    assert sampled.equal(decoder.generate(ids, max_length=6, temperature=1.0, seed=4))


@pytest.mark.parametrize("speculative", [False, True])
def test_eos_inside_a_kept_block_stops_there_and_interrupt_stops_before_start(pair2, speculative):
    model_theta, model_t = pair2[0].model, pair2[1].model
    prompt = [504, 1813, 314, 253]
    eos = reference_greedy(model_theta, model_t, prompt, 3, alpha=1.0)[-1]  # the 3rd greedy token, made EOS
    mixture = MixtureSettings(enabled=True, speculative=speculative, alpha=1.0, gamma=4)  # θ's drafts all kept
    r = generate_mixture(
        model_theta,
        model_t,
        {"input_ids": torch.tensor([prompt])},
        dataclasses.replace(GenerationSettings(max_new_tokens=8), mixture=mixture),
        controls=Controls(eos_token_id=eos),
    )
    assert r.new_tokens[0].tolist()[-1] == eos and r.finish_reasons == ["stop"]
    assert r.sequences[0].tolist() == reference_greedy(model_theta, model_t, prompt, r.new_tokens.shape[1], alpha=1.0)
    assert not speculative or r.accepted >= 2
    stop = __import__("threading").Event()
    stop.set()
    events = list(
        stream_mixture(
            model_theta,
            model_t,
            {"input_ids": torch.tensor([prompt])},
            GenerationSettings(mixture=mixture),
            interrupt=stop,
        )
    )
    assert events[-1].result.finish_reasons == ["interrupted"] and events[-1].result.new_tokens.shape[1] == 0


# ------------------------------------------------------------------ the EAGLE head draft


@pytest.mark.parametrize("case", ["two", "peft"])
def test_the_head_drafts_from_true_features_each_round(pair2, peft_lm, head, case):
    """Each round's first draft distribution equals the head run afresh (no cache) over the whole
    sequence with θ's true final hidden states one position back: the kept features, the head's cache
    rollback and the positions all line up, round after round (also across a memory position)."""
    model_theta, model_t = models_of(case, pair2, peft_lm)
    theta = side(model_theta, model_t, 0)[0]
    lm = peft_lm
    prompt = lm.tokenizer("the sea the sea the sea the").input_ids + [lm.tokens.memory_pad, 504]
    memory_at, vector = len(prompt) - 2, torch.randn(64)
    recall = Recall(lm.tokens.recall, lm.tokens.memory_pad, _bank(64), RecallSettings())
    seen = []
    propose = HeadDraft.propose

    def spy(self, seq, gamma, **kw):
        tokens, d = propose(self, seq, gamma, **kw)
        seen.append((list(seq), d[0]))
        return tokens, d

    HeadDraft.propose = spy
    try:
        r = generate_mixture(
            model_theta,
            model_t,
            Prompt({"input_ids": torch.tensor([prompt])}, memory_vectors={memory_at: vector}),
            dataclasses.replace(
                GenerationSettings(do_sample=True, top_k=0, max_new_tokens=12, seed=3),
                mixture=MixtureSettings(enabled=True, speculative=True, draft="head", gamma=3),
            ),
            recall=recall,
            controls=Controls(eos_token_id=[], draft_head=head),
        )
    finally:
        HeadDraft.propose = propose
    assert r.rounds >= 3 and len(seen) >= r.rounds - 1  # (a last round with room for no draft draws directly)
    embed, (backbone, lm_head) = theta.get_input_embeddings(), backbone_and_head(theta)
    for seq, d in seen:
        with torch.no_grad():
            embeds = embed(torch.tensor([seq]))
            embeds[0, memory_at] = vector  # (Recall without a trained embedding feeds the raw vector)
            features = backbone(inputs_embeds=embeds).last_hidden_state  # [1, L, H]
            fresh = head(embeds[:, 1:], features[:, :-1], torch.arange(1, len(seq))[None])[:, -1]
            expected = torch.log_softmax(lm_head(fresh).float(), -1)[0]
        assert torch.allclose(d.log(), expected, atol=1e-4), len(seq)  # (log: the tiny models are near uniform)


def test_a_head_round_trips_through_its_folder(head, tmp_path):
    head.save(tmp_path / "h", note="test")
    again = DraftHead.load(tmp_path / "h")
    x, f, pos = torch.randn(1, 5, 64), torch.randn(1, 5, 64), torch.arange(1, 6)[None]
    with torch.no_grad():  # stored in bfloat16: equal up to its rounding
        assert torch.allclose(head(x, f, pos), again(x, f, pos), atol=0.05)
    with pytest.raises(FileNotFoundError, match="draft_head.json"):
        DraftHead.load(tmp_path / "nothing")


def test_a_draft_head_loads_once_and_must_match_the_models_width(tiny_llama, tmp_path):
    from transformers import LlamaConfig

    DraftHead(head_config(tiny_llama.model.config)).save(tmp_path / "fits")
    head = draft_head_for(tiny_llama, str(tmp_path / "fits"))
    assert head.config.hidden_size == 64 and draft_head_for(tiny_llama, str(tmp_path / "fits")) is head
    other = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    DraftHead(head_config(other)).save(tmp_path / "narrow")
    with pytest.raises(ValueError, match="32 wide but .* are 64"):
        draft_head_for(tiny_llama, str(tmp_path / "narrow"))
    with pytest.raises(ValueError, match="names no folder: train one with python -m training.draft"):
        draft_head_for(tiny_llama, None)


def test_the_head_draft_needs_a_head(pair2, head):
    import copy
    with pytest.raises(ValueError, match="the draft head is torch.bfloat16 but the models are torch.float32"):
        HeadDraft(copy.deepcopy(head).to(torch.bfloat16), ModelPair(pair2[0].model, pair2[1].model))
    with pytest.raises(ValueError, match="mixture head is '': must be a draft head folder"):
        MixtureSettings(enabled=True, speculative=True, draft="head", head="")
    with pytest.raises(ValueError, match="trained draft head"):
        generate_mixture(
            pair2[0].model,
            pair2[1].model,
            {"input_ids": torch.tensor([[504, 1813]])},
            dataclasses.replace(
                GenerationSettings(max_new_tokens=2),
                mixture=MixtureSettings(enabled=True, speculative=True, draft="head"),
            ),
        )

"""Exact speculative sampling for a target computed by one verify forward (here: the mixture q*).

Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding"
(ICML, Algorithm 1 / Theorem 1); Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling". A round: a draft proposes x_1..x_γ with distributions d_1..d_γ; ONE
forward of each model over [last, x_1, ..., x_γ] gives the target q_0..q_γ; x_i is kept with
probability min(1, q_i(x_i) / d_i(x_i)) in order; at the first rejection the token comes from
norm(max(0, q_i - d_i)); with all γ kept one bonus token comes from q_γ. Each emitted token is then
distributed exactly as q whatever the draft is: a poor draft costs speed, never correctness. Both
models' KV caches are cropped back to the kept prefix (`DynamicCache.crop`).

Here: the two models and their caches (`ModelPair`), the acceptance rule, and one round
(`speculative_round`). The drafts, whatever proposes x_1..x_γ, are decoding/drafts.py's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from transformers import LogitsProcessorList

from decoding.compiled import crop
from decoding.forward import Forward
from models.modeling import is_peft, set_adapter_merged

# ---- the acceptance rule (pure, batched) -------------------------------------------------------


def accept_draft(q: torch.Tensor, d: torch.Tensor, x: torch.LongTensor,
                 generator: torch.Generator | None = None) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Leviathan et al.'s rule. q [B, γ+1, V] target probabilities, d [B, γ, V] draft probabilities,
    x [B, γ] drafted tokens (x_i ~ d_i). Returns (n [B] drafts kept, y [B] the token after them)."""
    batch, gamma = x.shape
    qx = q[:, :gamma].gather(-1, x[..., None]).squeeze(-1)  # [B, γ]
    dx = d.gather(-1, x[..., None]).squeeze(-1)  # [B, γ]
    ratio = torch.where(dx > 0, qx / dx.clamp_min(torch.finfo(dx.dtype).tiny), (qx > 0).to(qx.dtype) * 2)
    u = torch.rand(batch, gamma, generator=generator, device=q.device, dtype=q.dtype)  # [B, γ] in [0, 1)
    n = (u < ratio).long().cumprod(-1).sum(-1)  # [B]: index of the first rejection, γ when none
    rows = torch.arange(batch, device=q.device)
    qn = q[rows, n]  # [B, V]
    if gamma == 0:
        return n, torch.multinomial(qn, 1, generator=generator).squeeze(1)
    dn = d[rows, n.clamp_max(gamma - 1)] * (n < gamma).to(d.dtype)[:, None]  # [B, V]; no draft at the bonus
    residual = (qn - dn).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual, qn)  # mass 0 only when q = d up to rounding: take q
    y = torch.multinomial(residual, 1, generator=generator).squeeze(1)  # [B] (multinomial normalises)
    return n, y


def accept_greedy(scores: torch.Tensor, x: torch.LongTensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Greedy verification: scores [B, γ+1, V] (any monotone transform of q), x [B, γ].
    Drafts are kept while they equal the argmax (first on ties); y is the argmax after them."""
    best = scores.argmax(-1)  # [B, γ+1]
    n = (best[:, :x.shape[1]] == x).long().cumprod(-1).sum(-1)  # [B]
    return n, best.gather(1, n[:, None]).squeeze(1)


# ---- the two models and their caches -----------------------------------------------------------


def run_model(fwd: Forward, cache, ids: torch.LongTensor, inject: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """Feed ids [R, S] on `cache`, memory embeddings [H] at the block offsets in `inject`: hidden [R, S, H]."""
    embeds = fwd.embed(ids)  # [R, S, H]
    for offset, vector in inject.items():
        embeds[:, offset] = vector.to(device=embeds.device, dtype=embeds.dtype)
    positions = fwd.text_positions(cache.get_seq_length(), ids.shape[1], ids.shape[0])
    return fwd.forward_block(embeds, positions, cache)


class ModelPair:
    """π_θ and π_t behind one `run`: the same tokens fed to both, logits [2, S, V] (row 0 θ, row 1 t).

    `model_t=None` pairs a PEFT model with its own base (adapter on = θ, off = t). With `batched`
    it is ONE forward of a batch of two (PEFT's mixed adapter batch: `adapter_names=[adapter,
    "__base__"]`, which covers LoRA and trainable tokens, tied heads included) on one batch-2 cache;
    otherwise two forwards on two caches, the second inside `disable_adapter()`.
    """

    def __init__(self, model_theta, model_t=None, *, batched: bool = True):
        self.model = model_theta
        self.self_pair = model_t is None or model_t is model_theta
        if self.self_pair and not is_peft(model_theta):
            raise ValueError(f"model_t is None, which pairs a PEFT model with its own base, but model_theta is a "
                             f"{type(model_theta).__name__}: give a PeftModel or a second model with the same tokenizer")
        models = [model_theta] if self.self_pair else [model_theta, model_t]
        fwds = [Forward(m) for m in models]
        vocab = [f.spec.vocab_size for f in fwds]
        if len(set(vocab)) > 1:
            raise ValueError(f"the two models have vocabularies of {vocab[0]} and {vocab[1]} tokens: the mixture needs "
                             "two models with the same tokenizer")
        self.vocab = vocab[0]
        self.batched = batched and self.self_pair
        self.fwds = fwds * (2 if self.self_pair and not self.batched else 1)
        self.device, self.dtype = self.fwds[0].device, self.fwds[0].dtype
        self.keep_features = False  # keep θ's final hidden state at every cached position (a HeadDraft reads them)
        self.reset()

    def reset(self) -> None:
        self.caches = [self.fwds[0].new_cache() for _ in range(1 if self.batched else 2)]
        self._features, self.kept = None, 0
        for fwd in self.fwds:
            fwd.reset_request_state()

    @property
    def features(self) -> torch.Tensor:
        """θ's final hidden states [kept, H] at cache positions 0.. (with `keep_features`)."""
        return self._features[:self.kept]

    def _keep(self, start: int, hidden: torch.Tensor) -> None:
        if start > self.kept:
            raise RuntimeError(f"θ's features stop at position {self.kept} but a forward started at {start}")
        end = start + hidden.shape[0]
        if self._features is None or end > self._features.shape[0]:
            grown = hidden.new_empty(max(end, 2 * (0 if self._features is None else self._features.shape[0])),
                                     hidden.shape[1])
            if self._features is not None:
                grown[:self.kept] = self.features
            self._features = grown
        self._features[start:end] = hidden
        self.kept = end

    @property
    def can_roll_back(self) -> bool:
        """Whether cropping restores the caches exactly (sliding-window layers drop old positions for good)."""
        return all(type(layer).__name__ == "DynamicLayer" for cache in self.caches for layer in cache.layers)

    @property
    def length(self) -> int:
        """Tokens in the caches (both hold the same)."""
        return self.caches[0].get_seq_length()

    def crop(self, length: int) -> None:
        """Roll both caches back to their first `length` positions."""
        for cache in self.caches:
            crop(cache, cache.get_seq_length() - length)
        self.kept = min(self.kept, length)

    def _contexts(self):
        if self.batched:
            return [self.model._enable_peft_forward_hooks(adapter_names=[self.model.active_adapter, "__base__"])]
        return [contextlib.nullcontext(), self.model.disable_adapter() if self.self_pair else contextlib.nullcontext()]

    def run(self, tokens: Sequence[int], inject: Mapping[int, torch.Tensor] = {}, logits: bool = True,
            rows: Sequence[int] = (0, 1)) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Feed `tokens` (S) to the models in `rows` (0 = θ, 1 = t; both when batched): (logits [R, S, V]
        float32 or None, the first model's hidden states [S, H])."""
        if self.batched and tuple(rows) != (0, 1):
            raise ValueError("a batched pair runs both models together")
        if self.self_pair:  # a merged adapter cannot be switched off per forward (nor per row of a batch)
            set_adapter_merged(self.model, False)
        ids = torch.tensor([list(tokens)], device=self.device)  # [1, S]
        start = self.caches[0].get_seq_length()
        parts = [0] if self.batched else list(rows)
        contexts = self._contexts()
        outs, hidden = [], []
        with torch.no_grad():
            for part in parts:
                fwd = self.fwds[part]
                with contexts[part]:
                    h = run_model(fwd, self.caches[part], ids.expand(2 if self.batched else 1, -1), inject)  # [R, S, H]
                    outs.append(fwd.logits(h) if logits else None)
                hidden.append(h)
        if self.keep_features and parts[0] == 0:
            self._keep(start, hidden[0][0])
        return (torch.cat(outs) if logits else None), hidden[0][0]


def process_block(processors: LogitsProcessorList | None, seq: list[int], drafts: list[int],
                 logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both models' scores [S, V] after the request's processors; logits [2, S, V] (θ, t). Position i
    follows seq + drafts[:i], which is what the processors see, for both models alike."""
    if not processors:
        return logits[0], logits[1]
    ids = torch.tensor(seq + drafts, device=logits.device)
    rows = [processors(ids[:len(seq) + i].expand(2, -1), logits[:, i]) for i in range(logits.shape[1])]
    scores = torch.stack(rows, 1)  # [2, S, V]
    return scores[0], scores[1]


# ---- one round ---------------------------------------------------------------------------------

Target = Callable[[list[int], list[int], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Round:
    tokens: list[int]  # the kept drafts, then the corrected (or bonus) token
    alphas: list[float]  # the target's side value at each emitted token's position (α* for q*)
    drafted: int
    accepted: int


@dataclass(frozen=True)
class Sampling:
    """How a round draws its tokens: `do_sample` (else greedy) after the request's `processors`, with
    `generator`, a seeded request's own random state (None: the global one)."""

    do_sample: bool
    processors: LogitsProcessorList | None = None
    generator: torch.Generator | None = None


def speculative_round(seq: list[int], pair: ModelPair, draft, gamma: int, target: Target, sampling: Sampling, *,
                      memory: Mapping[int, torch.Tensor] = {}, inject: Mapping[int, torch.Tensor] = {}) -> Round:
    """Draft up to γ tokens after `seq` (whose last token is not in the caches yet), verify them with one
    `pair.run`, keep per the rule, and crop the caches to everything but the new last token.

    `target(seq, drafts, logits [2, γ+1, V])` -> (log q [γ+1, V], side values [γ+1]). No draft or
    γ = 0 is a direct draw from q. `sampling`: how the draft draws and the rule keeps. `memory`
    (sequence positions) feeds a model draft; `inject` (block offsets) the verify forward.
    """
    tokens, d = (draft.propose(seq, gamma, processors=sampling.processors, do_sample=sampling.do_sample,
                               memory=memory, generator=sampling.generator)
                 if draft is not None and gamma > 0 else ([], None))
    reuse = getattr(draft, "row", None) if tokens else None
    if reuse is None:
        logits, _ = pair.run([seq[-1], *tokens], inject)  # [2, γ+1, V]: one forward of each model
    else:  # the draft already ran its model over the block: only the other one verifies
        other, _ = pair.run([seq[-1], *tokens], inject, rows=(1 - reuse,))
        logits = torch.cat([draft.logits[None], other] if reuse == 0 else [other, draft.logits[None]])
    log_q, side = target(seq, tokens, logits)  # [γ+1, V], [γ+1]
    x = torch.tensor([tokens], dtype=torch.long, device=log_q.device)  # [1, γ]
    if sampling.do_sample:
        d = d.to(log_q.device) if d is not None else log_q.new_zeros(0, log_q.shape[-1])
        n, y = accept_draft(log_q.exp()[None], d[None], x, sampling.generator)
    else:
        n, y = accept_greedy(log_q[None], x)
    n = int(n)
    pair.crop(len(seq) + n)  # cache: seq and the kept drafts; the new last token is fed next round
    return Round(tokens[:n] + [int(y)], side[:n + 1].tolist(), len(tokens), n)

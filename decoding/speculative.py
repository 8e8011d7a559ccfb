"""Exact speculative sampling for a target computed by one verify forward (here: the mixture q*).

Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding"
(ICML, Algorithm 1 / Theorem 1); Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling". A round: a draft proposes x_1..x_γ with distributions d_1..d_γ; ONE
forward of each model over [last, x_1, ..., x_γ] gives the target q_0..q_γ; x_i is kept with
probability min(1, q_i(x_i) / d_i(x_i)) in order; at the first rejection the token comes from
norm(max(0, q_i - d_i)); with all γ kept one bonus token comes from q_γ. Each emitted token is then
distributed exactly as q whatever the draft is: a poor draft costs speed, never correctness. Both
models' KV caches are cropped back to the kept prefix (`DynamicCache.crop`).

Drafts: `NgramDraft` (prompt lookup, Saxena 2023: the continuation of the latest earlier
occurrence of the newest n-gram; a point mass, free), `PairDraft` (one of the two models on its own
cache in an unbatched pair, its logits reused by the verify) and `ModelDraft` (one of the two
models on a separate cache, for a batched pair; Chen et al.'s draft model), `HeadDraft` (EAGLE:
a trained one-layer head over θ's features, decoding/draft_head.py) and `GGUFDraft` (a quantized
model run by llama.cpp, decoding/gguf_draft.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from transformers import DynamicCache, LogitsProcessorList

from decoding.compiled import crop
from decoding.gguf_draft import GGUFDraft
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


def point_masses(tokens: Sequence[int], vocab: int, device=None) -> torch.Tensor:
    """The distributions [γ, V] of a deterministic draft: one-hot at each proposed token."""
    d = torch.zeros(len(tokens), vocab, device=device)
    d[torch.arange(len(tokens)), torch.as_tensor(list(tokens), dtype=torch.long)] = 1.0
    return d


def ngram_proposal(seq: torch.LongTensor, gamma: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: the γ tokens that followed the latest earlier occurrence of seq's newest n-gram
    (longest n first). seq [L]; [] when nothing matches."""
    length = seq.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = seq[:length - 1].unfold(0, n, 1)  # [L-n, n]: every n-gram with a token after it
        hits = (windows == seq[length - n:]).all(-1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return seq[start:start + gamma].tolist()
    return []


# ---- drafts ------------------------------------------------------------------------------------


class NgramDraft:
    """Prompt-lookup draft: free (no model), deterministic, so d is a point mass."""

    def __init__(self, vocab: int, max_ngram: int = 3):
        self.vocab, self.max_ngram = vocab, max_ngram

    def propose(self, seq: list[int], gamma: int, **_) -> tuple[list[int], torch.Tensor | None]:
        tokens = ngram_proposal(torch.tensor(seq), gamma, self.max_ngram)
        return tokens, (point_masses(tokens, self.vocab) if tokens else None)


class ModelDraft:
    """One model drafting on its own batch-1 cache (a PEFT model with its adapter on or off)."""

    def __init__(self, model: torch.nn.Module, *, base: bool = False):
        self.model, self.fwd, self.base = model, Forward(model), base
        self.cache = self.fwd.new_cache()
        self.fed: list[int] = []  # the tokens in self.cache

    def _context(self):
        if not self.base:
            return contextlib.nullcontext()
        set_adapter_merged(self.model, False)  # a merged adapter cannot be switched off per forward
        return self.model.disable_adapter()

    def propose(self, seq: list[int], gamma: int, *, processors: LogitsProcessorList | None, do_sample: bool,
                memory: Mapping[int, torch.Tensor] = {}, generator: torch.Generator | None = None
                ) -> tuple[list[int], torch.Tensor | None]:
        keep = 0
        while keep < min(len(self.fed), len(seq) - 1) and self.fed[keep] == seq[keep] and keep not in memory:
            keep += 1  # (a memory position is re-fed: the draft may have fed a plain <|memory_pad|> there)
        crop(self.cache, len(self.fed) - keep)
        self.fed = self.fed[:keep]
        feed, tokens, dists = list(seq[keep:]), [], []
        with self._context(), torch.no_grad():
            for _ in range(gamma):
                start = len(self.fed)
                inject = {p - start: v for p, v in memory.items() if 0 <= p - start < len(feed)}
                hidden = run_model(self.fwd, self.cache, torch.tensor([feed], device=self.fwd.device), inject)
                self.fed += feed
                logits = self.fwd.logits(hidden[:, -1])  # [1, V]
                ids = torch.tensor([seq + tokens], device=logits.device)
                scores = processors(ids, logits) if processors else logits
                dist = torch.softmax(scores, -1)[0]  # [V]
                token = int(torch.multinomial(dist, 1, generator=generator)) if do_sample else int(scores[0].argmax())
                tokens.append(token)
                dists.append(dist)
                feed = [token]
        return tokens, torch.stack(dists) if dists else None


class PairDraft:
    """One model of an unbatched pair drafts on its own cache in the pair, and its logits at the γ+1
    block positions are reused: the verify then runs only the other model (the seed's "draft from
    π_θ" idea, done exactly). `row` 0 drafts with θ, 1 with t."""

    def __init__(self, pair: "ModelPair", row: int):
        if pair.batched:
            raise ValueError("PairDraft needs an unbatched pair (one cache per model)")
        self.pair, self.row, self.logits = pair, row, None

    def propose(self, seq: list[int], gamma: int, *, processors: LogitsProcessorList | None, do_sample: bool,
                memory: Mapping[int, torch.Tensor] = {}, generator: torch.Generator | None = None
                ) -> tuple[list[int], torch.Tensor | None]:
        tokens, dists, rows, feed = [], [], [], seq[-1]
        for i in range(gamma + 1):  # the last step feeds x_γ: the logits at the bonus position
            inject = {0: memory[len(seq) - 1]} if i == 0 and len(seq) - 1 in memory else {}
            logits = self.pair.run([feed], inject, rows=(self.row,))[0][:, -1]  # [1, V]
            rows.append(logits[0])
            if i == gamma:
                break
            ids = torch.tensor([seq + tokens], device=logits.device)
            scores = processors(ids, logits.clone()) if processors else logits
            dist = torch.softmax(scores, -1)[0]  # [V]
            feed = int(torch.multinomial(dist, 1, generator=generator)) if do_sample else int(scores[0].argmax())
            tokens.append(feed)
            dists.append(dist)
        self.logits = torch.stack(rows)  # [γ+1, V] raw logits of the drafting model
        return tokens, torch.stack(dists) if dists else None


class HeadDraft:
    """EAGLE's draft (decoding/draft_head.py): a one-layer head over θ's features, which the pair keeps
    from its forwards, read by θ's own lm_head. A round first catches the head's cache up on the
    positions the last verify settled (true features), then drafts γ tokens feeding back its own
    predicted features; a draft step costs one small layer and one lm_head, not a forward of θ."""

    def __init__(self, head: torch.nn.Module, pair: "ModelPair"):
        dtype = next(head.parameters()).dtype
        if dtype != pair.dtype:
            raise ValueError(f"the draft head is {dtype} but the models are {pair.dtype}: load it in the models' dtype "
                             "(DraftHead.load(folder, dtype=...))")
        if pair.length:
            raise ValueError("a HeadDraft must be made before the pair's prefill (it reads θ's features from it)")
        self.head, self.pair, self.fwd = head, pair, pair.fwds[0]
        pair.keep_features = True
        self.cache = DynamicCache(config=head.config)
        self.settled = 0  # the head's cache holds positions 1..settled read from true features

    def propose(self, seq: list[int], gamma: int, *, processors: LogitsProcessorList | None, do_sample: bool,
                memory: Mapping[int, torch.Tensor] = {}, generator: torch.Generator | None = None
                ) -> tuple[list[int], torch.Tensor | None]:
        last = len(seq) - 1  # position of the newest token; the pair holds features for 0..last-1
        if last < 1 or self.pair.kept < last:
            return [], None
        self.settled = min(self.settled, last - 1)  # at least the newest token is fed
        crop(self.cache, self.cache.get_seq_length() - self.settled)
        start = self.settled + 1  # position t reads (x_t, f_{t-1})
        device = self.fwd.device
        with torch.no_grad():
            embeds = self.fwd.embed(torch.tensor([seq[start:]], device=device))  # [1, S, H]
            for p, vector in memory.items():
                if start <= p <= last:
                    embeds[0, p - start] = vector.to(device=device, dtype=embeds.dtype)
            positions = torch.arange(start, last + 1, device=device)[None]
            feature = self.head(embeds, self.pair.features[start - 1:last][None], positions, self.cache)[:, -1:]
            self.settled = last
            tokens, dists = [], []
            for i in range(gamma):
                logits = self.fwd.logits(feature[:, 0])  # [1, V]
                ids = torch.tensor([seq + tokens], device=device)
                scores = processors(ids, logits) if processors else logits
                dist = torch.softmax(scores, -1)[0]  # [V]
                token = int(torch.multinomial(dist, 1, generator=generator)) if do_sample else int(scores[0].argmax())
                tokens.append(token)
                dists.append(dist)
                if i + 1 < gamma:
                    embeds = self.fwd.embed(torch.tensor([[token]], device=device))
                    feature = self.head(embeds, feature, torch.tensor([[last + 1 + i]], device=device), self.cache)
        return tokens, torch.stack(dists)


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


def make_draft(kind: str, pair: ModelPair, model_theta, ngram: int = 3, head: torch.nn.Module | None = None,
               gguf=None):
    """The draft for `kind` ("ngram", "theta", "target", "head": `head`, a trained DraftHead; "gguf":
    `gguf`, a `models.llamacpp.LlamaCppModel` from `models.gguf.load_gguf_draft`) on `pair`."""
    if not pair.can_roll_back:
        raise ValueError("the model has sliding-window attention layers, whose cache cannot be rolled back after a "
                         "rejected draft: set mixture speculative=False")
    if kind == "ngram":
        return NgramDraft(pair.vocab, ngram)
    if kind == "head":
        if head is None:
            raise ValueError("draft='head' needs a trained draft head (decoding/draft_head.py; "
                             "python -m training.draft makes one)")
        return HeadDraft(head, pair)
    if kind == "gguf":
        if gguf is None:
            raise ValueError("draft='gguf' needs a llama.cpp model (models.gguf.load_gguf_draft)")
        return GGUFDraft(gguf, pair.vocab, device=pair.device)
    row = 0 if kind == "theta" else 1
    if not pair.batched:  # the drafting model's own cache in the pair; the verify reuses its logits
        return PairDraft(pair, row)
    return ModelDraft(model_theta, base=row == 1)  # a batched PEFT pair: a separate batch-1 cache


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


def speculative_round(seq: list[int], pair: ModelPair, draft, gamma: int, target: Target, do_sample: bool, *,
                      processors: LogitsProcessorList | None = None, memory: Mapping[int, torch.Tensor] = {},
                      inject: Mapping[int, torch.Tensor] = {}, generator: torch.Generator | None = None) -> Round:
    """Draft up to γ tokens after `seq` (whose last token is not in the caches yet), verify them with one
    `pair.run`, keep per the rule, and crop the caches to everything but the new last token.

    `target(seq, drafts, logits [2, γ+1, V])` -> (log q [γ+1, V], side values [γ+1]). No draft or
    γ = 0 is a direct draw from q. `memory` (sequence positions) feeds a model draft; `inject`
    (block offsets) the verify forward. `generator`: a seeded request's own random state.
    """
    tokens, d = (draft.propose(seq, gamma, processors=processors, do_sample=do_sample, memory=memory,
                               generator=generator)
                 if draft is not None and gamma > 0 else ([], None))
    reuse = getattr(draft, "row", None) if tokens else None
    if reuse is None:
        logits, _ = pair.run([seq[-1], *tokens], inject)  # [2, γ+1, V]: one forward of each model
    else:  # the draft already ran its model over the block: only the other one verifies
        other, _ = pair.run([seq[-1], *tokens], inject, rows=(1 - reuse,))
        logits = torch.cat([draft.logits[None], other] if reuse == 0 else [other, draft.logits[None]])
    log_q, side = target(seq, tokens, logits)  # [γ+1, V], [γ+1]
    x = torch.tensor([tokens], dtype=torch.long, device=log_q.device)  # [1, γ]
    if do_sample:
        d = d.to(log_q.device) if d is not None else log_q.new_zeros(0, log_q.shape[-1])
        n, y = accept_draft(log_q.exp()[None], d[None], x, generator)
    else:
        n, y = accept_greedy(log_q[None], x)
    n = int(n)
    pair.crop(len(seq) + n)  # cache: seq and the kept drafts; the new last token is fed next round
    return Round(tokens[:n] + [int(y)], side[:n + 1].tolist(), len(tokens), n)

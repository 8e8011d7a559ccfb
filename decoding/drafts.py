"""The drafts of speculative sampling (decoding/speculative.py): what proposes x_1..x_γ, with their
distributions d_1..d_γ, for a round to verify.

`NgramDraft` (prompt lookup, Saxena 2023: the continuation of the latest earlier occurrence of the
newest n-gram; a point mass, free), `PairDraft` (one of the two models on its own cache in an
unbatched pair, its logits reused by the verify) and `ModelDraft` (one of the two models on a
separate cache, for a batched pair; Chen et al.'s draft model), `HeadDraft` (EAGLE: a trained
one-layer head over θ's features, decoding/draft_head.py) and `GGUFDraft` (a quantized model run by
llama.cpp, decoding/gguf_draft.py). `make_draft` picks one.

A draft's `propose(seq, gamma, *, processors, do_sample, memory={}, generator=None)` returns (the
drafted tokens, their distributions [γ, V], or None when it drafted nothing).
"""

from __future__ import annotations

import contextlib
from typing import Mapping, Sequence

import torch
from transformers import DynamicCache, LogitsProcessorList

from decoding.compiled import crop
from decoding.forward import Forward
from decoding.gguf_draft import GGUFDraft
from decoding.speculative import ModelPair, run_model
from models.modeling import set_adapter_merged


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

    def __init__(self, pair: ModelPair, row: int):
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

    def __init__(self, head: torch.nn.Module, pair: ModelPair):
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

"""The memory head and memory embedding (seed 000, sections 4.3-4.4).

memory head: like `lm_head` over the memory bank: the `<recall>` hidden state is scored against
every stored vector (cosine similarity = logits), then warped and sampled like token logits.
memory embedding: the chosen vector becomes the input embedding of the `<|memory_pad|>` position.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from decoding.settings import RecallSettings, make_memory_warper

log = logging.getLogger("decoding.memory")


def memory_head(query_vector: torch.Tensor, memory_db, debug: bool = False):
    """Seed API: (logits over all memories [N], candidates best first) for one query [H]."""
    candidates = memory_db.search(query_vector.detach().float().cpu(), top_k=len(memory_db), debug=debug)
    logits = torch.tensor([c["score"] for c in candidates], dtype=torch.float32, device=query_vector.device)
    return logits, candidates


def memory_embedding(memory_vector: torch.Tensor, model, device=None, dtype=None) -> torch.Tensor:
    """Seed API: a memory vector as a `[1, 1, H]` input embedding on the model's device and dtype."""
    while memory_vector.dim() < 3:
        memory_vector = memory_vector.unsqueeze(0)
    if device is None or dtype is None:
        param = next(model.parameters())
        device = param.device if device is None else device
        dtype = param.dtype if dtype is None else dtype
    return memory_vector.to(device=device, dtype=dtype)


@dataclass(frozen=True, slots=True)
class MemoryChoice:
    index: int
    score: float


class MemorySelector:
    """Scores a query against the bank and picks one memory, per the recall settings.

    Only the top `recall.top_k` scores are fetched from the bank's exact search: the memory
    top-k warper would set every other score to -inf, so this gives the same distribution as
    warping all N scores (top_k=0 fetches all of them).
    """

    def __init__(self, memory_db, recall: RecallSettings):
        self.db = memory_db
        self.recall = recall
        self.warper = make_memory_warper(recall) if recall.use_sampling else None

    def scores(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores [k], memory indices [k]) best first."""
        k = self.recall.top_k or None
        return self.db.topk(query.detach().float().cpu(), k)

    def choose(self, query: torch.Tensor) -> MemoryChoice:
        scores, indices = self.scores(query)  # [k], [k]
        if self.warper is not None:
            warped = self.warper(None, scores[None].clone())  # [1, k]
            probs = torch.softmax(warped, dim=-1)
            pick = int(torch.multinomial(probs, num_samples=1))
        else:
            pick = 0  # scores are sorted: greedy is the best
        choice = MemoryChoice(index=int(indices[pick]), score=float(scores[pick]))
        if self.recall.debug:
            log.info("[recall] query shape %s, %d candidates, top scores %s",
                     tuple(query.shape), len(scores), [round(float(s), 4) for s in scores[:5]])
            log.info("[recall] chose memory %d (candidate %d), similarity=%.4f%s", choice.index, pick,
                     choice.score, f", p={float(probs[0, pick]):.4f}" if self.warper is not None else "")
        return choice

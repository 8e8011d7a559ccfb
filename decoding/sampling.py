"""Pure sampling functions: processed scores in, choices out. No model, no state.

The same `sample` picks the next token from the vocabulary and the memory from the bank: the
memory head's similarities are logits like any others (seed 000's symmetry of `lm_head` and the
memory head).
"""

from __future__ import annotations

import torch


def sample(scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """Choices [B] from processed scores [B, N]: a draw from softmax(scores) (from `generator`, else the global
    random state), or the argmax (first on ties).

    The operations are `GenerationMixin._sample`'s, so a seeded draw matches `model.generate`.
    """
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=generator).squeeze(1)
    return torch.argmax(scores, dim=-1)


def kept(scores: torch.Tensor) -> torch.Tensor:
    """How many candidates of each row [B, N] a warper left (scores above -inf): [B]."""
    return torch.isfinite(scores).sum(dim=-1)


def draw(scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """Choices [B] from processed scores [B, N] without a host sync: the argmax, or a draw from softmax(scores)
    as argmax(p / E) with E ~ Exponential(1) per candidate (the exponential race: P(i wins) = p_i, the law of
    `torch.multinomial`, which synchronises with the host on CUDA; gpt-fast's `multinomial_sample_one_no_sync`).
    The noise comes from `generator` (on the scores' device), else the global random state."""
    if not do_sample:
        return torch.argmax(scores, dim=-1)
    probs = torch.softmax(scores.float(), dim=-1)  # [B, N]
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return torch.argmax(probs / noise, dim=-1)

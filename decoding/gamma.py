"""γ, the drafts per verify of the mixture's speculative sampling, round by round (`mixture.gamma_rule`).

Every rule picks three lengths around the configured γ (the base), bounded to [3, 10] as seed 003's
`adaptive_k` bounds its k: short = max(3, γ − 2), γ, long = min(10, γ + 3), from an estimate of the
acceptance rate r: r > 0.7 gives one end, r < 0.3 the other, anything between gives γ.

- "fixed": γ every round.
- "seed" (seed 003's `adaptive_k`): r̂ = 2·min(α*, 1 − α*), with α* of the last verified position; r̂ > 0.7
  gives short, r̂ < 0.3 long. (The seed's k counts i.i.d. tries at one token, which a low acceptance
  needs more of; here γ counts tokens drafted in a row.)
- "acceptance": r = kept / drafted over the last `WINDOW` rounds that drafted; r > 0.7 gives long, r < 0.3
  short (in a row, a likely-kept draft is worth drafting further: Leviathan et al.'s expected tokens a
  verify, (1 − r^(γ+1)) / (1 − r), grows with γ the more the larger r is).

The first round drafts γ. γ depends only on rounds already verified, so every token stays distributed as
q* (the rule of a round never sees its own drafts); the round's length limit still caps it (`decoding.mixture`).
"""

from __future__ import annotations

from collections import deque

GAMMA_MIN, GAMMA_MAX = 3, 10  # the seed's bounds on k
HIGH, LOW = 0.7, 0.3  # the seed's thresholds on the estimated acceptance rate
WINDOW = 4  # rounds the "acceptance" rule reads


def three_lengths(base: int) -> tuple[int, int, int]:
    """(short, base, long) = (max(3, base − 2), base, min(10, base + 3)), the seed's."""
    return max(GAMMA_MIN, base - 2), base, min(GAMMA_MAX, base + 3)


def seed_estimate(alpha_star: float) -> float:
    """The seed's acceptance estimate from α*: 2·min(α*, 1 − α*) (1 at α* = 0.5, 0 at either end)."""
    return 2 * min(alpha_star, 1 - alpha_star)


def adaptive_k(alpha_star: float, base_k: int = 5) -> int:
    """Seed 003's rule: r̂ = 2·min(α*, 1 − α*); r̂ > 0.7 → max(3, base_k − 2), r̂ < 0.3 → min(10, base_k + 3),
    else base_k."""
    short, base, long = three_lengths(base_k)
    estimate = seed_estimate(alpha_star)
    return short if estimate > HIGH else long if estimate < LOW else base


def acceptance_gamma(rate: float, base: int) -> int:
    """The measured rule: kept / drafted r > 0.7 → min(10, base + 3), r < 0.3 → max(3, base − 2), else base."""
    short, base, long = three_lengths(base)
    return long if rate > HIGH else short if rate < LOW else base


class GammaSchedule:
    """γ of the next round (`gamma`) under `rule` (one of `decoding.settings.GAMMA_RULES`, validated by
    `MixtureSettings`) around `base`; `update` it with each verified round."""

    def __init__(self, rule: str, base: int):
        self.rule, self.base, self.gamma = rule, base, base
        self.estimate: float | None = None  # the rule's acceptance estimate r̂ or r (None: none yet, or "fixed")
        self.recent: deque[tuple[int, int]] = deque(maxlen=WINDOW)  # (kept, drafted) of rounds that drafted

    def update(self, alphas: list[float], drafted: int, accepted: int) -> None:
        """After a round: its α* per emitted position (the last one is the last verified) and its draft's fate."""
        if self.rule == "seed" and alphas:
            self.estimate, self.gamma = seed_estimate(alphas[-1]), adaptive_k(alphas[-1], self.base)
        elif self.rule == "acceptance" and drafted:
            self.recent.append((accepted, drafted))
            self.estimate = sum(k for k, _ in self.recent) / sum(d for _, d in self.recent)
            self.gamma = acceptance_gamma(self.estimate, self.base)

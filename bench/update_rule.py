"""Knowledge updates at read time, offline: held-out people tell 5 things, then a new value of one (home, job or
favourite colour: "We've just moved to Brackholm."); their questions are scored against their memories with the
chat's query, and a rule picks the memory read:

    .venv/bin/python bench/update_rule.py [--people 150] [--seed recency-heldout]

- plain: the most similar memory (the memory head today);
- newest among near ties about the same thing: among the memories within `margin` of the best score whose key is
  at least `same` similar to the best one's, the newest.
Prints the right memory's rate for the update's question and for the other told things' questions. No model
decodes here: it measures retrieval only, in seconds.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--people", type=int, default=150)
    ap.add_argument("--seed", default="recency-heldout")
    ap.add_argument("--margins", default="0,0.05,0.1,0.15,0.2")
    ap.add_argument("--same", default="0.4,0.45,0.5")
    ap.add_argument("--fit", default="0,0.9", help="the fit check's least probability for a newer memory to be read "
                    "over the best (0: none)")
    ap.add_argument("--split", default="eval", help="the people's words: eval (held out) or train (the plainest: \"I "
                    "live in Porto.\", \"Where do I live?\")")
    args = ap.parse_args()

    import torch
    from torch.nn.functional import normalize

    from models import LoadOptions, load_model
    from training.facts import Names
    from training.personal import UPDATABLE, person, update

    lm = load_model(None, LoadOptions(device="cpu"))
    embed = lambda t: normalize(lm.encoder.query(t).float().reshape(-1), dim=-1)  # noqa: E731
    query = lambda q: lm.encoder.message_query(q).float().reshape(-1)  # noqa: E731 - the chat's query
    rng = random.Random(args.seed)
    names = Names(args.split, rng)
    check = lm.encoder.fit_check
    fit = lambda q, keys: check.probability(q.reshape(1, -1).expand_as(keys), keys)  # noqa: E731
    rows = []  # (category, scores [M], keys [M, D], fits [M], the right memory); a memory's index is its age order
    for _ in range(args.people):
        things = person(args.split, rng, names, 5)
        old = next((t for t in things if t.kind.split(":")[0] in UPDATABLE), None)
        if old is None:
            continue
        new = update(old, args.split, rng, names)
        keys = torch.stack([embed(t.memory) for t in things] + [embed(new.memory)])
        asked = [(query(new.questions[0]), "update", len(things))] + [
            (query(t.questions[0]), "single", i) for i, t in enumerate(things) if t is not old]
        rows += [(what, keys @ q, keys, fit(q, keys), right) for q, what, right in asked]

    def pick(scores, keys, fits, margin: float, same: float, least: float) -> int:
        """The rule as `memory.personal.Newest` reads: the older of the near ties about the same thing (and, with
        a `least` fit, that the fit check says answer the question) are dropped, then the most similar of what is
        left."""
        top = int(scores.argmax())
        near = [i for i in range(len(scores)) if scores[i] >= scores[top] - margin
                and (i == top or (float(keys[i] @ keys[top]) >= same and float(fits[i]) >= least))]
        left = [i for i in range(len(scores)) if i not in near or i == max(near)]
        return max(left, key=lambda i: float(scores[i]))

    def rate(category: str, margin: float, same: float, least: float) -> float:
        mine = [r for r in rows if r[0] == category]
        return sum(pick(s, k, f, margin, same, least) == right for _, s, k, f, right in mine) / len(mine)

    print(f"{sum(r[0] == 'update' for r in rows)} update questions, {sum(r[0] == 'single' for r in rows)} others "
          f"(seed {args.seed!r}, {args.split} words)\n\n| same >= | margin | a newer one's fit >= | "
          "update's question: right memory | others: right memory |\n|---|---|---|---|---|")
    for same in (float(x) for x in args.same.split(",")):
        for margin in (float(x) for x in args.margins.split(",")):
            for least in (float(x) for x in args.fit.split(",")):
                print(f"| {same:.2f} | {margin:.2f} | {least:.2f} | {rate('update', margin, same, least):.3f} | "
                      f"{rate('single', margin, same, least):.3f} |")


if __name__ == "__main__":
    main()

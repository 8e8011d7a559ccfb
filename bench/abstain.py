"""The memory head's "nothing fits" threshold (`memory.autoregressive_recall.min_score`), calibrated on held-out data.

    .venv/bin/python bench/abstain.py [--told 500] [--untold 500] [--general 300] [--json out.json]

A bank of `--told` facts of the evaluation split (never trained on), keyed by the shipped key encoder as the app
keys them. Three kinds of question, each asked as the page asks it (the query is the key encoder's embedding of
the message): a question about a fact in the bank (the right memory should be found: its score), a question
about one of `--untold` other facts of the same kinds (nothing in the bank answers it: the best score), and an
ordinary chat prompt (`--general`). For each threshold the table gives the told questions still answered from
their own memory and the untold and general questions that recall nothing. Printed, and written as JSON.

Then people (`--people`, the held-out split of `training.personal`): each tells 4 things, written as the chat writes
them ("The user lives in Porto."), and asks about those and about 3 things never told ("Where do I live?"), with the
query as the message alone and as the chat makes it for a message that speaks of its author (the mean of the
message's embedding and that of its words about the user: "Where does the user live?").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--told", type=int, default=500)
    parser.add_argument("--untold", type=int, default=500)
    parser.add_argument("--general", type=int, default=300)
    parser.add_argument("--people", type=int, default=60)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    import torch

    from chat.config import load_config, load_options
    from models import load_model
    from training.facts import chat_prompts, make_facts

    cfg = load_config(environ={})
    lm = load_model(None, load_options(cfg))
    facts = make_facts(args.told + args.untold, "eval", seed=7)
    told, untold = facts[:args.told], facts[args.told:]
    t0 = time.perf_counter()
    keys, _ = lm.encoder.encode(lm.model, lm.tokenizer, [f.text for f in told], batch_size=64, progress=False)
    keys = torch.nn.functional.normalize(keys.float(), dim=-1)

    def best(questions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.stack([lm.encoder.query(x).float().reshape(-1) for x in questions])
        scores = torch.nn.functional.normalize(q, dim=-1) @ keys.T
        return scores.max(-1)

    told_scores, told_ids = best([f.questions[-1] for f in told])  # the second paraphrase: not the memory's words
    right = told_ids == torch.arange(len(told))
    untold_scores, _ = best([f.questions[-1] for f in untold])
    general_scores, _ = best(chat_prompts(args.general, "eval", seed=7))
    seconds = time.perf_counter() - t0

    rows = []
    for tau in [round(0.05 * i, 2) for i in range(0, 13)]:
        rows.append({"min_score": tau,
                     "told_answered": float(((told_scores >= tau) & right).float().mean()),
                     "untold_abstained": float((untold_scores < tau).float().mean()),
                     "general_abstained": float((general_scores < tau).float().mean())})
    print(f"{len(told)} told, {len(untold)} untold, {args.general} general questions; retrieval right "
          f"{float(right.float().mean()):.3f} at any score ({seconds:.0f} s)")
    print("| min_score | told: own memory found | untold: nothing recalled | general: nothing recalled |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['min_score']:.2f} | {r['told_answered']:.3f} | {r['untold_abstained']:.3f} | "
              f"{r['general_abstained']:.3f} |")
    quantiles = {name: [round(float(torch.quantile(s, q)), 3) for q in (0.01, 0.05, 0.5, 0.95, 0.99)]
                 for name, s in (("told_right", told_scores[right]), ("untold", untold_scores),
                                 ("general", general_scores))}
    print("score quantiles (1, 5, 50, 95, 99 %):", json.dumps(quantiles))
    people = personal(lm, args.people)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "quantiles": quantiles, "told": len(told),
                                               "untold": len(untold), "general": args.general, "people": people},
                                              indent=1))


def personal(lm, n: int) -> dict:
    """Held-out people's own memories: the right one found (top-1 at a score >= min_score) for told things, nothing
    over min_score for untold ones, with the message alone as the query and with the chat's query."""
    import random

    import torch
    from torch.nn.functional import normalize

    from training.facts import Names
    from training.personal import person

    rng = random.Random("abstain-people")
    names = Names("eval", rng)
    embed = lambda text: normalize(lm.encoder.query(text).float().reshape(-1), dim=-1)  # noqa: E731
    queries = {"message": embed, "chat": lambda q: lm.encoder.message_query(q).float().reshape(-1)}
    found: dict[str, list] = {name: [] for name in queries}
    for _ in range(n):
        things = person("eval", rng, names, 7)
        told, untold = things[:4], things[4:]
        keys = torch.stack([embed(t.memory) for t in told])
        for name, query in queries.items():
            for i, t in enumerate(told + untold):
                scores = keys @ query(t.questions[0])
                found[name].append((i < len(told), float(scores.max()), int(scores.argmax()) == i))
    out = {}
    print(f"\n{n} held-out people, 4 things told and 3 never told each: right memory found / nothing recalled")
    print("| min_score | " + " | ".join(f"{q}: told found | {q}: untold nothing" for q in queries) + " |")
    print("|---|" + "---|---|" * len(queries))
    for tau in [round(0.05 * i, 2) for i in range(2, 13)]:
        cells = []
        for name in queries:
            told_rows = [r for r in found[name] if r[0]]
            untold_rows = [r for r in found[name] if not r[0]]
            right = sum(r[2] and r[1] >= tau for r in told_rows) / len(told_rows)
            nothing = sum(r[1] < tau for r in untold_rows) / len(untold_rows)
            out.setdefault(name, []).append({"min_score": tau, "told_found": right, "untold_nothing": nothing})
            cells += [f"{right:.3f}", f"{nothing:.3f}"]
        print(f"| {tau:.2f} | " + " | ".join(cells) + " |")
    return out


if __name__ == "__main__":
    main()

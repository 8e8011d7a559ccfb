"""The memory head's "nothing fits" threshold (`memory.autoregressive_recall.min_score`), calibrated on held-out data.

    .venv/bin/python bench/abstain.py [--told 500] [--untold 500] [--general 300] [--json out.json]

A bank of `--told` facts of the evaluation split (never trained on), keyed by the shipped key encoder as the app
keys them. Three kinds of question, each asked as the page asks it (the query is the key encoder's embedding of
the message): a question about a fact in the bank (the right memory should be found: its score), a question
about one of `--untold` other facts of the same kinds (nothing in the bank answers it: the best score), and an
ordinary chat prompt (`--general`). For each threshold the table gives the told questions still answered from
their own memory and the untold and general questions that recall nothing. Printed, and written as JSON.
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
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "quantiles": quantiles, "told": len(told),
                                               "untold": len(untold), "general": args.general}, indent=1))


if __name__ == "__main__":
    main()

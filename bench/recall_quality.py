"""Recall quality of the default model on held-out facts, through the real generation loop.

    .venv/bin/python bench/recall_quality.py [--facts 100] [--chats 50] [--adapter auto|none|PATH]

Facts, questions and entities come from the evaluation split of `training.facts`, which training
never saw; each question is asked in a fresh conversation against a bank written by the model's
own memory encoder (see `training.evaluate` for the modes). Also: retrieval and accuracy with 1k
and 10k distractor memories, false recalls on ordinary prompts, the example bank's hand-written
questions, and perplexity on ordinary text with and without the adapter. `--adapter none` gives
the untrained baseline. Prints a markdown table (and JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def perplexity(lm, text: str, window: int = 256) -> float:
    """Token perplexity of `text` (plain text, non-overlapping windows)."""
    import torch

    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[s:s + window + 1]], device=lm.device)
            logits = lm.model(input_ids=chunk[:, :-1]).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum"))
            count += chunk.shape[1] - 1
    return math.exp(total / count)


def example_bank(lm) -> dict:
    """The README's first minute: the example bank and its hand-written questions (recall first)."""
    from training.evaluate import ask, build_bank

    root = Path(__file__).resolve().parent.parent / "assets"
    facts = [ln.strip() for ln in (root / "example_memories.txt").read_text().splitlines() if ln.strip()]
    bank = build_bank(lm.model, lm.tokenizer, lm.encoder, facts)
    rows = []
    for line in (root / "example_questions.jsonl").read_text().splitlines():
        item = json.loads(line)
        text, injections = ask(lm, lm.encoder, item["question"], bank, recall_first=True, recall=True,
                               max_new_tokens=24)
        rows.append({"question": item["question"], "answer": text, "correct": item["answer"].lower() in text.lower(),
                     "memory": injections[0].text if injections else None})
    return {"accuracy": sum(r["correct"] for r in rows) / len(rows), "rows": rows}


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--facts", type=int, default=100)
    parser.add_argument("--chats", type=int, default=50)
    parser.add_argument("--distractors", default="1000,10000", help="comma-separated bank sizes to add")
    parser.add_argument("--adapter", default="auto")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()

    import torch

    from models.modeling import is_peft, set_adapter_merged
    from models import load_model
    from training.evaluate import evaluate
    from training.facts import chat_prompts, make_facts

    torch.manual_seed(0)
    lm = load_model(None, adapter=None if args.adapter == "none" else args.adapter, device="cpu")
    print(f"model: {lm.name}; memory encoder: {lm.encoder.name}", file=sys.stderr)
    t0 = time.perf_counter()
    facts = make_facts(args.facts, "eval", seed=1)
    report = evaluate(lm, lm.encoder, facts, chat_prompts(args.chats, "eval", seed=1))
    out = {"model": lm.name, "facts": args.facts, **report.rates()}
    asked = {f.questions[0] for f in facts}
    pool = [f.text for f in make_facts(max(map(int, args.distractors.split(","))) + len(facts), "eval", seed=2)
            if f.questions[0] not in asked]
    for n in map(int, args.distractors.split(",")):
        with_distractors = evaluate(lm, lm.encoder, facts, distractors=pool[:n], modes=("forced",))
        rates = with_distractors.rates()
        out[f"retrieval@1_{n}"], out[f"accuracy_forced_{n}"] = rates["retrieval@1"], rates["accuracy_forced"]
    text = (Path(__file__).resolve().parent.parent / "assets" / "general_text.txt").read_text()
    out["perplexity"] = perplexity(lm, text)
    if is_peft(lm.model):
        with lm.model.disable_adapter():  # (unmerges it)
            out["perplexity_base"] = perplexity(lm, text)
        set_adapter_merged(lm.model, True)
    example = example_bank(lm)
    out["example_bank_accuracy"] = example["accuracy"]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print("| measure | value |\n|---|---|")
    for key, value in out.items():
        print(f"| {key} | {value:.3f} |" if isinstance(value, float) else f"| {key} | {value} |")
    print("\nexample bank (recall first):")
    for row in example["rows"]:
        print(f"  {'✓' if row['correct'] else '✗'} {row['question']} -> {row['answer']!r} [memory: {row['memory']}]")
    print("\nheld-out samples (recall first):")
    for fact, outcome in list(zip(facts, report.forced))[:8]:
        print(f"  {'✓' if outcome.correct else '✗'} {fact.questions[0]} -> {outcome.text!r}")
    if args.json:
        Path(args.json).write_text(json.dumps({**out, "example_rows": example["rows"]}, indent=1))


if __name__ == "__main__":
    main()

"""Recall quality on held-out facts, through the app's own conversation path, for each value kind,
beside the anchors a user has: the stock text retriever and plain RAG with the same model.

    .venv/bin/python bench/recall_quality.py [--facts 100] [--chats 50] [--kinds tokens,chunks:2,chunks:4,mean]
                                             [--distractors 1000,10000] [--json out.json]
                                             [--backend llamacpp [--gguf-type q8_0]]

Facts, questions and entities come from the evaluation split of `training.facts`, which training
never saw (distractors: other evaluation entities). Every question is asked in a fresh
`chat.session.Conversation`, as the page asks it, greedy, 24 new tokens; an answer is right when it
contains the fact's value. Modes: `forced` (recall first, a bank of the facts alone), `natural`
(the model decides), `later` (natural, as the second turn after an ordinary prompt and its reply),
`e2e` (recall first among the facts and all distractors). Keys are the key encoder's text
embeddings whatever the value kind, so retrieval is measured once, from the keys. Anchors:
all-MiniLM-L6-v2 without the trained adapter (retrieval), the base model answering with the fact
that stock encoder retrieves among the distractors written into its user message (RAG, end to end),
and the base model with recall first reading `tokens` memories (the mode for models never trained
to recall). Also: false recalls on ordinary prompts, perplexity with and without the adapter, the
example bank's 12 hand-written questions, and what one recall costs in decode steps at 16 slots.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
ROOT = Path(__file__).resolve().parent.parent


def perplexity(lm, text: str, window: int = 256) -> float:
    """Token perplexity of `text` (plain text, non-overlapping windows)."""
    import torch

    from decoding.backend import backend_for

    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[s:s + window + 1]], device=lm.device)
            if lm.backend == "transformers":
                logits = lm.model(input_ids=chunk[:, :-1]).logits.float()
            else:  # llama.cpp gives a step's last logits: the window a token at a time
                fwd = backend_for(lm.model)
                cache = fwd.cache_for(None, chunk.shape[1], True)
                logits = torch.cat([fwd.step(fwd.embed(chunk[:, i:i + 1]), None, cache, None)[1]
                                    for i in range(chunk.shape[1] - 1)])[None]
            total += float(torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum"))
            count += chunk.shape[1] - 1
    return math.exp(total / count)


MEMORY: dict = {"top_k": 1}  # the memory head's settings for every question (`--memory`)


def ask(lm, question: str, bank, *, recall_first: bool, history: tuple[str, str] | None = None,
        max_new_tokens: int = 24) -> tuple[str, list]:
    """One question in a fresh conversation (after the earlier turn `history`), as the page asks it:
    (answer text, recall events). `max_new_tokens` counts the answer's own tokens: a memory recalled in
    the answer adds its span (`<recall>`, its slots, `</recall>`) to the budget, as the longest
    memory of `bank` would (a memory read in the user's message is in the prompt)."""
    from chat.session import Conversation
    from decoding.settings import GenerationSettings, RecallSettings

    conv = Conversation(lm)
    if history is not None:
        conv.build_inputs(history[0])
        conv.add_answer_text(history[1])
    if bank is not None and bank.has_values and lm.encoder.placement == "answer":
        max_new_tokens += room(bank)
    settings = GenerationSettings(max_new_tokens=max_new_tokens, top_k=0, repetition_penalty=1.0)
    for _ in conv.stream(question, (), settings, RecallSettings(enabled=bank is not None, **MEMORY), bank,
                         recall_first=recall_first and bank is not None):
        pass
    answer = conv.messages[-1]
    return answer.text, answer.recalls


def room(bank) -> int:
    """The longest span a memory of `bank` takes in an answer: its slots, `<recall>` and `</recall>`."""
    if id(bank) not in _ROOM:
        _ROOM[id(bank)] = (bank, max(e["slots"] for e in bank.entries(0, len(bank))) + 2)
    return _ROOM[id(bank)][1]


_ROOM: dict[int, tuple] = {}  # (the bank, kept alive so its id stays its own; its room)


def rate(outcomes: list[bool]) -> float:
    return round(float(sum(outcomes)) / len(outcomes), 3) if outcomes else float("nan")


def retrieval(encoder, questions: list[str], texts: list[str], sizes: list[int]) -> list[float]:
    """retrieval@1 of question i -> text i among the facts and the first n distractors, for each n."""
    import numpy as np

    keys, queries = encoder.encode(texts), encoder.encode(questions)
    return [rate(list(np.argmax(queries @ keys[:len(questions) + n].T, axis=1) == np.arange(len(questions))))
            for n in [0, *sizes]]


def recall_cost(lm, bank, slots: int = 16, repeats: int = 20) -> float:
    """One recall in decode steps: the memory head over `bank` plus one forward of `slots` slot positions,
    against one decode step, on the same cache (medians; the eager path). The query, the key encoder's
    embedding of the user's message, is made once a turn before decoding, as the chat does: not timed."""
    import torch

    from decoding.compiled import crop
    from decoding.backend import backend_for
    from decoding.memory import MemorySelector, Recall
    from decoding.settings import RecallSettings

    fwd = backend_for(lm.merged())
    query = torch.from_numpy(lm.encoder.keys.encode(["a question"])[0])  # once a turn, before decoding (chat.session)
    selector = MemorySelector.of(Recall(lm.tokens.recall, lm.tokens.memory_pad, bank, RecallSettings(),
                                        query=lambda h: query))
    ids = torch.arange(1000, 1060)[None]
    step, recall = [], []
    with torch.no_grad():
        for _ in range(repeats):
            cache = fwd.cache_for(None, 61, plain=False)
            fwd.prefill(fwd.embed(ids), torch.arange(60)[None], cache, None, {})
            t0 = time.perf_counter()
            fwd.step(fwd.embed(ids[:, :1]), torch.tensor([[60]]), cache, None)
            step.append(time.perf_counter() - t0)
            crop(cache, 1)
            t0 = time.perf_counter()
            selector.choose(None)
            fwd.step(fwd.embed(ids[:, :slots]), torch.arange(60, 60 + slots)[None], cache, None)
            recall.append(time.perf_counter() - t0)
    return round(statistics.median(recall) / statistics.median(step), 2)


def example_bank(lm) -> dict:
    """The README's first minute: the example bank and its hand-written questions (recall first)."""
    from models import build_bank

    facts = [ln.strip() for ln in (ROOT / "assets" / "example_memories.txt").read_text().splitlines() if ln.strip()]
    bank = build_bank(lm.model, lm.tokenizer, facts, lm.encoder, progress=False)
    rows = []
    for line in (ROOT / "assets" / "example_questions.jsonl").read_text().splitlines():
        item = json.loads(line)
        text, recalls = ask(lm, item["question"], bank, recall_first=True)
        memory = recalls[0].text if recalls else None
        rows.append({"question": item["question"], "answer": text, "memory": memory,
                     "right_memory": memory is not None and item["answer"].lower() in memory.lower(),
                     "correct": item["answer"].lower() in text.lower()})
    return {"right_memory": sum(r["right_memory"] for r in rows), "right_answer": sum(r["correct"] for r in rows),
            "questions": len(rows), "rows": rows}


def kind_rows(lm, kind: str, facts, chats, pool: list[str], replies: list[str]) -> dict:
    """The measures of one value kind: slots, bytes, forced / natural / later / end-to-end accuracy."""
    from models import build_bank

    lm.encoder = lm.encoder.with_values(kind)
    small = build_bank(lm.model, lm.tokenizer, [f.text for f in facts], lm.encoder, progress=False)
    big = build_bank(lm.model, lm.tokenizer, [f.text for f in facts] + pool, lm.encoder, progress=False)
    out = {"slots": round(sum(e["slots"] for e in small.entries(0, len(small))) / len(small), 1),
           "bytes": int(big.bytes_per_memory())}
    modes = {"forced": (small, True, None), "natural": (small, False, None), "later": (small, False, "history"),
             "e2e": (big, True, None)}
    for mode, (bank, first, history) in modes.items():
        right, recalled = [], []
        for i, fact in enumerate(facts):
            earlier = (chats[i % len(chats)], replies[i % len(chats)]) if history else None
            text, recalls = ask(lm, fact.questions[0], bank, recall_first=first, history=earlier)
            right.append(fact.value.lower() in text.lower())
            recalled.append(bool(recalls))
        out[f"accuracy_{mode}"] = rate(right)
        if mode in ("natural", "later"):
            out[f"recall_rate_{mode}"] = rate(recalled)
    return out


def anchors(out: dict, base, stock, facts, texts: list[str]) -> None:
    """Plain RAG with the base model (the stock retriever's top fact in the user message), and the base
    model never trained to recall, reading tokens memories with recall first."""
    from models import build_bank

    keys = stock.encode(texts)
    top = (stock.encode([f.questions[0] for f in facts]) @ keys.T).argmax(1)
    out["rag_e2e"] = rate([f.value.lower() in ask(base, f"{f.questions[0]}\n{texts[j]}", None,
                                                  recall_first=False)[0].lower() for f, j in zip(facts, top)])
    out["rag_oracle"] = rate([f.value.lower() in ask(base, f"{f.questions[0]}\n{f.text}", None,
                                                     recall_first=False)[0].lower() for f in facts])
    small = build_bank(base.model, base.tokenizer, [f.text for f in facts], base.encoder, progress=False)
    big = build_bank(base.model, base.tokenizer, texts, base.encoder, progress=False)
    out["untrained_forced"] = rate([f.value.lower() in ask(base, f.questions[0], small, recall_first=True)[0].lower()
                                    for f in facts])
    out["untrained_e2e"] = rate([f.value.lower() in ask(base, f.questions[0], big, recall_first=True)[0].lower()
                                 for f in facts])


def memory_settings(text: str) -> dict:
    """`key=value,...` as RecallSettings fields (YAML scalars: true, 0.9, 5), checked by RecallSettings itself."""
    import yaml

    from decoding.settings import RecallSettings

    fields = {k.strip(): yaml.safe_load(v) for k, v in (item.split("=", 1) for item in text.split(",") if item)}
    RecallSettings(**fields)  # an unknown field or a bad value stops here, before any model loads
    return fields


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--facts", type=int, default=100)
    parser.add_argument("--chats", type=int, default=50)
    parser.add_argument("--kinds", default="tokens,chunks:2,chunks:4,mean")
    parser.add_argument("--distractors", default="1000,10000", help="comma-separated bank sizes to add")
    parser.add_argument("--adapter", default="auto")
    parser.add_argument("--backend", default="transformers", help="transformers | llamacpp (the recall model's "
                        "GGUF at --gguf-type; the base model: the shipped Q4_1 GGUF)")
    parser.add_argument("--gguf-type", default="q8_0")
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--memory", default="top_k=1", help="the memory head's settings, key=value,... "
                        "(memory.autoregressive_recall; e.g. the seeds' sampled choice: "
                        "use_sampling=true,top_k=5,temperature=1.0,top_p=0.9)")
    parser.add_argument("--no-anchors", dest="anchors", action="store_false",
                        help="skip the anchors (stock retriever, RAG, the untrained model): the value kinds only")
    args = parser.parse_args()
    MEMORY.clear()
    MEMORY.update(memory_settings(args.memory))

    import torch

    from models import build_bank, LoadOptions, load_model
    from models.text_keys import TextEncoder
    from training.facts import chat_prompts, make_facts

    torch.manual_seed(0)
    t0 = time.perf_counter()
    sizes = [int(n) for n in args.distractors.split(",")]
    lm = load_model(
        None,
        LoadOptions(
            adapter=None if args.adapter == "none" else args.adapter,
            device="cpu",
            backend=args.backend,
            gguf_type=args.gguf_type,
        ),
    )
    base = load_model(None, LoadOptions(adapter=None, device="cpu", backend=args.backend))
    print(f"model: {lm.name}; keys: {lm.encoder.keys.name}", file=sys.stderr)
    facts = make_facts(args.facts, "eval", seed=1)
    asked = {f.questions[0] for f in facts}
    pool = [f.text for f in make_facts(max(sizes) + len(facts), "eval", seed=2) if f.questions[0] not in asked]
    pool = pool[:max(sizes)]
    questions, texts = [f.questions[0] for f in facts], [f.text for f in facts] + pool
    chats = chat_prompts(args.chats, "eval", seed=1)
    out: dict = {"model": lm.name, "facts": args.facts, "distractors": [0, *sizes], "memory": MEMORY}
    out["retrieval@1"] = retrieval(lm.encoder.keys, questions, texts, sizes)
    stock = TextEncoder(adapter=None)
    out["retrieval@1_minilm_stock"] = retrieval(stock, questions, texts, sizes)
    if args.anchors:
        anchors(out, base, stock, facts, texts)

    replies = [ask(lm, c, None, recall_first=False, max_new_tokens=16)[0] for c in chats]
    encoder = lm.encoder
    print({k: v for k, v in out.items()}, file=sys.stderr, flush=True)  # (what a later failure would lose)
    out["kinds"] = {}
    for kind in args.kinds.split(","):
        out["kinds"][kind] = kind_rows(lm, kind, facts, chats, pool, replies)
        print(kind, out["kinds"][kind], file=sys.stderr, flush=True)
    lm.encoder = encoder
    tokens_bank = build_bank(lm.model, lm.tokenizer, texts, lm.encoder, progress=False)
    out["false_recall_chat"] = rate([bool(ask(lm, c, tokens_bank, recall_first=False, max_new_tokens=16)[1])
                                     for c in chats])
    out["recall_cost_steps_k16"] = recall_cost(lm, tokens_bank)
    general = (ROOT / "assets" / "general_text.txt").read_text()
    out["perplexity"] = round(perplexity(lm, general), 2)
    out["perplexity_base"] = round(perplexity(base, general), 2)
    example = example_bank(lm)
    out["example_right_memory"], out["example_right_answer"] = example["right_memory"], example["right_answer"]
    out["minutes"] = round((time.perf_counter() - t0) / 60, 1)

    print("| measure | value |\n|---|---|")
    for key, value in out.items():
        if key != "kinds":
            print(f"| {key} | {value} |")
    names = list(out["kinds"])
    print("\n| value kind | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for measure in next(iter(out["kinds"].values())):
        print(f"| {measure} | " + " | ".join(str(out["kinds"][k][measure]) for k in names) + " |")
    print("\nexample bank (recall first):")
    for row in example["rows"]:
        print(f"  {'✓' if row['correct'] else '✗'} {row['question']} -> {row['answer']!r} [memory: {row['memory']}]")
    if args.json:
        Path(args.json).write_text(json.dumps({**out, "example_rows": example["rows"]}, indent=1))


if __name__ == "__main__":
    main()

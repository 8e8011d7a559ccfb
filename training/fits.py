"""The fit check of a person's question and a memory: does this memory answer what the person asks about themself?
(`models.fits.FitCheck`, shipped as `assets/memory-fits.safetensors`).

The memory head's score (cosine of the key encoder's embeddings) alone cannot tell "What's the name of my daughter?"
from the memory "Nina is the user's cousin." (0.39, over `min_score` 0.3, while right memories score as low as 0.34):
the held-out user bench read such a memory for 6 of 16 never-told questions and answered from it. This trains a
small network over the pair of embeddings the memory head already has (the message's query and the memory's key;
no other forward) to say whether the memory answers the question.

Data (`training.personal`, invented people, half the towns and pet names real): each person tells 4 things and has
memories of another relative or pet of a told kind, the same kind about someone else ("Lena lives in Porto."), a
changed value (both the old and the new answer) and 3 facts of the shared bank; they ask about every told thing,
3 things never told, a near miss of each told thing (a question in its words that it does not answer: "What colour
is my boat?" beside a favourite colour; `training.personal.NEAR_MISSES`) and ordinary requests in the first person.
A pair is right when the memory is of the kind the question asks for (the same relative or species). The `eval`
split has its own names, towns and templates.

    .venv/bin/python -m training.fits [--out assets/memory-fits.safetensors] [--people 600]

prints, on held-out people, how many told questions still read their own memory and how many never-told questions
and near misses read nothing, beside the score threshold alone (under a minute here, most of it the encoder;
`bench/reading.py` measures the chat's reading, which drops more after the check).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from models.fits import FitCheck, pair_features
from models.remember import about_the_user, mentions_the_user
from training.data import wrong_memory
from training.facts import RELATIVES, SPECIES, chat_prompts, make_facts
from training.personal import (
    KINDS, NEAR, REAL_SHARE, UPDATABLE, PeopleNames, Told, near_miss, person, told, update,
)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "assets" / "memory-fits.safetensors"
MIN_SCORE = 0.3  # `memory.autoregressive_recall.min_score` of config_qwen3vl.yaml: candidates score at least this


# more ways of telling and asking than `training.personal`'s, for training only (the eval split keeps its own, none
# of these): with the personal templates alone the check learnt their words and turned away 0.33 of held-out right
# reads (an allergy told as "I can't eat olives, I'm allergic.")
MORE_TELLS = {
    "relative": ["My {r} goes by {v}.", "I'm close to my {r} {v}.", "{v}, my {r}, is coming to stay.", "My {r} is {v}."],
    "home": ["I'm based in {v}.", "I reside in {v}.", "My address is in {v}.", "We live in {v}.", "I've settled in {v}."],
    "job": ["I'm employed as a {v}.", "By profession I'm a {v}.", "My work is as a {v}.", "I make money as a {v}."],
    "pet": ["I own a {r} called {v}.", "My {r} answers to {v}.", "We have a {r}; its name is {v}."],
    "colour": ["The colour I like most is {v}.", "I'm a fan of the colour {v}.", "{v} is the colour I prefer."],
    "allergy": ["I get sick if I eat {v}.", "{v} give me a rash, I'm allergic.", "I can't have {v}.",
                "Eating {v} makes me unwell, it's an allergy.", "My doctor says I'm allergic to {v}."],
    "sport": ["I'm into {v}.", "I train for {v}.", "I compete in {v}.", "{v} is my game."],
}
MORE_QUESTIONS = {
    "relative": ["Who is my {r}?", "Tell me my {r}'s name.", "Do you know what my {r} is called?"],
    "home": ["What town is my home?", "Where am I living?", "Remind me where I live.", "In which city do I live?"],
    "job": ["What's my job?", "What is my occupation?", "How do I earn money?", "What do I work as?"],
    "pet": ["Do you know my {r}'s name?", "What name did I give my {r}?", "Tell me my {r}'s name."],
    "colour": ["Which colour is my favourite?", "What colour do I prefer?", "Tell me my favourite colour."],
    "allergy": ["Do I have an allergy?", "Which food makes me sick?", "What foods should I avoid?",
                "What must I not eat?"],
    "sport": ["What sport am I into?", "Which game do I play?", "Do you know my sport?"],
}


def reworded(thing: Told, rng: random.Random) -> Told:
    """`thing` told in one of `MORE_TELLS` half the time, and asked in its own questions and `MORE_QUESTIONS`."""
    kind, _, r = thing.kind.partition(":")
    fill = lambda t: (t.format(v=thing.value, r=r)[:1].upper() + t.format(v=thing.value, r=r)[1:])  # noqa: E731
    tell = fill(rng.choice(MORE_TELLS[kind])) if rng.random() < 0.5 else thing.tell
    return dataclasses.replace(thing, tell=tell, questions=thing.questions + tuple(map(fill, MORE_QUESTIONS[kind])))


@dataclass
class Person:
    memories: list[str]
    kinds: list[str]  # of each memory ("" for one that answers no question of the person: a fact, someone else's)
    questions: list[str]
    asks: list[str]  # the kind each question asks for ("" for a request that asks for no memory)


def people(split: str, n: int, seed: int = 0) -> list[Person]:
    rng = random.Random(f"fits:{split}:{seed}")
    names = PeopleNames(split, rng, real=REAL_SHARE)
    facts = make_facts(3 * n, split, seed)
    requests = [p for p in chat_prompts(8 * n, split, seed) if mentions_the_user(p)]
    out = []
    for i in range(n):
        things = person(split, rng, names, 7)
        if split == "train":
            things = [reworded(t, rng) for t in things]
        kept, untold = things[:4], things[4:]
        memories = [(t.memory, t.kind) for t in kept]
        for t in kept:
            kind, _, r = t.kind.partition(":")
            if r:  # another relative or pet of the same kind
                pool = RELATIVES if kind == "relative" else SPECIES
                other = told(kind, split, rng, names, r=rng.choice([x for x in pool if x != r]))
                memories.append((other.memory, other.kind))
            if kind in UPDATABLE and rng.random() < 0.5:
                memories.append((update(t, split, rng, names).memory, t.kind))
            if rng.random() < 0.5:  # the same kind about someone else, or another kind's
                memories.append((wrong_memory(t, rng.choice([k for k in KINDS if k != kind]), rng, names, split), ""))
        memories += [(f.text, "") for f in facts[3 * i:3 * i + 3]]
        asked = [(q, t.kind) for t in kept + untold for q in rng.sample(t.questions, min(3, len(t.questions)))]
        asked += [(q, "") for q in rng.sample(requests, min(2, len(requests)))]
        asked += [(near_miss(t, split, rng), NEAR) for t in kept]
        out.append(Person([m for m, _ in memories], [k for _, k in memories], [q for q, _ in asked],
                          [k for _, k in asked]))
    return out


def embed(encoder, people_: list[Person]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(keys of every memory, the chat's query of every question), as the app makes them."""
    memories = sorted({m for p in people_ for m in p.memories})
    questions = sorted({q for p in people_ for q in p.questions})
    keys = dict(zip(memories, [torch.from_numpy(v.copy()) for v in encoder.encode(memories)]))
    about = [about_the_user(q) for q in questions]
    e = dict(zip(questions + about, [torch.from_numpy(v.copy()) for v in encoder.encode(questions + about)]))
    queries = {q: torch.nn.functional.normalize(e[q] + e[a], dim=-1) for q, a in zip(questions, about)}
    return keys, queries


def pairs(people_: list[Person], keys, queries) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (question, memory) pair of each person: features, labels, cosine."""
    q, k, y = [], [], []
    for p in people_:
        for question, asks in zip(p.questions, p.asks):
            for memory, kind in zip(p.memories, p.kinds):
                q.append(queries[question])
                k.append(keys[memory])
                y.append(float(bool(asks) and kind == asks))
    q, k = torch.stack(q), torch.stack(k)
    return pair_features(q, k), torch.tensor(y), (q * k).sum(-1)


def fit(features: torch.Tensor, labels: torch.Tensor, hidden: int, epochs: int, batch: int = 2048,
        seed: int = 0) -> FitCheck:
    """AdamW over shuffled batches of `batch` pairs, `epochs` times (full-batch steps took 15 minutes here for the same
    check a network of 64 units learns in 11 s this way)."""
    torch.manual_seed(seed)
    check = FitCheck(features.shape[1], hidden)
    opt = torch.optim.AdamW(check.net.parameters(), lr=3e-3, weight_decay=1e-2)
    weight = (labels == 0).sum() / labels.sum().clamp(min=1)  # the few right pairs weigh as much as the wrong
    order = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for rows in torch.randperm(len(labels), generator=order).split(batch):
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(check.net(features[rows]).squeeze(-1),
                                                                        labels[rows], pos_weight=weight)
            loss.backward()
            opt.step()
    return check.eval()


def reads(check: FitCheck | None, people_: list[Person], keys, queries, min_score: float = MIN_SCORE,
          drops: Callable[[str, str], bool] | None = None) -> dict:
    """As the chat reads: the best-scored memory among those over `min_score` that the check admits (all, with no
    check) and that `drops(question, memory)` does not drop (the chat's own rule: `bench/reading.py`). Told
    questions: their own memory read; never-told questions and requests: nothing read."""
    told_right = told_n = untold_none = untold_n = near_none = near_n = 0
    for p in people_:
        k = torch.stack([keys[m] for m in p.memories])
        for question, asks in zip(p.questions, p.asks):
            q = queries[question]
            scores = k @ q
            ok = scores >= min_score
            if check is not None:
                ok &= check.admits(q.expand_as(k), k)
            if drops is not None:
                ok &= torch.tensor([not drops(question, m) for m in p.memories])
            read = int(torch.where(ok, scores, torch.tensor(-2.0)).argmax()) if ok.any() else None
            if asks and asks in p.kinds:
                told_n += 1
                told_right += read is not None and p.kinds[read] == asks
            elif asks == NEAR:
                near_n += 1
                near_none += read is None
            else:
                untold_n += 1
                untold_none += read is None
    return {"told_read_right": round(told_right / told_n, 3), "untold_read_nothing": round(untold_none / untold_n, 3),
            "near_miss_read_nothing": round(near_none / max(near_n, 1), 3), "told": told_n, "untold": untold_n,
            "near_misses": near_n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--people", type=int, default=600)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--told-recall", type=float, default=0.995,
                        help="the threshold admits this share of the train split's right pairs over min_score")
    args = parser.parse_args()

    from safetensors.torch import save_file

    from models.text_keys import TextEncoder

    encoder = TextEncoder()  # the shipped key encoder: the memory head's keys and queries
    t0 = time.perf_counter()
    data = {"train": people("train", args.people), "eval": people("eval", args.people // 3)}
    emb = {s: embed(encoder, p) for s, p in data.items()}
    x, y, cos = pairs(data["train"], *emb["train"])
    embedded = time.perf_counter() - t0
    check = fit(x, y, args.hidden, args.epochs, args.batch)
    with torch.no_grad():
        p = torch.sigmoid(check.net(x).squeeze(-1))
    right = p[(y == 1) & (cos >= MIN_SCORE)].sort().values
    check.threshold = float(right[int((1 - args.told_recall) * len(right))])
    report = {"pairs": len(y), "right_pairs": int(y.sum()), "threshold": round(check.threshold, 4),
              "embed_seconds": round(embedded, 1), "seconds": round(time.perf_counter() - t0, 1),
              "key_encoder": encoder.name, "min_score": MIN_SCORE}
    for split in ("train", "eval"):
        report[split] = {"score alone": reads(None, data[split], *emb[split]),
                         "score and fit": reads(check, data[split], *emb[split])}
    check.save(args.out, encoder.name, report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

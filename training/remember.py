"""The write decision of `memory.remember: auto`: does a message tell something worth keeping about the person
(facts, preferences, plans, people), or is it a question, a request or chit-chat?

A logistic regression over the key encoder's embedding of the message, the same embedding the memory head's
query already is (so deciding costs one dot product a turn); a question (a message ending in "?") is never
written, whatever the score. Trained on invented messages of the training
templates and names (half the towns and pet names real ones: `training.personal.PeopleNames`); measured on messages
of templates and names it never saw (`eval`).

    .venv/bin/python -m training.remember [--out assets/remember-decision.safetensors] [--per-kind 400]

writes a 1.6 KB safetensors file (weights [384], bias, threshold) and prints precision and recall on held-out
messages, beside the explicit rule ("remember that ...").
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from models.remember import is_question
from training.facts import COLOURS, JOBS, RELATIVES, SPECIES, chat_prompts
from training.personal import REAL_SHARE, PeopleNames

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "assets" / "remember-decision.safetensors"

FOODS = ["peanuts", "shellfish", "gluten", "cheese", "mushrooms", "olives", "coriander", "strawberries"]
HOBBIES = ["chess", "climbing", "knitting", "jazz", "gardening", "running", "painting", "sailing", "baking"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]

# what a person tells about themselves or their world: {given} {town} {pet} {rel} {species} {job} {colour} {food}
# {hobby} {day} {n}; two disjoint sets of templates, so held-out messages are new in form as well as in names
TELLS = {
    "train": [
        "My {rel} is called {given}.", "I live in {town}.", "I work as a {job}.", "My favourite colour is {colour}.",
        "I have a {species} named {pet}.", "I'm allergic to {food}.", "I play {hobby} every {day}.",
        "We are moving to {town} next month.", "My {rel} {given} lives in {town}.", "I have {n} children.",
        "By the way, my {rel}'s name is {given}.", "I don't eat {food}.", "I started learning {hobby} last year.",
        "My {species} {pet} is {n} years old.", "I grew up in {town}.", "Just so you know, I'm a {job}.",
        "I love {hobby}, it's my favourite thing.", "My birthday is in {month}.", "I'm flying to {town} on {day}.",
        "Our {species} is called {pet}.",
    ],
    "eval": [
        "My {rel}'s name is {given}, she's great.", "I moved to {town} two years ago.", "I'm a {job} by trade.",
        "I really like the colour {colour}.", "We got a {species} last week, her name is {pet}.",
        "I can't have {food}, I'm allergic.", "Every {day} I go {hobby}.", "Next year I plan to move to {town}.",
        "{given} is my {rel}.", "I've got {n} kids.", "My job is {job}.", "I was born in {town}.",
        "I'm into {hobby} these days.", "My {species} is named {pet}.",
    ],
}
# first person, but nothing to keep; questions; requests (the chat prompts of `training.facts` come on top)
OTHERS = {
    "train": [
        "I'm fine, thanks.", "I think so too.", "I'm not sure what you mean.", "I see.", "I'd like a poem about {hobby}.",
        "What is my {rel}'s name?", "Where do I live?", "Can you help me with my homework?", "I don't know.",
        "Thanks, that helps!", "I agree with you.", "Tell me about {town}.", "What should I cook tonight?",
        "I'm bored.", "Can you recommend a book?", "Do you know my {rel}?", "What did I tell you about my {species}?",
        "I wonder why the sky is blue.", "Could you explain {hobby} to me?", "I need a name for my new {species}.",
        "Hi, how are you?", "Good morning!", "Sorry, I meant something else.", "That's funny.", "Let me think.",
    ],
    "eval": [
        "I'm good, and you?", "I guess that makes sense.", "I didn't get that.", "Okay, I understand.",
        "I want a short story about a {species}.", "What is my {species} called?", "Where do I work?",
        "Can you check my spelling?", "No idea.", "Great, thank you!", "I disagree.", "What is {town} famous for?",
        "Any ideas for dinner?", "I'm a bit tired of this.", "Do you remember my {rel}?",
        "How do I get better at {hobby}?", "Hello again!", "Hmm, let me see.",
    ],
}


def messages(split: str, per_kind: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """(messages, labels: 1 = worth keeping) of one split, balanced."""
    rng = random.Random(f"remember:{split}:{seed}")
    names = PeopleNames(split, rng, real=REAL_SHARE)  # invented and real towns and pet names, each split its own

    def fill(template: str) -> str:
        return template.format(given=names.given(), town=names.town(), pet=names.pet(), rel=rng.choice(RELATIVES),
                               species=rng.choice(SPECIES), job=rng.choice(JOBS), colour=rng.choice(COLOURS),
                               food=rng.choice(FOODS), hobby=rng.choice(HOBBIES), day=rng.choice(DAYS),
                               n=rng.randint(2, 9), month=rng.choice(["May", "June", "July", "October"]))

    tells = [fill(rng.choice(TELLS[split])) for _ in range(per_kind)]
    others = [fill(rng.choice(OTHERS[split])) for _ in range(per_kind // 2)]
    others += chat_prompts(per_kind - len(others), split, seed)
    return tells + others, [1] * len(tells) + [0] * len(others)


def train(features: torch.Tensor, labels: torch.Tensor, steps: int = 400, l2: float = 1e-3) -> tuple[torch.Tensor,
                                                                                                      torch.Tensor]:
    """Logistic regression by L-BFGS: (weights [D], bias [])."""
    torch.manual_seed(0)
    w = torch.zeros(features.shape[1], requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(features @ w + b, labels) + l2 * w.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def decided(texts: list[str], p: torch.Tensor, threshold: float) -> torch.Tensor:
    """The decision: written when the score reaches the threshold and the message is not a question."""
    return (p >= threshold) & torch.tensor([not is_question(t) for t in texts])


def scores(pred: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    tp = int((pred & (labels == 1)).sum())
    fp = int((pred & (labels == 0)).sum())
    return {"write_recall": tp / max(1, int((labels == 1).sum())), "false_writes": fp / max(1, int((labels == 0).sum())),
            "precision": tp / max(1, int(pred.sum()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--per-kind", type=int, default=400)
    args = parser.parse_args()

    from safetensors.torch import save_file

    from models.text_keys import TextEncoder

    encoder = TextEncoder()  # the shipped key encoder: the memory head's query of the message
    t0 = time.perf_counter()
    data = {split: messages(split, args.per_kind if split == "train" else args.per_kind // 2) for split in
            ("train", "eval")}
    feats = {split: torch.from_numpy(encoder.encode(texts)).float() for split, (texts, _) in data.items()}
    labels = {split: torch.tensor(y, dtype=torch.float32) for split, (_, y) in data.items()}
    w, b = train(feats["train"], labels["train"])
    # the threshold: at most 3 % of the train split's statements that are not worth keeping are written
    p_train = torch.sigmoid(feats["train"] @ w + b)
    asked = torch.tensor([not is_question(t) for t in data["train"][0]])
    negatives = p_train[(labels["train"] == 0) & asked].sort(descending=True).values
    threshold = float(negatives[int(0.03 * len(negatives))]) if len(negatives) else 0.5
    threshold = max(threshold, 0.5)
    report = {}
    for split in ("train", "eval"):
        pred = decided(data[split][0], torch.sigmoid(feats[split] @ w + b), threshold)
        report[split] = scores(pred, labels[split])
    report["threshold"] = threshold
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["key_encoder"] = encoder.name
    save_file({"weight": w.contiguous(), "bias": b.reshape(1), "threshold": torch.tensor([threshold])}, args.out,
              metadata={"key_encoder": encoder.name, "report": json.dumps(report)})
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

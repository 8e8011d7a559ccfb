"""Training examples as token ids, laid out exactly as the chat app and the generation loop see them.

A fact question (positive), its memory read through k value slots:

    <chat template: user question, generation prompt> <recall> <|memory_pad|> x k </recall> answer <|im_end|>
                                                    ^ learn to say <recall>   ^ the memory's     ^ read the
                                                                                value vectors    answer out

k is the number of value slots of the fact's memory in the example's value kind (a slot a token for
`tokens`, one for `mean`). A request to repeat a memory (autoencoding, the dense reading signal of
ICAE, Ge et al. 2024): the same layout with the fact's whole text as the answer.

An ordinary prompt (negative): the template, then the base model's own answer (learn not to recall,
and keep answering as before).

Any of them may come after an earlier turn (an ordinary prompt and the base model's answer), so that
a question in the middle of a conversation is recalled for as in its first turn.
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from training.facts import RELATIVES, SPECIES, Fact, Names, fact_stream
from training.personal import KINDS, REAL_SHARE, PeopleNames, told

IGNORE = -100
REPEAT = "Repeat what you remember."


@dataclass(frozen=True)
class Example:
    ids: list[int]
    labels: list[int]  # IGNORE where nothing is predicted
    decision: int  # the position whose label says "recall or not" (the last prompt token)
    recall_at: int | None  # position of <recall> (positives)
    fact_ids: list[int] | None  # the memory's text as tokens (positives), whose value fills the slots
    value_at: tuple[int, ...] = ()  # label positions of the answer's value tokens (what only the memory knows)
    kind: str | None = None  # the memory's value kind (positives)
    answered: bool = False  # no memory, yet its labels are learnt by cross-entropy (not from the base model)
    no_recall: bool = False  # the decision is made with <recall> and <|memory_pad|> suppressed (`NoMemory`)


History = tuple[str, Sequence[int]]  # an earlier turn: (prompt, the base model's reply ids)


def prompt_ids(tokenizer, question: str, history: History | None = None) -> list[int]:
    """The chat template with a generation prompt, tokenized as `chat.session` does; `history`, an
    earlier turn, comes first."""
    messages = [{"role": "user", "content": question}]
    if history is not None:
        reply = tokenizer.decode([t for t in history[1] if t != tokenizer.eos_token_id])
        messages = [{"role": "user", "content": history[0]}, {"role": "assistant", "content": reply}] + messages
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def answer_ids(tokenizer, answer: str) -> list[int]:
    return tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def value_tokens(tokenizer, answer: str, value: str) -> list[int]:
    """Indices of the tokens of `answer` that spell `value` (case-insensitive), by character offsets."""
    start = answer.lower().find(value.lower())
    if start < 0:
        return []
    end = start + len(value)
    offsets = tokenizer(answer, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [i for i, (a, b) in enumerate(offsets) if a < end and b > start]


def slots(kind: str, tokens: int) -> int:
    """Value slots of a memory of `tokens` tokens in value kind `kind` (tokens, chunks:N, mean)."""
    if kind == "mean":
        return 1
    size = int(kind.partition(":")[2]) if kind.startswith("chunks:") else 1
    return -(-tokens // size)


def positive(tokenizer, tokens, fact: Fact, question: str, kind: str = "tokens", repeat: bool = False,
             history: History | None = None, read: str | None = None) -> Example:
    """A fact question answered through a recall of the fact (or, with `repeat`, the fact repeated), its
    memory's value in `kind`; with `read`, the memory read is that text instead (one that does not answer the
    question: `fact.answer` then says so)."""
    prompt = prompt_ids(tokenizer, REPEAT if repeat else question, history)
    answer = answer_ids(tokenizer, fact.text if repeat else fact.answer)
    fact_ids = tokenizer(read or fact.text, add_special_tokens=False)["input_ids"]
    k = slots(kind, len(fact_ids))
    ids = prompt + [tokens.recall] + [tokens.memory_pad] * k + [tokens.recall_end] + answer
    labels = [IGNORE] * len(ids)
    p = len(prompt)
    labels[p - 1] = tokens.recall  # decide to recall
    # the slots and </recall> are forced by the loop: nothing to predict there
    start = p + k + 1  # the </recall> position predicts the first answer token
    for i, tid in enumerate(answer):
        labels[start + i] = tid  # the answer, read from the injected memory
    value = () if repeat or read else tuple(start + i for i in value_tokens(tokenizer, fact.answer, fact.value))
    return Example(ids, labels, p - 1, p, fact_ids, value, kind)


def unanswered(tokenizer, question: str, answer: str, history: History | None = None) -> Example:
    """A question recall would answer, with nothing to read (`NoMemory`: <recall> suppressed): `answer` says so."""
    ids = prompt_ids(tokenizer, question, history)
    p = len(ids)
    reply = answer_ids(tokenizer, answer)
    return Example(ids + reply, [IGNORE] * (p - 1) + reply + [IGNORE], p - 1, None, None, answered=True,
                   no_recall=True)


def negative(tokenizer, prompt: str, reply_ids: Sequence[int], history: History | None = None) -> Example:
    """An ordinary prompt answered without recall, with the base model's own reply."""
    ids = prompt_ids(tokenizer, prompt, history)
    p = len(ids)
    ids = ids + list(reply_ids)
    labels = [IGNORE] * (p - 1) + list(reply_ids) + [IGNORE]
    return Example(ids, labels, p - 1, None, None)


def _padded(rows: Sequence[Sequence[int]], pad_id: int, fill: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=1)
    ids = torch.full((len(rows), width), pad_id if fill is None else fill, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(list(r), dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] right-padded: P questions, A repeats, then negatives
    labels: torch.Tensor  # [B, S]
    decision: torch.Tensor  # [B] position of the recall-or-not decision
    value: torch.Tensor  # [B, S] True at the label positions of answer values
    memories: list[tuple[list[int], str]]  # per memory-reading row (questions, then repeats): (fact ids, value kind)
    answered: torch.Tensor  # [B] rows learnt by cross-entropy though they read no memory
    no_recall: torch.Tensor  # [B] rows whose decision is made with <recall> suppressed


def collate(questions: Sequence[Example], repeats: Sequence[Example], negatives: Sequence[Example],
            pad_id: int) -> Batch:
    """Right-pad (a causal model's real tokens never see right padding). Rows that read a memory come first
    (`questions`, `repeats`), in the order of `Batch.memories`."""
    examples = [*questions, *repeats, *negatives]
    ids, _ = _padded([e.ids for e in examples], pad_id)
    labels, _ = _padded([e.labels for e in examples], pad_id, fill=IGNORE)
    value = torch.zeros_like(labels, dtype=torch.bool)
    for row, e in enumerate(examples):
        value[row, list(e.value_at)] = True
    return Batch(ids, labels, torch.tensor([e.decision for e in examples]), value,
                 [(e.fact_ids, e.kind) for e in (*questions, *repeats)],
                 torch.tensor([e.answered for e in examples]), torch.tensor([e.no_recall for e in examples]))


@dataclass(frozen=True)
class BatchRecipe:
    """What a batch holds: `facts_per_batch` fact questions, the first `repeats_per_batch` of their facts also
    asked to be repeated whole, `chats_per_batch` ordinary prompts; a question or prompt comes after an earlier
    ordinary turn with probability `history`; each memory's value kind is drawn from `kinds` (kind, weight).
    `seed` makes the stream repeatable."""

    facts_per_batch: int
    chats_per_batch: int
    seed: int
    repeats_per_batch: int = 0
    history: float = 0.0
    kinds: Sequence[tuple[str, float]] = (("tokens", 1.0),)
    people_per_batch: int = 0  # things people told, each asked three ways: read from its memory, with another
                               # memory read (it answers "you haven't told me"), with nothing to read (the same)
    wrong_reads: bool = True  # False: not the second way (its "haven't told" spread to right memories; the shipped
                              # adapter's stage 2 is trained without it)


def batches(tokenizer, tokens, replies: dict[str, list[int]],
            recipe: BatchRecipe) -> Iterator[tuple[Batch, list[Fact]]]:
    """Endless batches as `recipe` lays them out: new training facts each time (no two asked the same way),
    the first few of them also to repeat, then ordinary prompts (answered by `replies`)."""
    rng = random.Random(f"batches:{recipe.seed}")
    stream = fact_stream("train", recipe.seed)
    prompts = sorted(replies)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    names, weights = zip(*recipe.kinds)
    while True:
        facts: list[Fact] = []
        asked: set[str] = set()
        while len(facts) < recipe.facts_per_batch:
            fact = next(stream)
            if fact.questions[0] not in asked:
                asked.add(fact.questions[0])
                facts.append(fact)

        def earlier() -> History | None:
            if rng.random() >= recipe.history:
                return None
            p = rng.choice(prompts)
            return p, replies[p]

        kind = lambda: rng.choices(names, weights)[0]  # noqa: E731
        questions = [positive(tokenizer, tokens, f, rng.choice(f.questions), kind(), history=earlier()) for f in facts]
        repeats = [positive(tokenizer, tokens, facts[i], "", kind(), repeat=True)
                   for i in range(recipe.repeats_per_batch)]
        negatives = [negative(tokenizer, p, replies[p], earlier())
                     for p in rng.sample(prompts, min(recipe.chats_per_batch, len(prompts)))]
        reads, unread = people_examples(tokenizer, tokens, recipe.people_per_batch, rng, earlier, recipe.wrong_reads)
        yield collate(questions + reads, repeats, unread + negatives, pad), facts


def wrong_memory(thing, other: str, rng: random.Random, names: Names, split: str = "train") -> str:
    """A memory of the person that does not answer `thing`'s questions: another relative's or pet's of the same kind
    ("Agnes is the user's uncle." for a question about a grandmother), another kind's, or the same kind's about
    someone else ("Lena lives in Porto.")."""
    kind, _, r = thing.kind.partition(":")
    roll = rng.random()
    if r and roll < 0.5:
        pool = RELATIVES if kind == "relative" else SPECIES
        return told(kind, split, rng, names, r=rng.choice([x for x in pool if x != r])).memory
    if roll < 0.7:
        return told(other, split, rng, names).memory
    return re.sub(r"\b[Tt]he user\b", names.given(), told(kind, split, rng, names, avoid=thing.value).memory)


def people_examples(tokenizer, tokens, n: int, rng: random.Random, earlier,
                    wrong_reads: bool = True) -> tuple[list[Example], list[Example]]:
    """`n` things people told (`training.personal`, training split), each asked three ways: (reading a memory:
    its own, then another one that does not answer it; with nothing to read), and one more thing of its kind read
    from its own memory (as many answers read as "you haven't told me": with one, a trained model said so over
    right memories too)."""
    names = PeopleNames("train", rng, real=REAL_SHARE)
    reads, unread = [], []
    for _ in range(n):
        kind, other = rng.sample(KINDS, 2)
        thing = told(kind, "train", rng, names)
        question = rng.choice(thing.questions)
        as_fact = Fact(thing.memory, thing.questions, thing.answer, thing.value, thing.kind)
        wrong = wrong_memory(thing, other, rng, names)
        reads.append(positive(tokenizer, tokens, as_fact, question, history=earlier()))
        again = told(kind, "train", rng, names)
        reads.append(positive(tokenizer, tokens, Fact(again.memory, again.questions, again.answer, again.value,
                                                      again.kind), rng.choice(again.questions), history=earlier()))
        if wrong_reads:
            reads.append(positive(tokenizer, tokens, dataclasses.replace(as_fact, answer=thing.missing), question,
                                  history=earlier(), read=wrong))
        unread.append(unanswered(tokenizer, question, thing.missing, earlier()))
    return reads, unread

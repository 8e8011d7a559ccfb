"""Recall quality on held-out facts, through the real generation loop (what a user of the app gets).

Every question is asked in a fresh conversation (the chat template, as the app builds it), against
a bank written by the model's memory encoder from the facts' texts (plus distractors). Modes:
  forced    the answer starts with <recall> (the app's "recall first")
  natural   the model decides itself whether to recall
  disabled  recall switched off: what the model says without its memories
  later     like natural, but asked in a second turn, after one of the ordinary prompts and the
            model's own reply to it
An answer is correct when it contains the fact's value (case-insensitive).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from decoding.loop import generate
from decoding.memory import Recall
from decoding.settings import GenerationSettings, RecallSettings
from memory.bank import MemoryVectorDB
from training.data import prompt_ids
from training.facts import Fact


@dataclass
class Outcome:
    recalled: bool
    retrieved: bool  # the first recall injected this fact's own memory
    correct: bool
    text: str


@dataclass
class Report:
    forced: list[Outcome] = field(default_factory=list)
    natural: list[Outcome] = field(default_factory=list)
    disabled: list[Outcome] = field(default_factory=list)
    later: list[Outcome] = field(default_factory=list)
    chat: list[Outcome] = field(default_factory=list)

    def rates(self) -> dict[str, float]:
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        return {
            "retrieval@1": mean([o.retrieved for o in self.forced]),
            "accuracy_forced": mean([o.correct for o in self.forced]),
            "natural_recall": mean([o.recalled for o in self.natural]),
            "accuracy_natural": mean([o.correct for o in self.natural]),
            "accuracy_disabled": mean([o.correct for o in self.disabled]),
            "natural_recall_later": mean([o.recalled for o in self.later]),
            "accuracy_later": mean([o.correct for o in self.later]),
            "false_recall_chat": mean([o.recalled for o in self.chat]),
        }


def build_bank(model, tokenizer, encoder, texts: Sequence[str], batch_size: int = 32) -> MemoryVectorDB:
    vectors = encoder.encode_texts(model, tokenizer, list(texts), batch_size=batch_size, progress=False)
    db = MemoryVectorDB(vectors.shape[1])
    db.add(vectors, list(texts))
    return db


def ask(lm, encoder, question: str, bank: MemoryVectorDB | None, *, recall_first: bool, recall: bool,
        max_new_tokens: int, history: tuple[str, str] | None = None) -> tuple[str, list]:
    """One question in a fresh conversation, or after the earlier turn `history` (prompt, reply text);
    (answer text, injections)."""
    earlier = None if history is None else (history[0], lm.tokenizer(history[1], add_special_tokens=False)["input_ids"])
    ids = prompt_ids(lm.tokenizer, question, earlier) + ([lm.tokens.recall] if recall_first else [])
    settings = GenerationSettings(max_new_tokens=max_new_tokens, top_k=0)
    memory = Recall(lm.tokens.recall, lm.tokens.memory_pad, bank if recall else None,
                    RecallSettings(enabled=recall, top_k=1), encoder.embedding)
    result = generate(lm.model, {"input_ids": torch.tensor([ids])}, settings, recall=memory, tokenizer=lm.tokenizer,
                      eos_token_id=lm.tokenizer.eos_token_id, pad_token_id=lm.tokenizer.pad_token_id)
    text = lm.tokenizer.decode(result.new_tokens[0], skip_special_tokens=True)
    return text, result.injections


def evaluate(lm, encoder, facts: Sequence[Fact], chats: Sequence[str] = (), distractors: Sequence[str] = (),
             modes: Sequence[str] = ("forced", "natural", "disabled", "later"), max_new_tokens: int = 24,
             question: int = 0) -> Report:
    """Ask each fact's `question`-th paraphrase in each mode; `chats` are asked naturally (false recalls)."""
    with torch.no_grad():
        bank = build_bank(lm.model, lm.tokenizer, encoder, [f.text for f in facts] + list(distractors))
    report = Report()
    for prompt in chats:
        text, injections = ask(lm, encoder, prompt, bank, recall_first=False, recall=True, max_new_tokens=16)
        report.chat.append(Outcome(bool(injections), False, False, text))
    if "later" in modes and not chats:
        raise ValueError("mode 'later' asks after an ordinary turn: give `chats`")
    for i, fact in enumerate(facts):
        q = fact.questions[question % len(fact.questions)]
        for mode in modes:
            history = (chats[i % len(chats)], report.chat[i % len(chats)].text) if mode == "later" else None
            text, injections = ask(lm, encoder, q, bank, recall_first=mode == "forced", recall=mode != "disabled",
                                   max_new_tokens=max_new_tokens, history=history)
            getattr(report, mode).append(Outcome(
                recalled=bool(injections), retrieved=bool(injections) and injections[0].memory_index == i,
                correct=fact.value.lower() in text.lower(), text=text))
    return report

"""The synthetic facts: disjoint splits, determinism, answers that hold their values."""

from __future__ import annotations

import re

import pytest

from training.facts import RELATIONS, Names, chat_prompts, fact_stream, make_facts, split_of


def entities(fact) -> set[str]:
    """Capitalised words of a fact that are not sentence starts of the templates (names, towns)."""
    return {w for w in re.findall(r"\b[A-Z][a-z]+\b", fact.text)} - {"The", "My", "In", "By", "Every", "Port",
                                                                    "Upper", "North", "Old", "Saint", "I"}


def test_evaluation_entities_never_appear_in_training():
    train = make_facts(3000, "train", 0)
    held_out = make_facts(1000, "eval", 1)
    seen = set().union(*(entities(f) for f in train))
    leaked = [f.text for f in held_out if entities(f) & seen - {"January", "February", "March", "April", "May",
                                                                  "June", "July", "August", "September", "October",
                                                                  "November", "December", "Monday", "Tuesday",
                                                                  "Wednesday", "Thursday", "Friday", "Saturday",
                                                                  "Sunday"}]
    assert leaked == []


def test_names_come_from_their_split():
    import random

    for split in ("train", "eval"):
        names = Names(split, random.Random(0))
        drawn = [names.person() for _ in range(200)] + [names.town() for _ in range(200)]
        assert all(split_of(part) == split for name in drawn for part in name.split()[-1:])
    with pytest.raises(ValueError, match="split is 'test'"):
        Names("test", random.Random(0))


def test_facts_are_deterministic_unique_and_answers_hold_the_value():
    a, b = make_facts(500, "train", 3), make_facts(500, "train", 3)
    assert a == b and a != make_facts(500, "train", 4)
    assert len({f.questions[0] for f in a}) == 500
    assert {f.relation for f in a} == set(RELATIONS)
    for f in a:
        assert f.value.lower() in f.answer.lower() and f.value.lower() in f.text.lower()
        assert len(f.questions) >= 2 and all(q.endswith("?") for q in f.questions)


def test_the_stream_is_endless_and_the_chat_prompts_split_by_template():
    stream = fact_stream("train", 0)
    assert len([next(stream) for _ in range(5000)]) == 5000
    train, held_out = chat_prompts(300, "train", 0), chat_prompts(60, "eval", 0)
    assert len(set(train)) == 300 and not set(train) & set(held_out)
    assert all("?" in p or p.endswith((".", "!")) for p in train + held_out)

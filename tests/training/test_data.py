"""Training examples laid out as the app and the loop see them."""

from __future__ import annotations

import random
import re

import pytest
import torch

from training.data import IGNORE, REPEAT, BatchRecipe, batches, negative, positive, prompt_ids, slots, wrong_memory
from training.facts import GENERAL_QUESTIONS, RELATIVES, SPECIES, Names, general_questions, make_facts
from training.personal import KINDS, told


@pytest.mark.parametrize("kind", ["tokens", "chunks:4", "mean"])
def test_a_positive_learns_to_recall_then_reads_the_answer(tiny_llama, kind):
    lm = tiny_llama
    tok, tokens = lm.tokenizer, lm.tokens
    fact = make_facts(1, "train", 0)[0]
    e = positive(tok, tokens, fact, fact.questions[1], kind)
    prompt = prompt_ids(tok, fact.questions[1])
    k = slots(kind, len(e.fact_ids))
    assert k == {"tokens": len(e.fact_ids), "chunks:4": -(-len(e.fact_ids) // 4), "mean": 1}[kind]
    p = len(prompt)
    assert e.ids[:p] == prompt and e.ids[p:p + k + 2] == [tokens.recall] + [tokens.memory_pad] * k + [tokens.recall_end]
    assert tok.decode(e.ids[p + k + 2:], skip_special_tokens=True) == fact.answer
    assert e.ids[-1] == tok.eos_token_id and e.kind == kind
    assert e.decision == p - 1 and e.labels[e.decision] == tokens.recall
    assert e.recall_at == p and all(label == IGNORE for label in e.labels[p:p + k + 1])  # the loop forces these
    assert e.labels[p + k + 1:-1] == e.ids[p + k + 2:]  # from </recall> on each position predicts the next token
    assert all(label == IGNORE for label in e.labels[:e.decision])
    assert tok.decode(e.fact_ids) == fact.text
    assert [tok.decode([e.labels[i]]).strip() for i in e.value_at] and \
        fact.value.lower().startswith(tok.decode([e.labels[e.value_at[0]]]).strip().lower())
    # the chat template is the one the app uses: the prompt ends with the generation prompt
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
    repeat = positive(tok, tokens, fact, "", kind, repeat=True)
    assert tok.decode(repeat.ids[repeat.recall_at + k + 2:], skip_special_tokens=True) == fact.text
    assert REPEAT in tok.decode(repeat.ids)


def test_a_negative_answers_without_recall(tiny_llama):
    tok = tiny_llama.tokenizer
    reply = tok("Paris is the capital.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    e = negative(tok, "What is the capital of France?", reply)
    assert e.recall_at is None and e.fact_ids is None
    assert e.labels[e.decision] == reply[0] and e.labels[e.decision:-1] == reply and e.labels[-1] == IGNORE


def test_batches_put_questions_repeats_then_negatives(tiny_llama):
    lm = tiny_llama
    tok = lm.tokenizer
    replies = {p: tok(p.upper(), add_special_tokens=False)["input_ids"] for p in ("Hi!", "Thanks.", "Why?")}
    kinds = [("tokens", 1.0), ("mean", 1.0)]
    batch, facts = next(batches(tok, lm.tokens, replies, BatchRecipe(4, 2, seed=0, repeats_per_batch=1, kinds=kinds)))
    assert batch.input_ids.shape[0] == 4 + 1 + 2 == len(batch.decision)
    assert len(batch.memories) == 5  # the four questions', then the repeat's (of the first fact)
    assert [tok.decode(ids) for ids, _ in batch.memories] == [f.text for f in facts] + [facts[0].text]
    assert {kind for _, kind in batch.memories} <= {"tokens", "mean"}
    assert (batch.input_ids == lm.tokens.memory_pad).sum() == sum(slots(k, len(i)) for i, k in batch.memories)
    for row in range(5):
        assert (batch.input_ids[row] == lm.tokens.recall).sum() == 1 and (batch.input_ids[row] == lm.tokens.recall_end).sum() == 1
    assert (batch.input_ids[5:] == lm.tokens.memory_pad).sum() == 0
    assert len({f.questions[0] for f in facts}) == 4
    again, _ = next(batches(tok, lm.tokens, replies, BatchRecipe(4, 2, seed=0, repeats_per_batch=1, kinds=kinds)))
    assert torch.equal(again.input_ids, batch.input_ids)  # seeded


def test_questions_and_prompts_can_follow_an_earlier_turn(tiny_llama):
    lm = tiny_llama
    tok, tokens = lm.tokenizer, lm.tokens
    fact = make_facts(1, "train", 0)[0]
    reply = tok("It is sunny.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    e = positive(tok, tokens, fact, fact.questions[0], history=("How is the weather?", reply))
    text = tok.decode(e.ids[:e.decision + 1])
    assert text.count("<|im_start|>user") == 2 and text.index("How is the weather?") < text.index(fact.questions[0])
    assert "It is sunny." in text and e.labels[e.decision] == tokens.recall  # recall comes in the second turn
    assert all(label == IGNORE for label in e.labels[:e.decision])  # the earlier turn is context, not a target
    n = negative(tok, "Why?", reply, history=("How is the weather?", reply))
    assert tok.decode(n.ids).count("<|im_start|>user") == 2 and n.labels[n.decision] == reply[0]
    replies = {p: tok(p.upper(), add_special_tokens=False)["input_ids"] for p in ("Hi!", "Thanks.", "Why?")}
    every, _ = next(batches(tok, tokens, replies, BatchRecipe(4, 2, seed=0, history=1.0)))
    never, _ = next(batches(tok, tokens, replies, BatchRecipe(4, 2, seed=0, history=0.0)))
    for batch, turns in ((every, 2), (never, 1)):
        for row in range(batch.input_ids.shape[0]):
            assert tok.decode(batch.input_ids[row, :int(batch.decision[row]) + 1]).count("<|im_start|>user") == turns


def test_a_told_thing_is_asked_three_ways(tiny_llama):
    """A person's thing: read from its own memory (the answer), from another memory (it was not told), and with
    nothing to read (`NoMemory`: the decision is made without <recall>; the answer says it was not told)."""
    lm = tiny_llama
    tok = lm.tokenizer
    replies = {p: tok(p.upper(), add_special_tokens=False)["input_ids"] for p in ("Hi!", "Thanks.")}
    batch, facts = next(batches(tok, lm.tokens, replies, BatchRecipe(1, 2, seed=0, people_per_batch=2)))
    assert batch.input_ids.shape[0] == 1 + 2 * 3 + 2 + 2  # a fact, three reads of two things, two unread, two chats
    assert len(batch.memories) == 1 + 6  # the fact's memory, then each thing's own, one more of its kind, another
    own, again, other = (tok.decode(ids) for ids, _ in batch.memories[1:4])
    assert "the user" in own.lower() and "the user" in again.lower()
    assert len({own, again, other}) == 3
    text = lambda row: tok.decode(batch.input_ids[row], skip_special_tokens=True)  # noqa: E731
    answer = lambda row: tok.decode([t for t in batch.labels[row].tolist() if t != IGNORE], skip_special_tokens=True)  # noqa: E731
    for row in (1, 2):  # read from its own memory
        assert answer(row).startswith("Your") or answer(row).startswith("You ")
        assert "haven't told me" not in answer(row)
    assert "haven't told me" in answer(3)  # another memory read: it does not answer the question
    unread = 7  # the first row after the memory rows and the repeat-less questions
    assert batch.answered.tolist() == [False] * 7 + [True, True, False, False]
    assert batch.no_recall.tolist() == batch.answered.tolist()
    assert "haven't told me" in answer(unread) and (batch.input_ids[unread] == lm.tokens.recall).sum() == 0
    assert batch.labels[unread, batch.decision[unread]] != lm.tokens.recall
    assert "?" in text(unread)


def test_a_wrong_memory_never_answers_the_question_and_covers_another_relative():
    """The memories read when a thing was not told: another relative's or pet's ("Agnes is the user's uncle." for a
    grandmother: what the held-out bench read most often), another kind's, or the same kind's of someone else."""
    rng = random.Random(3)
    names = Names("train", rng)
    seen = {"relative": 0, "kind": 0, "someone": 0}
    for _ in range(200):
        kind, other = rng.sample(KINDS, 2)
        thing = told(kind, "train", rng, names)
        wrong = wrong_memory(thing, other, rng, names)
        assert wrong != thing.memory and thing.value not in wrong
        base, _, r = thing.kind.partition(":")
        if "the user" not in wrong.lower():
            seen["someone"] += 1
        elif r and re.search(rf"\b(?:{'|'.join(RELATIVES if base == 'relative' else SPECIES)})\b", wrong) \
                and not re.search(rf"\b{r}\b", wrong):
            seen["relative"] += 1
        else:
            seen["kind"] += 1
    assert min(seen.values()) >= 20, seen


def test_general_questions_are_for_training_only():
    from bench._users import GENERAL

    assert len(general_questions(len(GENERAL_QUESTIONS))) == len(GENERAL_QUESTIONS) and general_questions(0) == []
    assert not {q for q, _ in GENERAL} & set(GENERAL_QUESTIONS)  # the held-out bench asks others
    with pytest.raises(ValueError, match="general_questions is 99"):
        general_questions(99)


def test_people_tell_real_towns_and_pet_names_of_their_split_as_often_as_asked():
    """A retrain on invented towns alone said "You haven't told me where you live." over every real town's memory;
    people's training data tells real ones half the time, each split its own, and with none asked for the draws are
    exactly the invented names' (the bench's users stay those of every table so far)."""
    from training.facts import split_of
    from training.personal import REAL_PETS, REAL_TOWNS, PeopleNames

    invented, plain = PeopleNames("eval", random.Random(3)), Names("eval", random.Random(3))
    assert [invented.town() for _ in range(20)] == [plain.town() for _ in range(20)]
    assert [invented.pet() for _ in range(20)] == [plain.pet() for _ in range(20)]
    for split in ("train", "eval"):
        real = PeopleNames(split, random.Random(0), real=1.0)
        towns, pets = {real.town() for _ in range(300)}, {real.pet() for _ in range(300)}
        assert towns <= set(REAL_TOWNS) and pets <= set(REAL_PETS) and len(towns) >= 8
        assert {split_of(t) for t in towns | pets} == {split}
    half = PeopleNames("train", random.Random(0), real=0.5)
    share = sum(half.town() in REAL_TOWNS for _ in range(400)) / 400
    assert 0.4 < share < 0.6


def test_training_people_live_in_real_towns_too(tiny_llama):
    from training.data import people_examples
    from training.personal import REAL_TOWNS

    tok = tiny_llama.tokenizer
    reads, _ = people_examples(tok, tiny_llama.tokens, 60, random.Random(0), lambda: None)
    memories = [tok.decode(ex.fact_ids) for ex in reads if ex.fact_ids]
    lived_in = [m for m in memories if "lives in" in m or "home is in" in m or "house is in" in m]
    real = [m for m in lived_in if any(t in m for t in REAL_TOWNS)]
    assert lived_in and 0.2 <= len(real) / len(lived_in) <= 0.8, lived_in


def test_without_wrong_reads_a_told_thing_is_read_only_from_its_own_memories(tiny_llama):
    tok = tiny_llama.tokenizer
    replies = {p: tok(p.upper(), add_special_tokens=False)["input_ids"] for p in ("Hi!", "Thanks.")}
    recipe = BatchRecipe(1, 2, seed=0, people_per_batch=2, wrong_reads=False)
    batch, _ = next(batches(tok, tiny_llama.tokens, replies, recipe))
    assert batch.input_ids.shape[0] == 1 + 2 * 2 + 2 + 2  # a fact, two reads of two things, two unread, two chats
    answers = [tok.decode([t for t in batch.labels[row].tolist() if t != IGNORE], skip_special_tokens=True)
               for row in range(1, 5)]
    assert not any("haven't told me" in a for a in answers), answers  # every memory read answers its question

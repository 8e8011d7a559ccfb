"""Training examples laid out as the app and the loop see them."""

from __future__ import annotations

import torch

from training.data import IGNORE, REPEAT, batches, negative, positive, prompt_ids
from training.facts import make_facts


def test_a_positive_learns_to_recall_then_reads_the_answer(tiny_llama):
    lm = tiny_llama
    tok, tokens = lm.tokenizer, lm.tokens
    fact = make_facts(1, "train", 0)[0]
    e = positive(tok, tokens, fact, fact.questions[1])
    prompt = prompt_ids(tok, fact.questions[1])
    assert e.ids[:len(prompt)] == prompt and e.ids[len(prompt):len(prompt) + 2] == [tokens.recall, tokens.memory_pad]
    assert tok.decode(e.ids[len(prompt) + 2:], skip_special_tokens=True) == fact.answer
    assert e.ids[-1] == tok.eos_token_id
    assert e.decision == len(prompt) - 1 and e.labels[e.decision] == tokens.recall
    assert e.recall_at == len(prompt) and e.labels[e.recall_at] == IGNORE  # the loop forces <|memory_pad|>
    assert e.labels[e.recall_at + 1:-1] == e.ids[e.recall_at + 2:]  # each position predicts the next token
    assert all(label == IGNORE for label in e.labels[:e.decision])
    assert tok.decode(e.fact_ids) == fact.text
    # the chat template is the one the app uses: the prompt ends with the generation prompt
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
    repeat = positive(tok, tokens, fact, "", repeat=True)
    assert tok.decode(repeat.ids[repeat.recall_at + 2:], skip_special_tokens=True) == fact.text
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
    batch, facts = next(batches(tok, lm.tokens, replies, 4, 2, seed=0, repeats_per_batch=1))
    assert batch.input_ids.shape[0] == 4 + 1 + 2 == len(batch.decision)
    assert batch.recall_rows.tolist() == [0, 1, 2, 3] and batch.memory_rows.tolist() == [0, 1, 2, 3, 4]
    assert batch.memory_of.tolist() == [0, 1, 2, 3, 0]  # the repeat reads the first fact's memory
    assert (batch.input_ids == lm.tokens.memory_pad).sum() == 5
    assert batch.fact_ids.shape[0] == 4 and batch.question_ids.shape[0] == 4
    for row, fact in enumerate(facts):
        n = int(batch.fact_mask[row].sum())
        assert tok.decode(batch.fact_ids[row, :n]) == fact.text
        assert int(batch.input_ids[row, batch.recall_at[row]]) == lm.tokens.recall
    assert len({f.questions[0] for f in facts}) == 4
    again, _ = next(batches(tok, lm.tokens, replies, 4, 2, seed=0, repeats_per_batch=1))
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
    every, _ = next(batches(tok, tokens, replies, 4, 2, seed=0, history=1.0))
    never, _ = next(batches(tok, tokens, replies, 4, 2, seed=0, history=0.0))
    for batch, turns in ((every, 2), (never, 1)):
        for row in range(batch.input_ids.shape[0]):
            assert tok.decode(batch.input_ids[row, :int(batch.decision[row]) + 1]).count("<|im_start|>user") == turns

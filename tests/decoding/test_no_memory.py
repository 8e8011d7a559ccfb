"""`NoMemory`: with nothing to read, `<recall>` and `<|memory_pad|>` are never chosen, and a row that wanted a memory
does not end its answer before it starts (its second choice after `<recall>` was often the end: an empty answer)."""

from __future__ import annotations

import torch

from decoding.memory import NoMemory, Recall

RECALL, PAD, EOS, WORD = 5, 6, 2, 9


def scores(*firsts: int) -> torch.Tensor:
    """Logits of rows whose first choice is `firsts[i]`, then the end, then WORD."""
    out = torch.zeros(len(firsts), 12)
    for row, first in enumerate(firsts):
        out[row, EOS], out[row, WORD] = 2.0, 1.0
        out[row, first] = 3.0
    return out


def test_a_row_that_wanted_a_memory_answers_something_first():
    recall = Recall(RECALL, PAD, without_memory="answer")
    processor = NoMemory.of(recall, recall_on=False, start=4, eos=[EOS])
    prompt = torch.zeros(2, 4, dtype=torch.long)
    out = processor(prompt, scores(RECALL, WORD))
    assert out[0].argmax() == WORD and out[0, EOS] == -float("inf")  # not <recall>, not the end: a word
    assert out[1].argmax() == WORD and out[1, EOS] == 2.0  # it did not want a memory: untouched
    assert torch.isinf(out[:, [RECALL, PAD]]).all()
    later = processor(torch.zeros(2, 5, dtype=torch.long), scores(RECALL, RECALL))
    assert later[0].argmax() == EOS and later[1].argmax() == EOS  # past the first token, the end is the end
    assert processor.rows(2) == [True, True]  # each wanted a memory at some step


def test_no_processor_while_recall_is_on_or_in_token_mode():
    assert NoMemory.of(Recall(RECALL, PAD, without_memory="answer"), recall_on=True) is None
    assert NoMemory.of(Recall(RECALL, PAD), recall_on=False) is None

"""The llama.cpp draft (decoding/gguf_draft.py) on the real Q4_1 SmolLM2 GGUF, through the llama.cpp layer the
backend runs on (`models.llamacpp.LlamaCppModel`): its sequence follows the one it is asked about, ids it lacks
are fed as the mean token row and never drafted, and its distributions are llama.cpp's own."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper

from decoding.gguf_draft import GGUFDraft
from models.gguf import load_gguf_draft


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def llm(tok):
    return load_gguf_draft(None, tok, n_ctx=256)


def fresh_probs(llm, ids, temperature=1.0):
    """llama.cpp's next-token distribution after `ids`, evaluated on a sequence of its own: [n_vocab]."""
    _, logits = llm.run([(llm.new_cache(), llm.embed_tokens(torch.tensor(ids)))], want_state=False)
    return torch.softmax(logits[0, :llm.n_vocab] / temperature, -1)


def test_a_proposal_after_another_sequence_equals_a_fresh_evaluation(llm, tok):
    """The draft keeps only the common prefix of its sequence: after drafting on one sequence (and its own
    drafts), a diverging sequence's first distribution is what an empty sequence gives."""
    vocab = len(tok) + 3
    draft = GGUFDraft(llm, vocab)
    a = tok("The sea, the sea, the sea is").input_ids
    b = a[:3] + tok(" mountains are tall and").input_ids
    tokens, d = draft.propose(a, 3, processors=None, do_sample=False)
    assert len(tokens) == 3 and d.shape == (3, vocab) and (d[:, llm.n_vocab:] == 0).all()
    warp = LogitsProcessorList([TemperatureLogitsWarper(0.7)])
    _, d_b = draft.propose(b, 2, processors=warp, do_sample=True, generator=torch.Generator().manual_seed(0))
    _, d_a = draft.propose(a + tokens[:1], 1, processors=None, do_sample=False)  # back on a, one draft kept
    assert torch.allclose(d_b[0, :llm.n_vocab], fresh_probs(llm, b, 0.7), atol=2e-3)
    assert torch.allclose(d_a[0, :llm.n_vocab], fresh_probs(llm, a + tokens[:1]), atol=2e-3)
    assert torch.allclose(d_a[0], d[1], atol=2e-3)  # the same position drafted twice
    assert not torch.allclose(d_b[0, :llm.n_vocab], fresh_probs(llm, a), atol=0.05)  # (the check can fail)


def test_ids_the_gguf_lacks_are_fed_as_the_mean_row_and_never_drafted(llm, tok):
    """A <|memory_pad|> added past the GGUF's vocabulary reads as the mean of its token rows; greedy drafts are
    llama.cpp's argmax, and the ids it lacks have probability 0."""
    draft = GGUFDraft(llm, len(tok) + 3)
    memory_pad = llm.n_vocab + 2
    assert torch.equal(llm.embed_tokens.weight[memory_pad], llm.embed_tokens.weight[:llm.n_vocab].mean(0))
    ids = tok("I remember").input_ids
    tokens, d = draft.propose(ids + [memory_pad], 2, processors=None, do_sample=False)
    read = fresh_probs(llm, ids + [memory_pad])
    assert tokens[0] == int(read.argmax()) and torch.allclose(d[0, :llm.n_vocab], read, atol=2e-3)
    assert tokens[1] == int(fresh_probs(llm, ids + [memory_pad, tokens[0]]).argmax())
    assert (d[:, llm.n_vocab:] == 0).all()


def test_a_sequence_the_draft_already_holds_is_evaluated_again_at_its_last_token(llm, tok):
    """Asked about a prefix of what llama.cpp holds (a rejected round, a regenerate), the draft still
    evaluates the last token, so its distribution is never a stale one."""
    draft = GGUFDraft(llm, len(tok))
    a = tok("The sea, the sea").input_ids
    draft.propose(a, 3, processors=None, do_sample=False)  # the sequence: a and two drafts
    _, d = draft.propose(a, 1, processors=None, do_sample=False)
    assert torch.allclose(d[0, :llm.n_vocab], fresh_probs(llm, a), atol=2e-3)


@pytest.mark.parametrize("n_ctx", [256, 300])  # llama.cpp may round a context up: the draft holds what it got
def test_drafts_stop_exactly_at_the_draft_context(tok, n_ctx):
    """The sequence and γ - 1 drafts must fit: one token more and the round draws from q* directly."""
    draft = GGUFDraft(load_gguf_draft(None, tok, n_ctx=n_ctx), len(tok))
    assert draft.context >= n_ctx
    fits = [1] * (draft.context - 3)  # the sequence and the first 3 of 4 drafts (the last is not fed)
    assert len(draft.propose(fits, 4, processors=None, do_sample=False)[0]) == 4
    assert draft.propose(fits + [1], 4, processors=None, do_sample=False) == ([], None)


def test_a_draft_wider_than_the_models_is_refused(llm):
    with pytest.raises(ValueError, match="49152 tokens but the models have 100"):
        GGUFDraft(llm, 100)


def test_each_answer_starts_from_an_empty_sequence(llm, tok):
    """llama.cpp's numbers for a position differ a little between a batch and one-token evaluations (the
    drafts): a new draft (one per answer) evaluates its whole sequence afresh, so an answer that builds on
    an earlier one's drafted tokens gets what llama.cpp gives from nothing (a seeded answer repeats)."""
    a = tok("The sea, the sea, the sea is very deep and the lighthouse").input_ids
    drafted, _ = GGUFDraft(llm, len(tok)).propose(a, 5, processors=None, do_sample=False)  # an earlier answer
    draft = GGUFDraft(llm, len(tok))
    assert draft.fed == [] and draft.cache.get_seq_length() == 0
    _, d = draft.propose(a + drafted[:4], 1, processors=None, do_sample=False)
    assert torch.equal(d[0, :llm.n_vocab], fresh_probs(llm, a + drafted[:4]))

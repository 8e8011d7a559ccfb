"""Prompts read together (`decoding/prompt_reads.py`): one forward of several answers' chunks, each with its own
cached positions, gives every answer the cache and the last state it would have read alone."""

from __future__ import annotations

import pytest
import torch

from decoding.forward import Forward
from decoding.prompt_reads import PromptReader, PromptTurn


def alone(fwd: Forward, ids: torch.Tensor, past: int) -> tuple:
    """Read `ids` [1, L] alone: its first `past` positions, then the rest (the chunk); (cache, the chunk's turn)."""
    embeds = fwd.embed(ids)
    cache = fwd.new_cache()
    if past:
        fwd.prefill(embeds[:, :past], torch.arange(past)[None], cache, None, {})
    return cache, PromptTurn(None, fwd, embeds[:, past:], torch.arange(past, ids.shape[1])[None], cache)


@pytest.mark.parametrize("pasts", [(0, 0, 0), (5, 0, 12)], ids=["new", "with-pasts"])
def test_chunks_read_together_are_each_as_read_alone(tiny_llama, pasts):
    """Three chunks of 7, 2 and 11 positions after 0-12 cached ones, in one forward: each answer's cache (every
    layer's keys and values, its own positions only) and its chunk's last state equal a read alone."""
    fwd, g = Forward(tiny_llama.model), torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 1000, (1, p + n), generator=g) for p, n in zip(pasts, (7, 2, 11))]
    together = [alone(fwd, ids, p)[1] for ids, p in zip(prompts, pasts)]
    reader = PromptReader()
    for t in together:
        t.runner = reader
    with torch.no_grad():
        reader.run(together)
        for t, ids, p in zip(together, prompts, pasts):
            cache, turn = alone(fwd, ids, p)
            want, _ = fwd.prefill(turn.embeds, turn.positions, cache, None, {})
            torch.testing.assert_close(t.hidden, want, atol=1e-5, rtol=1e-5)
            assert t.cache.get_seq_length() == ids.shape[1]
            for mine, ref in zip(t.cache.layers, cache.layers):
                torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-5)
    assert (reader.forwards, reader.turns) == (1, 3)


def test_a_lone_chunk_is_read_on_its_own_cache(tiny_llama):
    """One turn in a round: read on the answer's own cache (no copy), as before prompts were read together."""
    fwd = Forward(tiny_llama.model)
    ids = torch.randint(5, 1000, (1, 9), generator=torch.Generator().manual_seed(1))
    cache, turn = alone(fwd, ids, 4)
    reader = PromptReader()
    with torch.no_grad():
        reader.run([turn])
    assert turn.cache is cache and cache.get_seq_length() == 9 and turn.hidden.shape == (1, 64)


def test_turns_past_the_readers_positions_are_read_in_groups_of_similar_pasts(tiny_llama):
    """A reader of 64 positions: chunks of 4 after pasts of 2, 3, 20 and 24 read as two forwards (2 rows x 7 and
    2 rows x 28 positions; all four together would be 4 x 28), each answer as read alone."""
    fwd, g = Forward(tiny_llama.model), torch.Generator().manual_seed(2)
    pasts = (20, 2, 24, 3)
    prompts = [torch.randint(5, 1000, (1, p + 4), generator=g) for p in pasts]
    turns = [alone(fwd, ids, p)[1] for ids, p in zip(prompts, pasts)]
    reader, sizes = PromptReader(positions=64), []
    with pytest.MonkeyPatch.context() as mp:
        from decoding import prompt_reads
        real = prompt_reads.read_together
        mp.setattr(prompt_reads, "read_together",
                   lambda ts: (sizes.append(sorted(t.cache.get_seq_length() for t in ts)), real(ts)))
        with torch.no_grad():
            reader.run(turns)
    assert sizes == [[2, 3], [20, 24]] and (reader.forwards, reader.turns) == (2, 4)
    with torch.no_grad():
        for t, ids, p in zip(turns, prompts, pasts):
            cache, turn = alone(fwd, ids, p)
            want, _ = fwd.prefill(turn.embeds, turn.positions, cache, None, {})
            torch.testing.assert_close(t.hidden, want, atol=1e-5, rtol=1e-5)



def test_a_read_that_fails_together_is_read_alone_and_only_what_fails_alone_fails(tiny_llama, monkeypatch):
    """Out of memory in the forward of three chunks: each is read alone, and only the one whose own read fails
    (the longest, 11 positions) holds the error its answer raises; the others are as read alone."""
    fwd, g = Forward(tiny_llama.model), torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 1000, (1, 3 + n), generator=g) for n in (7, 2, 11)]
    turns = [alone(fwd, ids, 3)[1] for ids in prompts]
    real = Forward.prefill

    def prefill(self, embeds, *args, **kw):
        if embeds.shape[1] > 10:
            raise torch.OutOfMemoryError("injected: out of memory")
        return real(self, embeds, *args, **kw)
    monkeypatch.setattr(Forward, "forward_block", lambda *a, **k: (_ for _ in ()).throw(
        torch.OutOfMemoryError("injected: out of memory")))
    monkeypatch.setattr(Forward, "prefill", prefill)
    reader = PromptReader()
    with torch.no_grad():
        reader.run(turns)
    assert [t.error is not None for t in turns] == [False, False, True] and "injected" in str(turns[2].error)
    monkeypatch.undo()
    with torch.no_grad():
        for t, ids in zip(turns[:2], prompts):
            cache, turn = alone(fwd, ids, 3)
            want, _ = fwd.prefill(turn.embeds, turn.positions, cache, None, {})
            torch.testing.assert_close(t.hidden, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["sliding-window", "dynamic-rope"])
def test_what_would_not_read_as_alone_in_a_padded_forward_is_read_alone(kind):
    """A sliding window's layers keep only their window, and dynamic rotary frequencies depend on the batch's
    longest position: such chunks are each read in a forward of their own (the guard, not luck)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    small = dict(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    model = (MistralForCausalLM(MistralConfig(sliding_window=8, **small)) if kind == "sliding-window" else
             LlamaForCausalLM(LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                                          **small))).eval()
    fwd, g = Forward(model), torch.Generator().manual_seed(4)
    pasts = (50, 10) if kind == "dynamic-rope" else (5, 3)
    prompts = [torch.randint(5, 1000, (1, p + n), generator=g) for p, n in zip(pasts, (4, 30))]
    with torch.no_grad():
        turns = [alone(fwd, ids, p)[1] for ids, p in zip(prompts, pasts)]
        reader = PromptReader()
        reader.run(turns)
        assert (reader.forwards, reader.turns) == (2, 2)
        for t, ids, p in zip(turns, prompts, pasts):
            cache, turn = alone(fwd, ids, p)
            want, _ = fwd.prefill(turn.embeds, turn.positions, cache, None, {})
            torch.testing.assert_close(t.hidden, want, atol=1e-6, rtol=1e-6)

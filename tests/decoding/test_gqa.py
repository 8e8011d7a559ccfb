"""decoding/gqa.py: a step's or a span's grouped-query attention, a key/value head's query heads as its rows."""

from __future__ import annotations

import copy

import pytest
import torch

from decoding import gqa
from decoding.graph import GraphDecoder
from decoding.settings import GenerationSettings
from test_graph import RECALL, kv_recall, prompt, tiny_llama


@pytest.fixture
def shapes(monkeypatch):
    """The query shapes SDPA is called with."""
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        seen.append(tuple(query.shape))
        return sdpa(query, *args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("rows, width", [(1, 1), (1, 17), (2, 9)])
def test_a_step_or_span_attends_packed_and_equals_the_copied_heads(shapes, rows, width):
    """4 query heads on 2 key/value heads: one position, or a span (a recall's 17; 9 in each of 2 rows, each row its
    own mask), with a mask attends as [B, 2, 2 * width, D] (no head copied), with the logits of SDPA's own; a prompt
    longer than `MAX_POSITIONS` takes SDPA's own path."""
    model = tiny_llama(seed=5)
    ids = prompt(1, rows=rows)
    span = torch.randint(3, 400, (rows, width), generator=torch.Generator().manual_seed(2))
    seen = torch.ones(rows, 1, width, 12, dtype=torch.bool)  # the prompt's columns, then causal within the span
    mask = torch.cat([seen, torch.ones(rows, 1, width, width, dtype=torch.bool).tril()], -1)
    mask[0, ..., 3] = False  # (a column that row 0 does not see: a mask that is not plain causal, nor every row's)
    with torch.no_grad():
        past = model(ids, use_cache=True).past_key_values
        step = lambda: model(span, past_key_values=copy.deepcopy(past), attention_mask=mask,  # noqa: E731
                             position_ids=torch.arange(12, 12 + width)[None].expand(rows, -1)).logits
        want = step()
        assert gqa.pack(model.config.get_text_config()) and model.config._attn_implementation == gqa.PACKED
        shapes.clear()
        got = step()
        assert shapes == [(rows, 2, 2 * width, 16)] * 2  # (2 layers: the query heads of a key/value head as rows)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # (seen: 1.2e-7 under transformers 5.17)
        shapes.clear()
        long = prompt(1, length=gqa.MAX_POSITIONS + 1)
        model(long, attention_mask=torch.ones_like(long))  # a prompt: SDPA's own
        assert len(shapes) == 2 and all(s[1:3] == (4, long.shape[1]) for s in shapes)


def test_a_model_without_grouped_query_layers_keeps_its_attention():
    model = tiny_llama(seed=5)
    model.config.num_key_value_heads = model.config.num_attention_heads
    assert GraphDecoder(model, max_len=64, compile=False, gqa="packed").graph.gqa == "repeat"
    assert model.config._attn_implementation == "sdpa"


def test_the_packed_compiled_step_equals_the_eager_one(shapes):
    """The graph step with `gqa="packed"`, compiled (inductor on a CPU), gives the tokens, logits and recalls of the
    eager step with transformers' copied heads; its decode forward attends packed."""
    model = tiny_llama(seed=3)  # (its own: packing changes the model's attention implementation)
    eager = GraphDecoder(model, max_len=256, compile=False)
    recall = kv_recall(model)
    s = GenerationSettings(max_new_tokens=24, sequence_bias=(((RECALL,), 4.0),))
    want = eager.generate(prompt(2), s, recall=recall, keep_logits=True)
    fast = GraphDecoder(model, max_len=512, gqa="packed")
    assert fast.graph.gqa == "packed" and model.config._attn_implementation == gqa.PACKED
    assert fast.graph.windowed and fast.graph.windows == (128, 512)  # (packed, it still attends over windows)
    assert GraphDecoder(model, max_len=512, compile=False, gqa="repeat").graph.windowed  # (a later step on it too)
    shapes.clear()
    fast.warm_up()
    assert (1, 2, 2, 16) in shapes and (1, 2, 2 * 17, 16) in shapes  # (traced packed: the step's and a span's)
    got = fast.generate(prompt(2), s, recall=recall, keep_logits=True)
    assert got.tokens == want.tokens and want.recalls
    assert [(r.position, r.memory_index) for r in got.recalls] == [(r.position, r.memory_index) for r in want.recalls]
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=1e-4)

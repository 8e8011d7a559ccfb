"""The seeds' API (`decoding/seed_api.py`, seed 000): `custom_generate`'s signature, its token parameters from
`config["generation"]`, the caller's processors before the warpers, the recall config's defaults, the injection
record of a batch, a tool call that stops its row, and `memory_head` / `memory_embedding`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from decoding import RecallSettings, custom_generate, memory_embedding, memory_head
from decoding.seed_api import SEED_RECALL_DEFAULTS, recall_settings_from_config
from test_loop import CHAT, bank_for, query_state
from tests_helpers import ForceTokens

RECALL_ON = {"memory": {"autoregressive_recall": {"enabled": True, "top_k": 3, "use_sampling": False}}}


def call(lm, db, config, inputs, **kw):
    """`custom_generate` on a tiny model with the seed's arguments; the token parameters are None (read from
    `config["generation"]`) unless `kw` gives them."""
    args = dict(max_new_tokens=5, stopping_criteria=None, logits_processor=None, temperature=None, top_k=None,
                top_p=None, do_sample=None, pad_token_id=lm.tokenizer.pad_token_id,
                eos_token_id=lm.tokenizer.eos_token_id, interrupt_event=None, early_stop_on_tool_call=False)
    return custom_generate(lm.model, lm.tokenizer, db, lm.tokens.as_dict(), config, inputs, **{**args, **kw})


def test_custom_generate_seed_signature(tiny_llama):
    lm = tiny_llama
    db = bank_for(lm)
    prompt = lm.tokenizer([CHAT.format("Hello")], return_tensors="pt")
    ids = torch.cat([prompt["input_ids"], torch.tensor([[lm.tokens.recall]])], dim=1)
    config = {"memory": {"autoregressive_recall": {"enabled": True, "top_k": 3, "use_sampling": False}}}
    out, positions = custom_generate(
        lm.model, lm.tokenizer, db, lm.tokens.as_dict(), config, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        max_new_tokens=5, stopping_criteria=None, logits_processor=None, temperature=1.0, top_k=0, top_p=1.0,
        do_sample=False, pad_token_id=lm.tokenizer.pad_token_id, eos_token_id=lm.tokenizer.eos_token_id,
        interrupt_event=None, early_stop_on_tool_call=False)
    assert out.shape == (1, ids.shape[1] + 5)
    best, _ = db.topk(query_state(lm, ids[0].tolist()), 1)  # greedy memory head: the key closest to the query
    assert positions[0][0] == ids.shape[1] and positions[0][1] == pytest.approx(float(best[0]), abs=1e-5)
    assert out[0, ids.shape[1]] == lm.tokens.memory_pad
    plain = custom_generate(
        lm.model, lm.tokenizer, None, lm.tokens.as_dict(), {}, prompt, 5, None, None, 1.0, 0, 1.0, False,
        lm.tokenizer.pad_token_id, lm.tokenizer.eos_token_id, None, False)
    assert isinstance(plain, torch.Tensor)


class Seen(LogitsProcessor):
    """The caller's processor: keeps the scores it is given, and changes nothing."""

    def __init__(self):
        self.scores: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        self.scores.append(scores.clone())
        return scores


class SeenLast(StoppingCriteria):
    """A criterion that keeps each step's final scores (every processor and warper applied) and never stops."""

    def __init__(self):
        self.scores: list[torch.Tensor] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.scores.append(scores.clone())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


GENERATION = {"generation": {"do_sample": True, "temperature": 0.7, "top_k": 7, "top_p": 0.8}}


@pytest.mark.parametrize("given, used", [({}, (0.7, 7, 0.8)), ({"temperature": 0.5, "top_k": 3}, (0.5, 3, 0.8))],
                         ids=["from-config", "given-win"])
def test_token_parameters_fall_back_to_the_config_and_the_callers_processors_run_first(tiny_llama, given, used):
    """Seed 000: temperature, top-k, top-p and do_sample not given come from `config["generation"]`; the caller's
    processors see the raw logits, the warpers (do_sample) come after them."""
    lm = tiny_llama
    ids = lm.tokenizer([CHAT.format("Hello")], return_tensors="pt")["input_ids"]
    first, last = Seen(), SeenLast()
    call(lm, None, GENERATION, {"input_ids": ids}, max_new_tokens=1, logits_processor=LogitsProcessorList([first]),
         stopping_criteria=[last], **given)
    with torch.no_grad():
        torch.testing.assert_close(first.scores[0], lm.model(ids).logits[:, -1])
    temperature, top_k, top_p = used
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k),
                                   TopPLogitsWarper(top_p)])
    torch.testing.assert_close(last.scores[0], warpers(ids, first.scores[0]))


def test_the_recall_config_defaults_to_the_seeds_and_names_an_unknown_key(tiny_llama):
    # seed 000 reads `memory_cfg.get(key, default)` with these defaults (seed 001 lists the same keys)
    assert SEED_RECALL_DEFAULTS == {"enabled": False, "top_k": 5, "temperature": 1.0, "top_p": 1.0,
                                    "use_sampling": True, "debug": False}
    seed = RecallSettings(enabled=False, top_k=5, temperature=1.0, top_p=1.0, use_sampling=True, debug=False)
    assert recall_settings_from_config(None) == recall_settings_from_config({"memory": {}}) == seed
    given = {"memory": {"autoregressive_recall": {"enabled": True, "top_k": 2}}}
    assert recall_settings_from_config(given) == dataclasses.replace(seed, enabled=True, top_k=2)
    lm = tiny_llama
    prompt = lm.tokenizer(CHAT.format("Hello"))["input_ids"] + [lm.tokens.recall]
    inputs = {"input_ids": torch.tensor([prompt])}
    out = call(lm, bank_for(lm), {}, inputs)  # recall is off unless the config turns it on: the bank is not read
    assert isinstance(out, torch.Tensor) and out[0, len(prompt)] != lm.tokens.memory_pad
    known = r"\['debug', 'enabled', 'temperature', 'top_k', 'top_p', 'use_sampling'\]"
    with pytest.raises(ValueError, match=rf"autoregressive_recall'\] has unknown keys \['topk'\]; known: {known}"):
        call(lm, bank_for(lm), {"memory": {"autoregressive_recall": {"enabled": True, "topk": 3}}}, inputs)


def test_a_batch_returns_row_position_similarity_triples(tiny_llama):
    """Row 0's prompt ends with <recall> (its memory comes at the first step), row 1 is made to write one at its
    second step: a (row, first slot, similarity) triple each, in the order of the injections."""
    lm = tiny_llama
    db = bank_for(lm)
    prompt = lm.tokenizer(CHAT.format("What do you remember?"))["input_ids"]
    ids = torch.tensor([prompt + [lm.tokens.recall], prompt + [prompt[-1]]])
    width = ids.shape[1]
    out, positions = call(lm, db, RECALL_ON, {"input_ids": ids},
                          logits_processor=[ForceTokens(width + 1, [lm.tokens.recall], rows=[1])])
    assert [(row, position) for row, position, _ in positions] == [(0, width), (1, width + 2)]
    for row, position, score in positions:
        assert out[row, position - 1:position + 1].tolist() == [lm.tokens.recall, lm.tokens.memory_pad]
        best, _ = db.topk(query_state(lm, out[row, :position].tolist()), 1)
        assert score == pytest.approx(float(best[0]), abs=1e-4)


def test_a_tool_call_stops_only_the_row_that_closed_it(tiny_llama):
    """Seed 000's `early_stop_on_tool_call`, per row: row 0 is made to close its tool call from its second step on
    and stops there (padding after it); row 1, the same prompt, goes on to the length as it does alone."""
    lm = tiny_llama
    tok = lm.tokenizer
    end = tok("</tool_call>", add_special_tokens=False)["input_ids"]  # "</", "tool", "_", "call", ">"
    prompt = tok(CHAT.format("Call the weather tool.") + '<tool_call>{"name": "weather"}')["input_ids"]
    n, start = 10, len(prompt) + 1
    kw = dict(max_new_tokens=n, early_stop_on_tool_call=True)
    both = call(lm, None, {}, {"input_ids": torch.tensor([prompt, prompt])},
                logits_processor=[ForceTokens(start, end, rows=[0])], **kw)
    alone = call(lm, None, {}, {"input_ids": torch.tensor([prompt])}, **kw)
    assert both[0, start:start + len(end)].tolist() == end
    assert both[0, start + len(end):].tolist() == [tok.pad_token_id] * (n - 1 - len(end))
    assert alone.shape[1] == len(prompt) + n and both[1].tolist() == alone[0].tolist()


def test_seed_memory_head_and_embedding(tiny_llama):
    db = bank_for(tiny_llama, n=7)
    q = torch.randn(tiny_llama.hidden_size)
    logits, candidates = memory_head(q, db)
    assert logits.shape == (7,) and len(candidates) == 7
    assert torch.all(logits[:-1] >= logits[1:])  # best first
    assert sorted(c["index"] for c in candidates) == list(range(7))
    emb = memory_embedding(candidates[0]["embedding"], tiny_llama.model)
    assert emb.shape == (1, 1, tiny_llama.hidden_size) and emb.dtype == tiny_llama.dtype

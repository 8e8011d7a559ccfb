"""The compiled decode step on a static cache: exact against `generate` and the eager loop, and compiled once."""

from __future__ import annotations

import threading

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache, StaticCache

from chat.session import Conversation
from conftest import make_tiny_llama
from decoding.request import Controls, Prompt
from decoding import compiled
from decoding.batch import Batch
from decoding.events import TokenEvent
from decoding.forward import Forward
from decoding.loop import generate, stream_generate
from decoding.processors import to_generation_config
from decoding.settings import GenerationSettings, RecallSettings
from models.quantize import int8 as quantize
from test_batch import QUESTIONS, drive, prompt, result_of
from test_loop import (CHAT, bank_for, check_replay, check_slots, ids_of, kv_bank_for, recall_of, replay_embeds,
                       run_with_recalls)


@pytest.fixture(scope="module")
def fast_llama(smollm2_dir):
    """A tiny Llama of its own (the shared fixture stays eager), its decode step compiled."""
    lm = make_tiny_llama(smollm2_dir, seed=3)
    step = compiled.enable(lm.model)
    assert compiled.compiled_step(lm.model) is None  # not before it is warm
    step.warm_up()
    assert step.error is None and compiled.compiled_step(lm.model) is step
    return lm


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def limit_hits() -> int:
    """How often dynamo gave up on a function at its recompile limit (it then runs eagerly, without a word)."""
    return sum(n for msg, n in counters["unimplemented"].items() if msg.startswith("Dynamo recompile limit exceeded"))


@pytest.mark.parametrize("settings", [GenerationSettings(max_new_tokens=24),
                                      GenerationSettings(do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
                                                         repetition_penalty=1.2, max_new_tokens=24)],
                         ids=["greedy", "sample"])
def test_compiled_loop_matches_generate_and_the_eager_loop(fast_llama, settings):
    lm = fast_llama
    inputs = lm.tokenizer([CHAT.format("Tell me a story")], return_tensors="pt")
    torch.manual_seed(7)
    expected = lm.model.generate(**inputs, generation_config=to_generation_config(settings, **ids_of(lm)))
    torch.manual_seed(7)
    fast = generate(lm.model, inputs, settings, controls=Controls(output_logits=True))
    assert isinstance(fast.cache, StaticCache)  # it took the compiled path
    assert fast.sequences.tolist() == expected.tolist()
    torch.manual_seed(7)
    eager = generate(
        lm.model,
        Prompt(inputs, cache=DynamicCache(config=lm.model.config)),
        settings,
        controls=Controls(output_logits=True),
    )
    torch.testing.assert_close(fast.logits, eager.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bank", [bank_for, kv_bank_for], ids=["one-slot", "k-slot"])
def test_recalls_through_the_compiled_step_replay_exactly(fast_llama, bank):
    """Token steps compiled, a memory's k slots (and `</recall>`) as one eager forward on the same static cache."""
    lm = fast_llama
    db = bank(lm)
    inputs = lm.tokenizer([CHAT.format("What do you remember?")], return_tensors="pt")
    before = graphs()
    result = run_with_recalls(lm, inputs, db, steps=40)
    assert isinstance(result.cache, StaticCache) and len(result.injections) >= 2
    assert graphs() == before  # the spans ran eagerly, nothing compiled anew
    suffix = (lm.tokens.recall_end,) if db.has_values else ()
    check_slots(lm, result, db, suffix)
    seq, emb = replay_embeds(lm, result)
    with torch.no_grad():
        full = lm.model(inputs_embeds=emb).logits
    check_replay(result, full, len(suffix))


def test_a_conversation_with_recalls_compiles_nothing_new(fast_llama):
    lm = fast_llama
    db = bank_for(lm)
    before = graphs()
    conv = Conversation(lm)
    greedy = GenerationSettings(max_new_tokens=12)
    for turn in range(10):
        for _ in conv.stream(f"Question {turn}?", (), greedy, RecallSettings(), db, recall_first=turn % 2 == 0):
            pass
        assert isinstance(conv.cache, StaticCache) and compiled.seq_length(conv.cache) == len(conv.ids) - 1
    assert sum(len(m.recalls) for m in conv.messages) >= 5
    assert graphs() == before  # 10 turns, 5 recalls, new caches: no recompile
    # and the conversation is what the eager loop gives, token for token
    eager = Conversation(lm)
    compiled_ids, conv_turns = conv.ids, [m.text for m in conv.messages]
    step, lm.model._recall_compiled_step = lm.model._recall_compiled_step, None
    try:
        for turn in range(10):
            for _ in eager.stream(f"Question {turn}?", (), greedy, RecallSettings(), db, recall_first=turn % 2 == 0):
                pass
        assert not isinstance(eager.cache, StaticCache)
    finally:
        lm.model._recall_compiled_step = step
    assert eager.ids == compiled_ids and [m.text for m in eager.messages] == conv_turns


def test_a_static_cache_grows_with_its_contents(fast_llama):
    lm = fast_llama
    inputs = lm.tokenizer([CHAT.format("Count")], return_tensors="pt")
    first = generate(lm.model, inputs, GenerationSettings(max_new_tokens=8))
    small = first.cache
    held = compiled.seq_length(small)
    assert small.layers[0].max_cache_len == compiled.BUCKETS[0]  # the shortest bucket holds a short chat
    bigger = compiled.fit(small, lm.model, compiled.BUCKETS[0] + 1)
    assert bigger.layers[0].max_cache_len == compiled.BUCKETS[1] and compiled.seq_length(bigger) == held
    for old, new in zip(small.layers, bigger.layers):
        torch.testing.assert_close(new.keys[:, :, :held], old.keys[:, :, :held], rtol=0, atol=0)
    assert compiled.fit(small, lm.model, held + 5) is small
    step = compiled.compiled_step(lm.model)
    assert step.lengths == {128, 256, 512}  # every bucket up to the model's context (512)
    assert step.covers(small) and step.covers(bigger)
    beyond = compiled.fit(bigger, lm.model, 600)
    assert not step.covers(beyond)  # never compiled: it decodes eagerly, no compile in the middle of a chat


def test_an_answer_that_outgrows_its_bucket_stays_exact(fast_llama):
    lm = fast_llama
    inputs = lm.tokenizer([CHAT.format("Tell me everything")], return_tensors="pt")
    settings = GenerationSettings(max_new_tokens=300, min_new_tokens=300)
    expected = lm.model.generate(**inputs, generation_config=to_generation_config(settings, **ids_of(lm)))
    before = graphs()
    got = generate(lm.model, inputs, settings)
    assert got.cache.layers[0].max_cache_len == 512 and compiled.seq_length(got.cache) == got.sequences.shape[1] - 1
    assert got.sequences.tolist() == expected.tolist() and graphs() == before  # 128 -> 256 -> 512, all compiled


def test_stop_right_after_recall_crops_the_static_cache(fast_llama):
    lm = fast_llama
    inputs = lm.tokenizer([CHAT.format("Go")], return_tensors="pt")
    s = GenerationSettings(max_new_tokens=30, sequence_bias=(((lm.tokens.recall,), 50.0),))
    stop = threading.Event()
    events = []
    for e in stream_generate(lm.model, inputs, s, recall=recall_of(lm, bank_for(lm)), interrupt=stop):
        events.append(e)
        if isinstance(e, TokenEvent) and e.token_id == lm.tokens.memory_pad:
            stop.set()
    result = events[-1].result
    seq = result.sequences[0].tolist()
    assert isinstance(result.cache, StaticCache) and seq[-1] == lm.tokens.memory_pad
    assert compiled.seq_length(result.cache) == len(seq) - 1


def test_no_path_to_the_step_recompiles_it_after_the_first_bucket(smollm2_dir):
    """Past dynamo's recompile limit the step would run eagerly without a word. From the first bucket on, a
    lone answer, a batch's last seat, a recall, a second turn, a step fed slices of wider tensors (as
    bench/generate.py fed it) and an int8 model's step next to it compile nothing more."""
    lm, int8 = make_tiny_llama(smollm2_dir, seed=6), make_tiny_llama(smollm2_dir, seed=6)
    quantize(int8.model)
    hits = limit_hits()
    with torch._dynamo.config.patch(recompile_limit=1):  # one compile each: the two models' steps count apart
        for m in (lm, int8):
            step = compiled.enable(m.model)
            step.warm_up(up_to=64)
            assert step.error is None and step.lengths == {compiled.BUCKETS[0]}
    assert limit_hits() == hits
    kw = dict(tokenizer=lm.tokenizer)
    before = graphs()
    with torch.compiler.set_stance("fail_on_recompile"):
        caches = [generate(m.model, prompt(m, "Tell me a story"), GenerationSettings(max_new_tokens=8), **kw).cache
                  for m in (lm, int8)]  # a lone answer, fp32 and int8
        batch = Batch()
        together, _ = drive({0: [(stream_generate(lm.model, prompt(lm, q), GenerationSettings(max_new_tokens=n),
                                                  batch=batch, **kw), threading.Event())
                                 for q, n in zip(QUESTIONS, (3, 12))]}, batch)
        caches.append(result_of(together[1]).cache)  # alone in the batch after its neighbour finished
        assert batch.forwards > 0 and batch.seats == []
        conv, db = Conversation(lm), bank_for(lm)
        for turn in range(2):  # a recall in the first turn, then a second turn on its cache
            events = list(conv.stream(f"Question {turn}?", (), GenerationSettings(max_new_tokens=8), RecallSettings(),
                                      db, recall_first=turn == 0))
            caches.append(events[-1].result.cache)
        assert conv.messages[1].recalls
        seq = torch.tensor([conv.ids])  # fed as slices [:, i:i + 1] of its embeddings, autograd on
        fwd, cache = Forward(lm.model), compiled.static_cache(lm.model, seq.shape[1])
        embeds, positions = fwd.embed(seq), torch.arange(seq.shape[1])[None]
        with torch.no_grad():
            fwd.prefill(embeds[:, :4], positions[:, :4], cache, None, {})
        for i in range(4, 8):
            fwd.step(embeds[:, i:i + 1], positions[:, i:i + 1], cache, None)
        caches.append(cache)
    assert all(compiled.attached(m.model).covers(c) for m, c in zip((lm, int8, lm, lm, lm, lm), caches))
    assert graphs() == before and limit_hits() == hits


def test_entropy_decoding_beside_a_background_compile_keeps_every_layer(smollm2_dir):
    """While dynamo traces, transformers' output capture is one variable of the process, not of a thread: an
    entropy step beside the app's background compile lost layers (CI: states of 2 layers where 4 were)."""
    building = make_tiny_llama(smollm2_dir, seed=11)
    lm = make_tiny_llama(smollm2_dir, seed=12)
    inputs = lm.tokenizer([CHAT.format("Tell me about the sea.")], return_tensors="pt")
    settings = GenerationSettings(max_new_tokens=8, entropy_decoding="trough", entropy_record_tokens=True)
    alone = generate(lm.model, inputs, settings).sequences.tolist()
    step = compiled.enable(building.model)
    thread = threading.Thread(target=step.warm_up)
    thread.start()
    runs = 0
    try:
        while thread.is_alive():
            assert generate(lm.model, inputs, settings).sequences.tolist() == alone
            runs += 1
    finally:
        step.stop()
        thread.join()
    assert step.error is None and step.lengths == {128, 256, 512} and runs > 0


def test_a_stop_ends_the_warm_up_it_was_asked_of_and_not_a_later_one(smollm2_dir):
    """A service that closes stops its background compile after the current bucket; the model's step compiles again
    for the next service that warms it up."""
    step = compiled.enable(make_tiny_llama(smollm2_dir, seed=13).model)
    step.stop()  # asked before the warm-up began: honoured
    assert step.warm_up() == 0.0 and step.lengths == set() and not step.ready.is_set()
    assert step.warm_up(up_to=100) > 0 and step.lengths == {128} and step.ready.is_set()

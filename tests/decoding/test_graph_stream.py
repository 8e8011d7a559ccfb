"""The chat's answers on the graph step (`decoding/graph_stream.py`), on a CPU: the buffer step runs eagerly there
(no CUDA graphs), the same code the GPU replays. A conversation on it is the loop's conversation, token for token
and event for event, across turns, recalls, stops, reads ahead and other conversations taking the step."""

from __future__ import annotations

import threading

import pytest
import torch

from chat.session import Conversation
from conftest import make_tiny_llama
from decoding import graph
from decoding.engine import cache_length, cut_cache
from decoding.events import DoneEvent, RecallEvent, TokenEvent
from decoding.graph_stream import GraphCache
from decoding.settings import GenerationSettings, RecallSettings
from tests_helpers import returned, told


@pytest.fixture(scope="module")
def graphed(smollm2_dir):
    """The weights of `tiny_llama` (the same seed), with a warmed-up graph step attached."""
    lm = make_tiny_llama(smollm2_dir)
    decoder = graph.enable(lm.merged(), max_len=512, spans=(17,), compile=False)
    decoder.warm_up()
    assert decoder.ready.is_set() and decoder.error is None
    return lm


GREEDY = GenerationSettings(max_new_tokens=12)


def turn(conv, text, settings, bank=None, **kwargs) -> list:
    events = list(conv.stream(text, settings=settings, memory_db=bank, **kwargs))
    assert isinstance(events[-1], DoneEvent)
    return told(events)


@pytest.fixture
def prefills(graphed, monkeypatch) -> list[int]:
    """The position each prefill of `graphed`'s step starts from, as they happen."""
    g = graph.attached(graphed.merged()).graph
    starts, prefill = [], g.prefill
    monkeypatch.setattr(g, "prefill", lambda embeds, start=0, *a, **k: starts.append(start) or prefill(embeds, start,
                                                                                                         *a, **k))
    return starts


def recalling(lm) -> GenerationSettings:
    """Greedy, with `<recall>` raised so that the tiny random model recalls in the middle of its answers."""
    return GenerationSettings(max_new_tokens=24, sequence_bias=(((lm.tokens.recall,), 6.0),))


def test_a_conversation_on_the_graph_step_is_the_loops(graphed, tiny_llama, bank, prefills):
    """Four turns (a memory read first, memories recalled mid-answer, a repetition penalty, a stop string): the
    same events, ids and memory vectors as the loop's; each turn after the first prefills only its new tokens."""
    on, off = Conversation(graphed), Conversation(tiny_llama)
    turns = [("Who am I?", GenerationSettings(max_new_tokens=10), dict(recall_first=True)),
             ("And then?", recalling(graphed), {}),
             ("Tell me more.", GenerationSettings(max_new_tokens=16, repetition_penalty=1.3), {}),
             ("Once more.", GenerationSettings(max_new_tokens=30, stop_strings=("e",)), {})]
    recalls = 0
    for i, (text, settings, kwargs) in enumerate(turns):
        held, prefills[:] = cache_length(on.cache) if on.cache is not None else 0, []
        got = turn(on, text, settings, bank, **kwargs)
        assert got == turn(off, text, settings, bank, **kwargs), text
        assert on.ids == off.ids and on.memory.keys() == off.memory.keys()
        for p in on.memory:
            torch.testing.assert_close(on.memory[p], off.memory[p])
        assert isinstance(on.cache, GraphCache) and cache_length(on.cache) == len(on.ids) - 1
        assert prefills == [held] and (held > 0) == (i > 0)  # what the cache held is not read again
        recalls += sum(e[0] == "recall" for e in got)
    assert recalls >= 3 and on.messages[-1].finish_reason == "stop"  # (the stop string ended the last answer)


def test_conversations_taking_turns_on_the_step_keep_their_positions(graphed, tiny_llama, bank, prefills):
    """B's turn takes the step: A's positions are copied out with its handle first; A's next turn copies them back
    and prefills only its new tokens, and both answer as the loop does, turn after turn."""
    a, b = Conversation(graphed), Conversation(graphed)
    ref_a, ref_b = Conversation(tiny_llama), Conversation(tiny_llama)
    for conv in (a, ref_a):
        turn(conv, "Who am I?", GenerationSettings(max_new_tokens=6), bank, recall_first=True)
    assert a.memory and cache_length(a.cache) == len(a.ids) - 1 and a.cache.resident()
    for text in ["Hello there.", "And then?", "Tell me more."]:
        for conv, ref in ((b, ref_b), (a, ref_a)):
            held, prefills[:] = cache_length(conv.cache) if conv.cache is not None else 0, []
            assert turn(conv, text, recalling(graphed), bank) == turn(ref, text, recalling(graphed), bank)
            assert conv.ids == ref.ids and prefills == [held]
        assert a.cache.resident() and b.cache.held is not None and cache_length(b.cache) == len(b.ids) - 1
    keep = cache_length(b.cache) // 2
    cut_cache(b.cache, keep)  # (an answer taken back): what is held shrinks to what is kept
    k, _ = b.cache.held[0]
    assert cache_length(b.cache) == k.shape[2] == keep and k.untyped_storage().nbytes() == k.numel() * k.element_size()


def test_a_second_answer_while_the_step_is_busy_decodes_in_the_loop(graphed, tiny_llama):
    """Two answers at once (the worker interleaves their generators): the first holds the step, the second runs in
    the loop; both are the loop's answers."""
    settings = GenerationSettings(max_new_tokens=12)
    first, second = Conversation(graphed), Conversation(graphed)
    refs = [Conversation(tiny_llama), Conversation(tiny_llama)]
    one = first.stream("Hello there.", settings=settings)
    started = [next(one) for _ in range(3)]
    assert graph.attached(graphed.merged()).busy
    two = turn(second, "What is the sea?", settings)
    assert not isinstance(second.cache, GraphCache)  # (the loop's own cache)
    rest = told(started + list(one))
    assert not graph.attached(graphed.merged()).busy
    assert rest == turn(refs[0], "Hello there.", settings) and two == turn(refs[1], "What is the sea?", settings)
    assert first.ids == refs[0].ids and second.ids == refs[1].ids


def test_a_stop_right_after_a_recall_on_the_step_leaves_nothing_half_done(graphed, bank):
    conv, stop = Conversation(graphed), threading.Event()
    for e in conv.stream("Remember", settings=GenerationSettings(max_new_tokens=20), memory_db=bank,
                         interrupt_event=stop, recall_first=True):
        if isinstance(e, RecallEvent):
            stop.set()  # right after the memory was chosen
    assert conv.messages[-1].finish_reason == "interrupted"
    p = len(conv.ids) - 1
    assert conv.ids[-1] == graphed.tokens.memory_pad and p in conv.memory and cache_length(conv.cache) == p
    turn(conv, "Go on", GenerationSettings(max_new_tokens=6), bank)  # the next turn places its vector again
    assert conv.messages[-1].finish_reason in ("length", "stop") and p in conv.memory


def test_a_stop_mid_answer_ends_within_one_block(graphed):
    conv, stop, tokens = Conversation(graphed), threading.Event(), 0
    for e in conv.stream("Tell me a story.", settings=GenerationSettings(max_new_tokens=40), interrupt_event=stop):
        tokens += isinstance(e, TokenEvent)
        if tokens == 5:
            stop.set()
    assert tokens == 5 and conv.messages[-1].finish_reason == "interrupted"
    assert cache_length(conv.cache) == len(conv.ids) - 1


def test_a_prompt_read_ahead_on_the_step_changes_no_token(graphed, tiny_llama):
    ahead, alone = Conversation(graphed), Conversation(tiny_llama)
    settings = GenerationSettings(max_new_tokens=12)
    for text in ["Hello there, who are you?", "Tell me one thing about the sea."]:
        assert returned(ahead.read_ahead(text))[0]
        assert isinstance(ahead.cache, GraphCache) and cache_length(ahead.cache) == ahead.length_with(text) - 1
        assert turn(ahead, text, settings) == turn(alone, text, settings)
        assert ahead.ids == alone.ids


@pytest.mark.parametrize("settings", [GenerationSettings(max_new_tokens=500),  # (the step holds 512 positions)
                                      GenerationSettings(max_new_tokens=6, entropy_decoding="trough")],
                         ids=["longer-than-the-step", "entropy"])
def test_what_the_step_does_not_take_decodes_in_the_loop(graphed, tiny_llama, settings):
    on, off = Conversation(graphed), Conversation(tiny_llama)
    assert turn(on, "Hi", settings) == turn(off, "Hi", settings)
    assert on.ids == off.ids and not isinstance(on.cache, GraphCache)


def test_the_service_answers_on_the_graph_step_when_configured(smollm2_dir, tiny_llama):
    """`model.graph_step: true` (on a CPU: the eager buffer step): the model loads with the step attached and warmed
    up in the background, and the answers, asked through the service, are those of a service without it; `auto`
    attaches none on a CPU, and a value that is neither is refused by name."""
    from chat.config import ConfigError, load_config
    from chat.service import Service
    from chat.textsearch import TextSearch
    from tests_helpers import result

    def config(*more):
        return load_config(overrides=["model.compile=false", *more], environ={})

    search = TextSearch()
    on = Service(config("model.graph_step=true"), loader=lambda: make_tiny_llama(smollm2_dir), text_search=search)
    off = Service(config("model.graph_step=false"), tiny_llama, text_search=search)
    auto = Service(config(), loader=lambda: make_tiny_llama(smollm2_dir), text_search=search)
    try:
        result(on.ready())
        decoder = graph.attached(on.lm.merged())
        assert decoder is not None and decoder.ready.wait(60) and not decoder.graph.compiled
        result(auto.ready())
        assert graph.attached(auto.lm.merged()) is None  # (no CUDA here)
        a, b = on.new_session(), off.new_session()
        settings, recall = GenerationSettings(max_new_tokens=10), RecallSettings(enabled=False)
        for text in ["Hi there", "Tell me about the sea."]:
            for svc, s in ((on, a), (off, b)):
                result(svc.chat(s, text, [], settings, recall).request)
            assert a.conv.ids == b.conv.ids and a.conv.messages[-1].text == b.conv.messages[-1].text
            assert isinstance(a.conv.cache, GraphCache) and a.conv.cache.resident()
    finally:
        for svc in (on, off, auto):
            svc.close()
    with pytest.raises(ConfigError, match="graph_step is 'maybe'; allowed: auto, true, false"):
        config("model.graph_step=maybe")


def test_a_conversation_with_an_image_on_the_step_is_the_loops(smollm2_dir, tiny_qwen3vl, small_image):
    """Qwen3-VL: the image read at prefill (vision kwargs, mRoPE positions), then text steps whose rotary positions
    continue where the image left them; a second turn on the cache of the first. The loop's tokens and events."""
    from conftest import make_tiny_qwen3vl

    lm = make_tiny_qwen3vl(smollm2_dir)
    decoder = graph.enable(lm.merged(), max_len=512, spans=(17,), compile=False)
    decoder.warm_up()
    on, off = Conversation(lm), Conversation(tiny_qwen3vl)
    settings = GenerationSettings(max_new_tokens=10)
    for text, images in [("What is in this picture?", [str(small_image)]), ("And its colours?", [])]:
        held = cache_length(on.cache) if on.cache is not None else 0
        got = told(on.stream(text, images, settings=settings))
        assert got == told(off.stream(text, images, settings=settings)), text
        assert on.ids == off.ids and isinstance(on.cache, GraphCache)
        assert (held > 0) == (not images) and cache_length(on.cache) == len(on.ids) - 1
    assert int(decoder.graph.delta[0, 0]) < 0  # the image's rotary positions run behind its text positions


def test_what_the_step_reads_one_step_ahead_never_shows(graphed, tiny_llama):
    """The step scores the step after the last token before the host reads that token: an answer ended by its EOS,
    whose next step would have wanted `<recall>` (nothing to read: `NoMemory`), says no memory was wanted, as the
    loop's does."""
    from decoding.graph_stream import stream_graph
    from decoding.loop import stream_generate
    from decoding.memory import Recall
    from decoding.request import Controls, Prompt
    from tests_helpers import ForceTokens

    ids = torch.tensor([Conversation(graphed).ids_with("Hello there.")])
    eos, settings = graphed.tokenizer.eos_token_id, GenerationSettings(max_new_tokens=8)
    recall = Recall(graphed.tokens.recall, graphed.tokens.memory_pad, None, without_memory="answer")
    controls = Controls(logits_processor=[ForceTokens(ids.shape[1] + 2, [eos, graphed.tokens.recall])])
    on = list(stream_graph(graph.attached(graphed.merged()), Prompt({"input_ids": ids}), settings, recall,
                           graphed.tokenizer, None, controls, None))[-1].result
    off = list(stream_generate(tiny_llama.merged(), {"input_ids": ids}, settings, recall=recall,
                               tokenizer=tiny_llama.tokenizer, controls=controls))[-1].result
    assert on.sequences.tolist() == off.sequences.tolist() and on.sequences[0, -1] == eos
    assert on.missed_recall == off.missed_recall == [False]


def test_a_stop_before_the_answer_starts_keeps_the_conversations_place(graphed):
    conv, stop = Conversation(graphed), threading.Event()
    turn(conv, "Hello there.", GenerationSettings(max_new_tokens=6))
    held = cache_length(conv.cache)
    stop.set()
    assert turn(conv, "And then?", GenerationSettings(max_new_tokens=6), interrupt_event=stop)[-1] == \
        ("finish", "interrupted")
    assert isinstance(conv.cache, GraphCache) and conv.cache.resident() and cache_length(conv.cache) == held


def test_a_seeded_draw_is_the_loops_and_the_next_turn_takes_the_loops_cache_onto_the_step(graphed, tiny_llama,
                                                                                         prefills):
    """A seed promises `generate`'s draws (the loop's); the next turn on the step copies the loop's cache in and
    prefills only its new tokens; a turn the loop answers then gets the step's positions as a cache of its own."""
    seeded = GenerationSettings(max_new_tokens=12, do_sample=True, top_k=20, seed=5)
    on, off = Conversation(graphed), Conversation(tiny_llama)
    assert turn(on, "Hello there.", seeded) == turn(off, "Hello there.", seeded)
    assert not isinstance(on.cache, GraphCache) and prefills == []
    held = cache_length(on.cache)
    assert turn(on, "And then?", GREEDY) == turn(off, "And then?", GREEDY)
    assert isinstance(on.cache, GraphCache) and prefills == [held]
    assert turn(on, "Once more.", seeded) == turn(off, "Once more.", seeded)  # (the loop, on a copy of the step's)
    assert on.ids == off.ids and not isinstance(on.cache, GraphCache)


@pytest.mark.parametrize("bias", [0.0, 8.0], ids=["answers", "wants-a-memory"])
def test_with_nothing_to_read_the_step_suppresses_recall_in_its_graph(graphed, tiny_llama, bias):
    """No bank: `NoMemory` runs inside the step's graph (its kind, not the fallback); the loop's tokens, and the same
    record of whether the model wanted a memory (`<recall>` raised by a bias: it did)."""
    settings = GenerationSettings(max_new_tokens=10, sequence_bias=(((graphed.tokens.recall,), bias),))
    results = []
    for lm in (graphed, tiny_llama):
        events = list(Conversation(lm).stream("Who keeps the lighthouse?", settings=settings))
        results.append((told(events), events[-1].result.missed_recall))
    assert results[0] == results[1] and results[0][1] == [bias > 0]
    sampler = graph.attached(graphed.merged()).graph.sampler  # (set only when NoMemory has its tensor form)
    assert bool(sampler.suppress[0, graphed.tokens.recall]) and bool(sampler.suppress[0, graphed.tokens.memory_pad])


def test_a_top_p_that_would_keep_only_recall_still_answers(graphed, tiny_llama):
    """`NoMemory` suppresses before the warpers: with `<recall>` far ahead and top-p 0.5 (which kept it alone, and
    NoMemory then took it: the loop's draw failed on all -inf scores, the step's drew token 0), both answer."""
    for lm, seed in ((graphed, None), (tiny_llama, 3)):  # (unseeded: on the step; seeded: in the loop)
        settings = GenerationSettings(max_new_tokens=6, do_sample=True, top_p=0.5, seed=seed,
                                      sequence_bias=(((lm.tokens.recall,), 12.0),))
        events = list(Conversation(lm).stream("Who keeps the lighthouse?", settings=settings))
        tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
        assert len(tokens) >= 1 and 0 not in tokens and lm.tokens.recall not in tokens
        assert events[-1].result.missed_recall == [True]


def test_a_recall_with_nothing_at_min_score_reads_nothing_on_the_step_as_in_the_loop(graphed, tiny_llama, bank):
    """A bank keyed by `<recall>` states, nothing in it at `min_score`, a model that closes its memories: each
    `<recall>` (forced first, then written mid-answer) reads an empty memory, `</recall>` alone, on the step as in
    the loop: the same events and ids, no vector, and the result says the recall was missed."""
    import dataclasses
    from models.encoder import MemoryEncoder

    on, off = (dataclasses.replace(lm, encoder=MemoryEncoder(close="</recall>")) for lm in (graphed, tiny_llama))
    strict = RecallSettings(min_score=0.9)
    results = []
    for lm in (on, off):
        conv = Conversation(lm)
        events = list(conv.stream("Who am I?", settings=recalling(lm), recall=strict, memory_db=bank,
                                  recall_first=True))
        results.append((told(events), conv.ids, sorted(conv.memory), events[-1].result.missed_recall))
        assert isinstance(conv.cache, GraphCache) == (lm is on)  # (answered on the step)
    assert results[0] == results[1]
    ids = results[0][1]
    at = [i for i, t in enumerate(ids) if t == on.tokens.recall]
    assert len(at) >= 2 and all(ids[i + 1] == on.tokens.recall_end for i in at if i + 1 < len(ids))
    assert results[0][2] == [] and results[0][3] == [True] and not any(e[0] == "recall" for e in results[0][0])


def test_a_memory_past_the_steps_cache_ends_the_answer_before_its_recall(graphed, monkeypatch):
    """A memory wider than `max_slots` (the step reserves room for one of `max_slots`) that does not fit in what is
    left of the step's cache: the answer ends there, "length", its own `<recall>` dropped and nothing injected; the
    conversation's handle holds the prompt, and the next answer on the step is the loop's."""
    from decoding.engine import Engine
    from decoding.events import FinishEvent
    from decoding.loop import stream_generate
    from decoding.request import Prompt
    from tests_helpers import kv_recall

    decoder = graph.attached(graphed.merged())
    monkeypatch.setattr(decoder, "max_slots", 0)  # (takes what leaves no room for any memory)
    t = graphed.tokens
    recall = kv_recall(graphed.model, (t.recall, t.memory_pad, t.recall_end), n=2, slots=(40, 40))
    ids = graphed.tokenizer(" ".join(["word"] * 800), return_tensors="pt").input_ids[:, :480]  # 480 + 4 + 17 < 512
    settings = GenerationSettings(max_new_tokens=4, sequence_bias=(((t.recall,), 30.0),))
    events = list(Engine(graphed).stream(Prompt({"input_ids": ids}), settings, recall))
    result = events[-1].result
    assert [e.reason for e in events if isinstance(e, FinishEvent)] == ["length"]
    assert not any(isinstance(e, RecallEvent) for e in events) and result.injections == []
    assert torch.equal(result.sequences, ids)  # (the `<recall>` it wrote is dropped)
    assert isinstance(result.cache, GraphCache) and result.cache.valid() == len(ids[0]) - 1
    short = ids[:, :12]
    after = list(Engine(graphed).stream(Prompt({"input_ids": short}), GREEDY, None))
    assert told(after) == told(list(stream_generate(graphed.merged(), {"input_ids": short}, GREEDY,
                                                    tokenizer=graphed.tokenizer)))
    assert isinstance(after[-1].result.cache, GraphCache)  # (on the step)

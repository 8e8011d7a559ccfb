"""The chat service without Gradio: the worker queue, stopping, sessions, banks, rendering."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import threading
import time

import numpy as np
import pytest
import torch

from chat import operations as ops
from chat.banks import parse_ids
from chat.config import ConfigError, load_config, request_settings
from chat.service import Service
from chat.view import (
    TurnView, bank_sample, bank_summary, chat_messages, found_table, inline_text, recall_table, segments, status_line,
)
from chat.worker import Failed, Notice, Request, ServiceError, Waiting
from chat.textsearch import TextSearch
from decoding.events import DoneEvent, FinishEvent, RecallEvent, TokenEvent
from decoding.settings import GenerationSettings, RecallSettings
from memory import MemoryVectorDB
from models.modeling import backbone_and_head
from tests_helpers import Evil, bank_file, drain, result

GREEDY = GenerationSettings(max_new_tokens=8)
NO_RECALL = RecallSettings(enabled=False)


def config(*overrides: str):
    """The configuration of these tests; no background compile of the shared tiny models (a compile thread left
    running would attach a compiled step to a session-wide model and draw on torch's global random state while
    later tests sample from it), but where a test asks for it."""
    return load_config(overrides=["generation.max_new_tokens=8", "model.compile=false", *overrides], environ={})


@pytest.fixture(scope="module")
def text_search():
    return TextSearch()


@pytest.fixture
def service(tiny_llama, text_search):
    svc = Service(config(), tiny_llama, text_search=text_search)
    yield svc
    svc.close()


def result_error(req: Request) -> str:
    req.done.wait(10)
    return req.error


class Slow:
    """A forward hook on the backbone: sleeps each step, and calls `on_step(n)` after forward n."""

    def __init__(self, lm, seconds: float = 0.0, on_step=None):
        self.n, self.seconds, self.on_step = 0, seconds, on_step
        self.handle = backbone_and_head(lm.model)[0].register_forward_hook(self)

    def __call__(self, *_):
        self.n += 1
        time.sleep(self.seconds)
        if self.on_step:
            self.on_step(self.n)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.handle.remove()


# --------------------------------------------------------------------------- chatting


def test_chat_streams_and_stores_the_turn(service):
    s = service.new_session()
    turn = service.chat(s, "Hello there", [], GREEDY, NO_RECALL)
    events = drain(turn.request)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert len(tokens) == 8 and isinstance(events[-1], DoneEvent)
    assert [m.role for m in s.conv.messages] == ["user", "assistant"]
    assert turn.request.reason == "length" and turn.request.steps == 8
    assert s.last_speed and s.last_speed > 0
    assert chat_messages(service.state(s).messages)[0] == {"role": "user", "content": ["Hello there"]}


def test_empty_message_is_refused(service):
    with pytest.raises(ServiceError, match="type a message"):
        service.chat(service.new_session(), "  ", [], GREEDY, NO_RECALL)


def test_stop_ends_generation_within_one_step_and_keeps_the_text(service, tiny_llama):
    s = service.new_session()
    stop_after = 6

    def on_step(n):
        if n == stop_after:  # forward 1 is the prefill, so `stop_after` tokens exist after this step
            service.stop(s)

    with Slow(tiny_llama, on_step=on_step):
        turn = service.chat(s, "Tell me a long story", [], GenerationSettings(max_new_tokens=400), NO_RECALL)
        result(turn.request)
    req = turn.request
    assert req.reason == "interrupted"
    assert req.steps <= stop_after + 1  # the loop checks the event every step
    assert req.finished >= req.stop_requested
    answer = s.conv.messages[-1]
    assert answer.role == "assistant" and answer.finish_reason == "interrupted"
    assert len(s.conv.ids) - answer.start == req.steps
    # the next message works normally
    nxt = service.chat(s, "And then?", [], GenerationSettings(max_new_tokens=3), NO_RECALL)
    result(nxt.request)
    assert nxt.request.reason == "length" and len(s.conv.messages) == 4


@pytest.mark.parametrize("stop_after", [1, 2])
def test_a_stop_in_the_middle_of_a_recall_leaves_nothing_half_done(service, tiny_llama, stop_after):
    s = service.new_session()
    result(service.banks.build_example(s))
    recall_id, pad_id = tiny_llama.tokens.recall, tiny_llama.tokens.memory_pad
    always_recall = GenerationSettings(max_new_tokens=50, sequence_bias=[[[recall_id], 100.0]])

    def on_step(n):
        if n == stop_after:
            service.stop(s)

    with Slow(tiny_llama, on_step=on_step):
        result(service.chat(s, "hi", [], always_recall, RecallSettings()).request)
    answer = s.conv.messages[-1]
    generated = s.conv.ids[answer.start:]
    if stop_after == 1:  # stopped after <recall>, before its memory: the <recall> is dropped
        assert generated == [] and answer.recalls == [] and s.conv.memory == {}
    else:  # stopped after the memory: the recall is whole
        assert generated == [recall_id, pad_id] and [r.position for r in answer.recalls] == [answer.start + 1]
        assert sorted(s.conv.memory) == [answer.start + 1]
    assert s.conv.cache.get_seq_length() == len(s.conv.ids) - 1
    nxt = service.chat(s, "next", [], GenerationSettings(max_new_tokens=3), NO_RECALL)
    result(nxt.request)
    assert nxt.request.reason == "length"


def test_sessions_share_the_model_and_one_sessions_stop_never_stops_another(service, tiny_llama):
    a, b = service.new_session(), service.new_session()
    with Slow(tiny_llama, seconds=0.002):
        ta = service.chat(a, "first", [], GenerationSettings(max_new_tokens=300), NO_RECALL)
        while ta.request.steps < 2:
            time.sleep(0.005)
        tb = service.chat(b, "second", [], GenerationSettings(max_new_tokens=6), NO_RECALL)
        result(tb.request)  # b's short answer is written while a's long one goes on: they take turns
        assert tb.request.reason == "length" and tb.request.steps == 6 and not ta.request.done.is_set()
        tb2 = service.chat(b, "second again", [], GenerationSettings(max_new_tokens=300), NO_RECALL)
        while tb2.request.steps < 2:
            time.sleep(0.005)
        assert service.stop(b) == [tb2.request]  # b stops its own answer...
        result(tb2.request)
        steps = ta.request.steps
        while ta.request.steps < steps + 3:
            time.sleep(0.005)
        assert not ta.request.done.is_set()  # ...and a keeps going
        service.stop(a)
        result(ta.request)
    assert ta.request.reason == "interrupted" and tb2.request.reason == "interrupted"
    assert [m.role for m in b.conv.messages] == ["user", "assistant"] * 2


def _plan(i: int) -> tuple[GenerationSettings, bool]:
    """Session i's settings (all different) and whether it recalls first from the example bank."""
    return (GenerationSettings(max_new_tokens=24 + 3 * i, repetition_penalty=1.0 + 0.1 * (i % 3),
                               no_repeat_ngram_size=i % 2 * 3, stop_strings=("zzzz",) if i == 4 else ()),
            i % 2 == 1)


def _converse(svc: Service, together: bool, stop_at: dict[int, int]) -> tuple[list, int]:
    """Two turns for each of 8 sessions (stopped ones: one), all at once or one session after another;
    every session's token ids and recalls, and the most answers one forward carried."""
    sessions = [svc.new_session() for _ in range(8)]
    for i, s in enumerate(sessions):
        if _plan(i)[1]:
            result(svc.banks.build_example(s))
    for turn in range(2):
        todo = [i for i in range(8) if turn == 0 or i not in stop_at]
        chats = {}
        for i in todo:
            settings, recall_first = _plan(i)
            chats[i] = svc.chat(sessions[i], f"Question {turn} of session {i}?", [], settings, RecallSettings(),
                                recall_first=recall_first)
            if not together:
                result(chats[i].request)
        while turn == 0 and stop_at and not all(chats[i].request.done.is_set() for i in chats):
            for i, steps in stop_at.items():
                if chats[i].request.steps >= steps:
                    svc.stop(sessions[i])
            time.sleep(0.001)
        for i in todo:
            result(chats[i].request)
    return [(s.conv.ids, [(r.position, r.memory_index, m.finish_reason) for m in s.conv.messages for r in m.recalls],
             s.conv.messages[-1].finish_reason) for s in sessions]


def test_eight_sessions_decode_together_and_each_gets_what_it_gets_alone(tiny_llama, text_search):
    """Eight sessions of mixed settings, half recalling from a bank, two turns each (the second on the
    cache the first left), two stopped mid-answer: batched, every session's tokens and recalls are those
    it gets running alone, and the answers did share forwards."""
    stop_at = {2: 5, 5: 9}
    alone_svc = Service(config(), tiny_llama, text_search=text_search)
    try:
        alone = _converse(alone_svc, together=False, stop_at={})
    finally:
        alone_svc.close()
    svc = Service(config(), tiny_llama, text_search=text_search)
    try:
        together = _converse(svc, together=True, stop_at=stop_at)
        batch = svc.worker.batch
        assert batch.forwards > 20 and batch.rows_run / batch.forwards > 3  # several answers per forward
    finally:
        svc.close()
    for i, ((ids, recalls, reason), (ids1, recalls1, _)) in enumerate(zip(together, alone)):
        if i in stop_at:  # its one answer stopped: a prefix of the answer it gets alone
            assert reason == "interrupted" and ids == ids1[:len(ids)], i
        else:
            assert ids == ids1 and recalls == recalls1 and reason != "interrupted", i
    assert sum(bool(r) for _, r, _ in alone) >= 3  # the recalling sessions did recall


def test_a_failed_batch_round_fails_its_answers_and_the_worker_goes_on(service, monkeypatch):
    """The batch's cache cannot be built (out of memory, simulated, when a third answer joins): the answers
    of that round fail with the message, nothing is stored half, and the worker serves the next request."""
    import decoding.batch

    real, calls = decoding.batch.static_cache, []

    def flaky(model, needed):
        calls.append(needed)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return real(model, needed)

    monkeypatch.setattr(decoding.batch, "static_cache", flaky)
    sessions = [service.new_session() for _ in range(3)]
    turns = [service.chat(s, f"Question {i}?", [], GenerationSettings(max_new_tokens=30), NO_RECALL)
             for i, s in enumerate(sessions)]
    for t in turns:
        assert t.request.done.wait(60)
    failed = [t for t in turns if t.request.error]
    assert failed and all("out of memory (simulated)" in t.request.error for t in failed)
    for t, s in zip(turns, sessions):
        assert [m.role for m in s.conv.messages] == ([] if t.request.error else ["user", "assistant"])
    monkeypatch.setattr(decoding.batch, "static_cache", real)
    again = [service.chat(s, "Once more?", [], GREEDY, NO_RECALL) for s in sessions]
    for t in again:
        result(t.request)
        assert t.request.error is None and t.request.steps > 0
    assert service.worker.batch.seats == []


def test_a_sessions_second_message_waits_and_a_stop_while_queued_keeps_it(service, tiny_llama):
    s = service.new_session()
    with Slow(tiny_llama, seconds=0.002):
        first = service.chat(s, "first", [], GenerationSettings(max_new_tokens=300), NO_RECALL)
        while first.request.steps < 2:
            time.sleep(0.005)
        second = service.chat(s, "second", [], GenerationSettings(max_new_tokens=6), NO_RECALL)
        assert second.request.events.get(timeout=5) == Waiting(1)  # one session: one answer at a time
        assert not second.request.started
        assert service.stop(s) == [first.request, second.request]
        result(first.request), result(second.request)
    assert second.request.started is None and second.request.reason == "interrupted"
    roles = [(m.role, m.text) for m in s.conv.messages]
    assert roles[2] == ("user", "second") and roles[3] == ("assistant", "")  # kept, unanswered
    assert s.conv.messages[3].finish_reason == "interrupted"
    assert "(stopped)" in chat_messages(service.state(s).messages)[3]["content"]
    nxt = service.chat(s, "third", [], GenerationSettings(max_new_tokens=3), NO_RECALL)
    result(nxt.request)
    assert nxt.request.reason == "length"


def test_answers_past_max_running_wait_in_the_queue_and_start_as_one_ends(tiny_llama, text_search):
    svc = Service(config("app.max_running=2"), tiny_llama, text_search=text_search)
    try:
        sessions = [svc.new_session() for _ in range(3)]
        with Slow(tiny_llama, seconds=0.002):
            turns = [svc.chat(s, f"question {i}", [], GenerationSettings(max_new_tokens=40 - 30 * (i == 0)),
                              NO_RECALL) for i, s in enumerate(sessions)]
            third = turns[2].request
            while not (turns[0].request.started and turns[1].request.started):
                time.sleep(0.005)
            assert third.started is None  # two run, the third waits its turn
            places = []
            while not places or places[-1] != Waiting(0):
                places.append(third.events.get(timeout=10))
            assert Waiting(1) in places  # first in the queue, then started
            for t in turns:
                result(t.request)
        assert all(t.request.error is None for t in turns)
        assert third.started >= turns[0].request.finished  # it started when the short first answer ended
        assert svc.worker.max_running == 2
    finally:
        svc.close()


def test_regenerate_replaces_the_last_answer(service):
    s = service.new_session()
    with pytest.raises(ServiceError, match="no answer to regenerate"):
        service.regenerate(s, GREEDY, NO_RECALL)
    result(service.chat(s, "Hi", [], GREEDY, NO_RECALL).request)
    first = s.conv.messages[-1].text
    turn = service.regenerate(s, GREEDY, NO_RECALL)
    notices = [e.text for e in drain(turn.request) if isinstance(e, Notice)]
    assert len(s.conv.messages) == 2 and s.conv.messages[-1].text == first  # greedy: the same answer again
    assert turn.shown == service.state(s).messages[:1]
    assert any("decoding is greedy" in n for n in notices)  # (and it says why: the button looked broken)
    sampled = drain(service.regenerate(s, dataclasses.replace(GREEDY, do_sample=True), NO_RECALL).request)
    assert not any("decoding is greedy" in e.text for e in sampled if isinstance(e, Notice))


def test_the_model_reads_the_last_history_turns_and_the_page_shows_every_turn(tiny_llama, text_search, tmp_path):
    svc = Service(config("app.history_turns=3"), tiny_llama, text_search=text_search)
    texts = ["First", "Second", "Third", "Fourth", "Fifth", "Sixth"]
    try:
        s = svc.new_session()
        read, notices = [], []
        for text in texts:
            events = drain(svc.chat(s, text, [], GREEDY, NO_RECALL).request)
            read.append([m.text for m in s.conv.messages if m.role == "user"])
            notices.append([e.text for e in events if isinstance(e, Notice)])
        # at most 3 earlier turns read; past them, the oldest go down to 1 (the kept turns are read again)
        assert read[3] == texts[:4] and read[4] == ["Fourth", "Fifth"] and read[5] == ["Fourth", "Fifth", "Sixth"]
        assert notices[4] == ["from here the model reads at most your last 3 turns (app.history_turns); the earlier "
                              "ones stay in the conversation, and what you told it stays in your memory"]
        assert notices[:4] == [[]] * 4 and notices[5] == []  # (said once a conversation)
        shown = svc.state(s).messages
        assert [m.text for m in shown if m.role == "user"] == texts
        assert [m.role for m in shown] == ["user", "assistant"] * 6
    finally:
        svc.close()
    for overrides, turns in (((), 3), ((f"model.path={tmp_path}",), 0)):  # auto: 3 on the embedded model, else all
        svc = Service(config(*overrides), tiny_llama, text_search=text_search)
        assert svc.window.turns == turns
        svc.close()
    with pytest.raises(ValueError, match="history_turns is -1; allowed: auto, or a whole number of turns"):
        config("app.history_turns=-1")


def test_clear_and_save_load_conversation(service, tmp_path):
    s = service.new_session()
    with pytest.raises(ServiceError, match="no conversation"):
        service.run(ops.save_conversation, s)
    result(service.chat(s, "Remember me", [], GREEDY, NO_RECALL).request)
    path = service.run(ops.save_conversation, s)
    other = service.new_session()
    service.run(ops.load_conversation, other, path)
    assert [m.text for m in other.conv.messages] == [m.text for m in s.conv.messages]
    assert other.conv.ids == s.conv.ids
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(ServiceError, match="not a conversation this model can continue: format"):
        service.run(ops.load_conversation, other, bad)
    assert len(other.conv.messages) == 2  # untouched
    with s.lock:  # (an answer being written: a save waited for its end, silently)
        with pytest.raises(ServiceError, match="an answer is being written: save once it has ended, or Stop it"):
            service.run(ops.save_conversation, s)
    service.run(ops.clear, s)
    assert s.conv.messages == [] and s.conv.ids == []


def test_text_only_model_answers_the_text_and_says_the_image_was_not_sent(service, small_image):
    s = service.new_session()
    turn = service.chat(s, "What is this?", [str(small_image)], GREEDY, NO_RECALL)
    events = drain(turn.request)
    notice = next(e for e in events if isinstance(e, Notice))
    assert "reads text only" in notice.text and "answering the text alone" in notice.text
    assert s.conv.messages[0].images == [] and s.conv.messages[1].role == "assistant"
    view = TurnView()
    for e in events:
        view.apply(e)
    assert "reads text only" in view.state
    only_image = service.chat(s, "", [str(small_image)], GREEDY, NO_RECALL)
    assert "no text to answer" in result_error(only_image.request)
    assert len(s.conv.messages) == 2


def test_vision_model_reads_images_and_writes_image_memories(tiny_qwen3vl, small_image, text_search):
    svc = Service(config(), tiny_qwen3vl, text_search=text_search)
    try:
        s = svc.new_session()
        turn = svc.chat(s, "Describe the picture", [str(small_image)], GREEDY, NO_RECALL)
        result(turn.request)
        assert turn.request.reason in ("length", "stop")
        assert s.conv.messages[0].images == [str(small_image)]
        assert chat_messages(svc.state(s).messages)[0]["content"][0] == {"path": str(small_image)}
        ids = result(svc.banks.write(s, "a gradient", [str(small_image)]))
        db = svc.banks.of(s)
        assert ids == [0, 1] and db.dim == 64 and db.text(1) == "[image] gradient.png"
    finally:
        svc.close()


def test_image_memories_need_a_vision_model(service, small_image):
    s = service.new_session()
    assert "reads text only" in result_error(service.banks.write(s, "", [str(small_image)]))
    assert service.banks.of(s) is None


# --------------------------------------------------------------------------- recall and rendering


def test_recall_first_injects_a_memory_and_the_view_matches_the_stored_answer(service):
    s = service.new_session()
    assert result(service.banks.build_example(s)) == 36
    assert s.bank_use == "example" and len(service.banks.example) == 36
    turn = service.chat(s, "Who keeps the lighthouse?", [], GREEDY, RecallSettings(), recall_first=True)
    view = TurnView()
    for e in drain(turn.request):
        view.apply(e)
    view.done = True
    label = view.segments[0][1]
    assert label is not None and label.startswith("memory ") and view.segments[0][0].startswith("⟨memory #")
    assert view.recalls[0].position == s.conv.messages[-1].start  # the first answer token
    assert segments(service.state(s).messages[1].pieces) == view.segments
    assert inline_text(view.segments).startswith(f"`⟨memory #{view.recalls[0].memory_index} · ")
    table = recall_table(service.state(s).messages)
    assert list(table.columns) == ["turn", "position", "slots", "score", "memory", "text"]
    assert table.iloc[0]["memory"] == view.recalls[0].memory_index and table.iloc[0]["text"]


def test_a_bank_of_another_layout_beside_your_memories_still_answers_from_yours(default_lm, tmp_path):
    """On the default model, a session bank of bare state vectors (a keys-only .npy upload) beside the user's
    memories, which are keyed by text: joining them raised, and a message about the user got no answer at all. Now it
    reads the user's memories alone, and says why."""
    svc = Service(config(f"memory.user_dir={tmp_path / 'users'}"), default_lm)
    try:
        s = svc.new_session("ada")
        assert result(svc.run(ops.remember, s, "My dog is called Pocket.")).written
        np.save(tmp_path / "states.npy", np.random.default_rng(0).standard_normal((5, default_lm.hidden_size),
                                                                                 dtype=np.float32))
        said = ops.upload_bank(svc, s, tmp_path / "states.npy")  # (it recalled the wrong memories, unsaid)
        assert said.startswith("bank uploaded: states.npy, 5 memories · ⚠ this bank holds bare vectors (key = value) "
                               "with no record of what wrote them") and "it may recall the wrong ones" in said
        events = drain(svc.chat(s, "What is my dog's name?", [], GREEDY, RecallSettings()).request)
        notices = [e.text for e in events if isinstance(e, Notice)]
        assert any("expected a bank of the same layout as yours (384-d keys, token values), got 576-d keys, no values "
                   "(key = value): the two cannot be searched as one, so this message reads your own memories alone"
                   in n
                   for n in notices), notices
        assert not any(isinstance(e, Failed) for e in events) and isinstance(events[-1], DoneEvent)
        assert [r.text for r in events if isinstance(r, RecallEvent)] == ["The user's dog is called Pocket."]
    finally:
        svc.close()


def test_recall_first_without_a_bank_says_so(service):
    s = service.new_session()
    turn = service.chat(s, "Hi", [], GREEDY, RecallSettings(), recall_first=True)
    events = drain(turn.request)
    assert Notice("recall first needs a memory bank and recall enabled; answering without") in events
    assert s.conv.ids[s.conv.messages[-1].start - 1] != service.lm.tokens.recall


def test_turn_view_states():
    view = TurnView()
    view.apply(Waiting(2))
    assert view.state == "waiting: 2 ahead"
    view.apply(Waiting(0))
    assert view.state == "reading the prompt…"
    view.apply(RecallEvent(0, 10, 0.8412, 3, "Mira keeps the light"))
    view.apply(TokenEvent(0, 5, 11, ""))
    view.apply(TokenEvent(0, 6, 12, "Hello"))
    view.apply(TokenEvent(0, 7, 13, " world"))
    assert view.segments == [("⟨memory #3: Mira keeps the light⟩", "memory 0.84"), ("Hello world", None)]
    assert view.state == "generating… 3 tokens"
    view.apply(FinishEvent(0, "interrupted"))
    view.done = True
    assert view.state == "stopped after 3 tokens"
    assert inline_text(view.segments) == "`⟨memory #3 · 0.84⟩`Hello world"
    failed = TurnView()
    failed.apply(Failed("boom"))
    assert failed.state == "⚠ boom"


def test_follow_batches_updates_and_stops_the_request_when_abandoned(tiny_llama, text_search):
    svc = Service(config("app.ui_updates_per_second=10"), tiny_llama, text_search=text_search)
    s = svc.new_session()

    async def consume(n_tokens: int, abandon_after: int | None):
        turn = svc.chat(s, "Count", [], GenerationSettings(max_new_tokens=n_tokens), NO_RECALL)
        stamps = []
        async for t in svc.follow(turn):
            stamps.append((time.monotonic(), t.view.tokens, t.view.done))
            if abandon_after is not None and t.view.tokens >= abandon_after:
                break
        return turn, stamps

    try:
        with Slow(tiny_llama, seconds=0.01):
            turn, stamps = asyncio.run(consume(40, None))
            assert stamps[-1][1:] == (40, True)
            assert len(stamps) < 40
            gaps = [b[0] - a[0] for a, b in zip(stamps[:-2], stamps[1:-1])]  # the last one is sent at once
            assert min(gaps, default=1) >= 0.1 * 0.9
            turn, stamps = asyncio.run(consume(400, abandon_after=2))
            result(turn.request)
        assert turn.request.reason == "interrupted" and turn.request.steps < 400
    finally:
        svc.close()


# --------------------------------------------------------------------------- settings


def test_request_settings_take_the_ui_values_and_raise_the_engine_message():
    cfg = config()
    gen, rec = request_settings(cfg, {"generation.temperature": 0.5, "generation.top_k": 7, "generation.seed": 3,
                                      "recall.top_k": 2, "recall.use_sampling": True})
    assert (gen.temperature, gen.top_k, gen.seed, gen.max_new_tokens) == (0.5, 7, 3, 8)
    assert (rec.top_k, rec.use_sampling) == (2, True)
    with pytest.raises(ValueError, match="temperature is 0.0 with do_sample=True"):
        request_settings(cfg, {"generation.do_sample": True, "generation.temperature": 0.0})
    with pytest.raises(ValueError, match="typical_p is 0.0"):
        request_settings(cfg, {"generation.typical_p": 0.0})
    with pytest.raises(ValueError, match="temperature is 0.0 with use_sampling=True"):
        request_settings(cfg, {"recall.use_sampling": True, "recall.temperature": 0.0})
    gen, _ = request_settings(cfg, {"mixture.enabled": True, "mixture.alpha": 0.25, "generation.top_k": 3})
    assert (gen.mixture.enabled, gen.mixture.alpha, gen.mixture.gamma, gen.top_k) == (True, 0.25, 4, 3)
    with pytest.raises(ValueError, match="mixture alpha is 1.5"):
        request_settings(cfg, {"mixture.alpha": 1.5})
    for misspelt in ("generation.temprature", "temperature", "recall.topk", "memory.top_k", "mixture.gama"):
        with pytest.raises(ConfigError, match="unknown setting"):
            request_settings(cfg, {misspelt: 0.5})


def test_parse_ids():
    assert parse_ids("3, 5-7 9") == [3, 5, 6, 7, 9]
    for bad in ("", "x", "7-3"):
        with pytest.raises(ServiceError):
            parse_ids(bad)


# --------------------------------------------------------------------------- banks




def test_upload_bank_and_refusals_keep_the_current_bank(tmp_path, tiny_llama, text_search):
    svc = Service(config("memory.max_upload_mb=1"), tiny_llama, text_search=text_search)
    try:
        s = svc.new_session()
        for ext in (".pt", ".safetensors", ".npy"):
            said = svc.banks.upload(s, bank_file(tmp_path / f"good{ext}", 64))
            assert said.startswith(f"bank uploaded: good{ext}, 3 memories")
            assert len(svc.banks.of(s)) == 3 and s.bank_use == "own" and s.own_label == f"your upload good{ext}"
        current = svc.banks.of(s)
        marker = tmp_path / "pwned"
        torch.save({"embeddings": Evil(marker)}, tmp_path / "evil.pt")
        (tmp_path / "corrupt.pt").write_bytes(b"\x00" + os.urandom(2000))  # (not a zip's or a pickle's start)
        (tmp_path / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + bytes(64))
        np.save(tmp_path / "big.npy", np.ones((600, 576), np.float32))
        (tmp_path / "bank.txt").write_text("hello")
        cases = {bank_file(tmp_path / "wrong.pt", 576): "dimension 64, got dimension 576",
                 tmp_path / "evil.pt": "corrupt or refused",
                 tmp_path / "corrupt.pt": "expected a PyTorch .pt file, got other bytes",
                 tmp_path / "corrupt.safetensors": "corrupt or refused", tmp_path / "big.npy": "over the limit",
                 tmp_path / "bank.txt": "expected a memory bank file"}
        for path, message in cases.items():
            with pytest.raises(ServiceError, match=message) as info:
                svc.banks.upload(s, path)
            assert "Traceback" not in str(info.value)
            assert svc.banks.of(s) is current and len(current) == 3
        assert not marker.exists()
    finally:
        svc.close()


def test_config_bank_is_shared_and_a_bad_one_stops_the_start(tmp_path, tiny_llama, text_search):
    good = bank_file(tmp_path / "shared.pt", 64, n=5)
    svc = Service(config(f"memory.bank={good}"), tiny_llama, text_search=text_search)
    try:
        a, b = svc.new_session(), svc.new_session()
        assert svc.banks.of(a) is svc.banks.of(b) is svc.banks.shared and len(svc.banks.shared) == 5
        assert "shared bank (shared.pt)" in bank_summary(svc.state(a, details=True).bank)
    finally:
        svc.close()
    bad = bank_file(tmp_path / "wide.pt", 32)  # the operator's own file: a start that cannot use it stops
    with pytest.raises(ServiceError, match=r"memory.bank '.*wide.pt' cannot be loaded: wide.pt: expected vectors of "
                                           r"dimension 64, got dimension 32"):
        Service(config(f"memory.bank={bad}"), tiny_llama, text_search=text_search)
    # a bank loads with the model: the start fails with its reason
    svc = Service(config(f"memory.bank={tmp_path / 'missing.pt'}"), loader=lambda: tiny_llama, text_search=text_search)
    try:
        with pytest.raises(ServiceError, match="memory.bank '.*missing.pt' cannot be loaded"):
            svc.start()
    finally:
        svc.close()


def test_writes_and_deletes_copy_a_shared_bank_first(service):
    a, b = service.new_session(), service.new_session()
    result(service.banks.build_example(a))
    result(service.banks.build_example(b))
    example = service.banks.example
    ids = result(service.banks.write(a, "Mira's boat is called the Heron.\n\n  The Heron is green.  "))
    assert ids == [36, 37] and a.bank_use == "own" and len(service.banks.of(a)) == 38
    assert len(example) == 36 and service.banks.of(b) is example  # b and the example bank are untouched
    assert service.banks.of(a).text(37) == "The Heron is green."
    assert result(service.banks.delete(b, "0-2")) == 33
    assert len(example) == 36 and b.bank_use == "own"
    assert "not in the bank" in result_error(service.banks.delete(b, "999"))
    with pytest.raises(ServiceError, match="no bank"):
        service.banks.delete(service.new_session(), "1")
    with pytest.raises(ServiceError, match="type the memories"):
        service.banks.write(a, " \n ")


def test_write_into_no_bank_creates_an_own_bank_then_find_and_save(service, tmp_path):
    s = service.new_session()
    assert "No memories" in bank_summary(service.state(s, details=True).bank)
    result(service.banks.write(s, "The cat sleeps on the stairs.\nThe ferry leaves at seven.\nBread on Tuesday."))
    summary = bank_summary(service.state(s, details=True).bank)
    assert "**3** memories" in summary and "your own bank" in summary
    found = found_table(service.banks.find(s, "a sleeping kitten", 2))
    assert list(found.columns) == ["memory", "similarity", "text"] and found.iloc[0]["text"].startswith("The cat")
    path = service.banks.save(s, ".safetensors")
    assert len(MemoryVectorDB.load(path)) == 3
    assert list(bank_sample(service.state(s, details=True).bank)["memory"]) == [0, 1, 2]
    with pytest.raises(ServiceError, match="no bank to search"):
        service.banks.find(service.new_session(), "cat")


# --------------------------------------------------------------------------- model loading


def test_the_model_loads_lazily_on_the_worker(tiny_llama, text_search):
    threads = []

    def loader():
        threads.append(threading.current_thread().name)
        return tiny_llama

    svc = Service(config(), loader=loader, text_search=text_search)
    try:
        s = svc.new_session()
        assert svc.lm is None and "loading…" in status_line(svc.state(s))
        turn = svc.chat(s, "Hi", [], GREEDY, NO_RECALL)  # queued: it loads the model first
        result(turn.request)
        assert svc.lm is tiny_llama and threads == ["recall-chat-model"]
        assert result(svc.ready()) == "tiny-llama" and len(threads) == 1
        assert "tiny-llama" in status_line(svc.state(s))
    finally:
        svc.close()


def test_the_decode_step_compiles_in_the_background(smollm2_dir, text_search, monkeypatch):
    from conftest import make_tiny_llama
    from decoding import compiled

    lm = make_tiny_llama(smollm2_dir, seed=5)
    go = threading.Event()
    warm_up = compiled.CompiledStep.warm_up
    monkeypatch.setattr(compiled.CompiledStep, "warm_up", lambda step: go.wait(60) and warm_up(step))
    svc = Service(config("model.compile=true"), loader=lambda: lm, text_search=text_search)
    try:
        s = svc.new_session()
        result(svc.chat(s, "Hi", [], GREEDY, NO_RECALL).request)  # answered while the step compiles
        eager = (list(s.conv.ids), type(s.conv.cache).__name__)
        step = compiled.attached(lm.model)
        assert step is not None and not step.ready.is_set() and "compiling the decode step" in status_line(svc.state(s))
        go.set()
        assert step.ready.wait(300) and step.error is None
        assert "compiling" not in status_line(svc.state(s))
        s.conv.clear()
        result(svc.chat(s, "Hi", [], GREEDY, NO_RECALL).request)
        assert (s.conv.ids, type(s.conv.cache).__name__) == (eager[0], "StaticCache")  # same answer, compiled
        assert eager[1] == "DynamicCache"
    finally:
        go.set()
        svc.close()


def test_a_model_still_loading_when_the_service_closes_starts_no_compile(smollm2_dir, text_search):
    from conftest import make_tiny_llama

    lm, loading, go = make_tiny_llama(smollm2_dir, seed=6), threading.Event(), threading.Event()

    def slow_load():
        loading.set()
        go.wait(60)
        return lm

    svc = Service(config("model.compile=true"), loader=slow_load, text_search=text_search)
    load = svc.ready()
    assert loading.wait(30)
    svc.close()  # the worker is still loading: close waits for it a while, then returns
    go.set()
    load.done.wait(30)
    time.sleep(0.2)  # (what the worker thread does after the load)
    assert svc.warm.running is None
    assert not [t for t in threading.enumerate() if t.name == "recall-chat-compile"]


def test_backend_auto_stays_on_transformers_for_what_only_it_runs():
    from chat.config import load_options
    from models.load import resolve_backend

    def backend(*overrides):
        return resolve_backend(load_options(config(*overrides)), None)

    assert backend() == "llamacpp"  # the embedded model on a CPU (llama-cpp-python is installed here)
    assert backend("generation.entropy_decoding=trough") == "transformers"
    assert backend("generation.mixture.enabled=true") == "transformers"
    assert backend("model.quantize=int8") == "transformers"
    assert backend("generation.guidance_scale=2") == "transformers"
    assert backend("memory.values=state") == "transformers"
    assert backend("memory.values=hidden:4") == "transformers"
    assert backend("model.backend=llamacpp", "generation.mixture.enabled=true") == "llamacpp"  # refused at the load


@pytest.mark.parametrize("setting", ["generation.entropy_decoding=trough", "generation.guidance_scale=2",
                                     "generation.mixture.enabled=true"])
def test_a_decoder_llama_cpp_cannot_run_stops_the_start_naming_its_key(setting):
    from chat.config import load_options
    from models.llamacpp import load_gguf_model

    key = setting.split("=")[0]
    with pytest.raises(ValueError, match=rf"{key} is switched on in the configuration, and the llama.cpp backend "
                                         "does not run it: switch it off, or set model.backend: transformers"):
        load_gguf_model(None, load_options(config("model.backend=llamacpp", setting)))


def test_configured_token_ids_the_model_lacks_stop_the_start(tiny_llama, text_search):
    svc = Service(config("generation.bad_words_ids=[[99999999]]"), loader=lambda: tiny_llama, text_search=text_search)
    try:
        with pytest.raises(ServiceError, match=r"generation.bad_words_ids: expected token ids below \d+ \(the "
                                               r"model's vocabulary\), got 99999999"):
            svc.start()
        assert svc.lm is None  # nothing half-loaded
    finally:
        svc.close()

@pytest.mark.parametrize("values,key", [("hidden:999", "memory.values"), ("hidden:-3", None)])
def test_a_memory_layer_the_model_lacks_stops_the_start(tiny_llama, text_search, values, key):
    """(`memory.values=hidden:999` started the app; then every bank and memory write said "layer 999: expected an
    index in [-31, 30]".)"""
    import dataclasses

    from models.encoder import MemoryEncoder
    from models.text_keys import TextEncoder

    lm = dataclasses.replace(tiny_llama, encoder=MemoryEncoder(values, TextEncoder(None)))  # (keys: loaded if used)
    svc = Service(config(), loader=lambda: lm, text_search=text_search)
    try:
        if key is None:  # (a layer it has: the start goes on)
            svc.start()
            assert svc.lm is lm
            return
        with pytest.raises(ServiceError, match=rf"{key}: layer 999 is not one of .*: expected an index in \[-3, 2\] "
                                               r"\(embeddings \+ 2 layers\)"):
            svc.start()
        assert svc.lm is None
    finally:
        svc.close()


def test_a_messages_embedding_is_made_on_another_thread_while_its_prompt_is_read(tiny_llama, text_search, tmp_path,
                                                                               monkeypatch):
    import dataclasses

    from chat.session import Conversation
    from models.encoder import MemoryEncoder
    from models.text_keys import TextEncoder

    keys = TextEncoder(adapter=None)
    lm = dataclasses.replace(tiny_llama, encoder=MemoryEncoder("tokens", keys, name="tiny", placement="answer",
                                                               close="</recall>"))
    where, reads = [], []
    encode, read = keys.encode, Conversation.read_ahead
    monkeypatch.setattr(keys, "encode", lambda texts, **kw: (  # where the key encoder runs (not a cache hit)
        any(t not in keys._cache for t in texts) and where.append(threading.current_thread().name)) or
        encode(texts, **kw))

    def reading(self, *args):
        reads.append((yield from read(self, *args)))
        return reads[-1]

    monkeypatch.setattr(Conversation, "read_ahead", reading)
    svc = Service(config(f"memory.user_dir={tmp_path}"), lm, text_search=text_search)
    try:
        s = svc.new_session()
        for text in ["My sister is called Lena.", "What is my sister's name?"]:
            where.clear()
            assert isinstance(drain(svc.chat(s, text, [], GREEDY, RecallSettings()).request)[-1], DoneEvent)
            # the write decision, the write and the recall found the message embedded: one batch, on the thread
            assert where and all(name.startswith("embed") for name in where), where
        assert reads == [True, True]
        assert [e["text"] for e in svc.personal(s).entries()] == ["The user's sister is called Lena."]
    finally:
        svc.close()


def test_the_no_memory_notice_names_the_reason_that_holds(bank):
    """(It listed every reason, "no bank, none close enough ..., or recall is off", with a bank loaded.)"""
    from chat.service import no_memory

    assert no_memory(bank, RecallSettings(enabled=False)).endswith("but recall is off: it answered from what it knows")
    assert "but there is no bank to read" in no_memory(None, RecallSettings())
    assert "none is close enough to the question (memory min score 0.9)" in no_memory(bank, RecallSettings(
        min_score=0.9))



def test_a_bank_the_models_own_encoder_wrote_is_uploaded_without_a_warning_and_a_bare_shared_one_is_logged(
        tmp_path, default_lm, caplog):
    """The warning of a bare-vector bank (`unstamped_note`) is for banks that record no encoder, on a model whose
    memories have keys of their own: one the model's encoder wrote (tokens values with text keys) is taken as it is;
    a bare one as the shared bank is said in the log at the start."""
    svc = Service(config(), default_lm)
    try:
        s = svc.new_session()
        result(svc.run(ops.write_memories, s, "The ferry leaves at seven.\nThe bakery opens at six.", []))
        svc.banks.of(s).save(tmp_path / "written.pt")
        assert svc.run(ops.upload_bank, s, tmp_path / "written.pt") == "bank uploaded: written.pt, 2 memories"
    finally:
        svc.close()
    bare = bank_file(tmp_path / "bare.pt", default_lm.hidden_size)
    with caplog.at_level("WARNING", logger="chat.banks"):
        Service(config(f"memory.bank={bare}"), default_lm).close()
    assert any("bare.pt: this bank holds bare vectors" in r.getMessage() for r in caplog.records)


def test_a_long_history_is_refused_by_its_texts_at_once_or_read_from_its_newest_turns(tiny_llama, text_search):
    """(499 messages of 20,000 characters were read one by one, then dropped a turn at a time: many minutes of the
    model for a refusal.) Past the budget by their texts alone, a history is refused before anything is read; with
    `context_overflow: drop_oldest` only its newest turns that fit are read, and the answer says so; the conversation
    then is the one those turns alone make."""
    long = [("user" if i % 2 == 0 else "assistant", "lorem ipsum dolor " * 200, []) for i in range(160)]
    svc = Service(config("app.history_turns=0"), tiny_llama, text_search=text_search)
    try:
        with pytest.raises(ServiceError, match=r"would have at least \d+ tokens with this message, over the limit"):
            svc.chat(svc.new_session(), "Hi", [], GREEDY, NO_RECALL, False, long)
    finally:
        svc.close()
    short = [("user" if i % 2 == 0 else "assistant", f"turn {i} " + "word " * 40, []) for i in range(40)]
    svc = Service(config("app.history_turns=0", "app.context_overflow=drop_oldest"), tiny_llama,
                  text_search=text_search)
    try:
        s = svc.new_session()
        events = drain(svc.chat(s, "Hi", [], GREEDY, NO_RECALL, False, short).request)
        read = len(s.conv.messages) - 2
        assert 0 < read < 40 and s.conv.messages[0].text == short[40 - read][1]
        assert any(re.match(r"the model reads the last \d+ of the 40 earlier messages", e.text)
                   for e in events if isinstance(e, Notice))
        alone = svc.new_session()
        drain(svc.chat(alone, "Hi", [], GREEDY, NO_RECALL, False, short[40 - read:]).request)
        assert alone.conv.ids == s.conv.ids
    finally:
        svc.close()


def test_a_history_that_opens_with_the_assistants_greeting_is_answered_from_its_first_users_message(
        tiny_llama, text_search):
    """(An OpenAI client's history often opens with the assistant's greeting: it was refused, "an assistant message
    must follow a user message".) The model reads from the first user's message on, and a notice says so."""
    svc = Service(config(), tiny_llama, text_search=text_search)
    try:
        s = svc.new_session()
        history = [("assistant", "Hello! How can I help?", []), ("user", "Hi.", []), ("assistant", "Hello.", [])]
        events = drain(svc.chat(s, "What is bread?", [], GREEDY, NO_RECALL, False, history).request)
        assert [m.text for m in s.conv.messages[:2]] == ["Hi.", "Hello."] and isinstance(events[-1], DoneEvent)
        assert any(e.text.startswith("the model reads the last 2 of the 3 earlier messages: from a user's message")
                   for e in events if isinstance(e, Notice))
    finally:
        svc.close()

"""Concurrent answers as rows of one graph step (`decoding/graph_rows.py`), on a CPU: the rows step runs eagerly
there, the same code the GPU replays. Conversations answering at once, joining and leaving at different rounds, are
each the loop's conversation alone, token for token and event for event: recalls mid-answer, a memory wider than
the widest span graph, a repetition penalty, nothing to read, a stop string, a stop, and later turns in the rows,
on the single-row step and in the loop."""

from __future__ import annotations

import threading

import pytest
import torch

from chat.session import Conversation
from conftest import make_tiny_llama
from decoding import graph, graph_rows
from decoding.batch import Batch
from decoding.engine import cache_length
from decoding.events import RecallEvent
from decoding.graph_stream import GraphCache
from decoding.memory import Recall
from decoding.settings import GenerationSettings, RecallSettings
from rounds import drive
from tests_helpers import kv_recall as memories, told


@pytest.fixture(scope="module")
def rowed(smollm2_dir):
    """The weights of `tiny_llama` (the same seed), with warmed-up rows of a graph step attached (3 rows, 256
    positions: the cache is compacted along the way)."""
    lm = make_tiny_llama(smollm2_dir)
    rows = graph_rows.enable_rows(lm.merged(), rows=3, max_len=256, spans=(9,), compile=False)
    rows.warm_up()
    assert rows.ready.is_set() and rows.decoder.error is None
    return lm


def recalling(lm, bias: float = 6.0, **kw) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=24, sequence_bias=(((lm.tokens.recall,), bias),), **kw)


def kv_recall(lm, n: int = 8, slots=(3, 20)) -> Recall:
    """Key/value memories of 3 to 20 value slots (wider than the 9-wide span graph: several replays)."""
    t = lm.tokens
    return memories(lm.model, (t.recall, t.memory_pad, t.recall_end), n, slots, seed=4)


def test_answers_at_once_in_the_rows_are_each_the_loops_alone(rowed, tiny_llama, bank):
    """Five conversations, three rows: they join at different rounds (what comes while every row is taken decodes
    in the loop's batch), recall mid-answer, one with a penalty and a stop string, one with nothing to read; each
    answer equals the loop's alone, and each cache holds its conversation's positions."""
    batch = Batch()
    plans = [("Who am I?", recalling(rowed), bank),
             ("Tell me a story.", GenerationSettings(max_new_tokens=20, repetition_penalty=1.3, stop_strings=("e",)),
              bank),
             ("And then?", recalling(rowed, 5.0), bank),
             ("What is the sea?", recalling(rowed, 8.0, do_sample=False), None),  # nothing to read: NoMemory
             ("Once more.", recalling(rowed), bank)]
    convs = [Conversation(rowed, batch=batch) for _ in plans]
    refs = [Conversation(tiny_llama) for _ in plans]
    got = drive(batch, [(2 * i, lambda c=c, p=p: c.stream(p[0], settings=p[1], memory_db=p[2]))
                        for i, (c, p) in enumerate(zip(convs, plans))])
    rows = graph_rows.attached_rows(rowed.merged())
    assert rows.replays > 20 and rows.free_rows() == 3
    recalls = 0
    for conv, ref, (text, settings, bank_), events in zip(convs, refs, plans, got):
        want = list(ref.stream(text, settings=settings, memory_db=bank_))
        assert told(events) == told(want), text
        assert conv.ids == ref.ids and conv.memory.keys() == ref.memory.keys()
        for p in conv.memory:
            torch.testing.assert_close(conv.memory[p], ref.memory[p])
        assert cache_length(conv.cache) == len(conv.ids) - 1
        recalls += sum(e[0] == "recall" for e in told(events))
        assert events[-1].result.missed_recall == want[-1].result.missed_recall
    assert recalls >= 4
    assert got[3][-1].result.missed_recall == [True]  # (nothing to read, and the model wanted a memory)
    in_rows = [isinstance(c.cache, GraphCache) and c.cache.step is rows.graph for c in convs]
    assert sum(in_rows) >= 3 and not all(in_rows)  # (two came while every row was taken: the loop answered them)
    # the next turns: the rows take each conversation's positions back (only the new tokens are read)
    more = drive(batch, [(0, lambda c=c: c.stream("Go on.", settings=recalling(rowed), memory_db=bank))
                         for c in convs[:3]])
    for conv, ref, events in zip(convs, refs, more):
        assert told(events) == told(list(ref.stream("Go on.", settings=recalling(rowed), memory_db=bank)))
        assert conv.ids == ref.ids and cache_length(conv.cache) == len(conv.ids) - 1


def test_prompts_of_answers_starting_together_are_read_in_one_forward(rowed, tiny_llama, bank, monkeypatch):
    """Three conversations start in one round: their prompts are read in one forward (`decoding.prompt_reads`), and
    their next turns, started together again, too, each on its conversation's own positions (of three lengths), one
    read 3 tokens a round beside the others; every answer equals the loop's alone, recalls included."""
    from decoding import prompt_reads

    sizes, read = [], prompt_reads.read_together
    monkeypatch.setattr(prompt_reads, "read_together", lambda turns: (sizes.append(len(turns)), read(turns)))
    batch = Batch()
    convs = [Conversation(rowed, batch=batch, prefill_chunk=c) for c in (512, 3, 512)]
    refs = [Conversation(tiny_llama) for _ in convs]
    turns = (["Who am I?", "Tell me a story about the sea.", "Hi."], ["Go on.", "And then what happened?", "Why?"])
    for texts in turns:
        got = drive(batch, [(0, lambda c=c, t=t: c.stream(t, settings=recalling(rowed), memory_db=bank))
                            for c, t in zip(convs, texts)])
        for conv, ref, text, events in zip(convs, refs, texts, got):
            assert told(events) == told(list(ref.stream(text, settings=recalling(rowed), memory_db=bank))), text
            assert conv.ids == ref.ids and cache_length(conv.cache) == len(conv.ids) - 1
            for (k, v), layer in zip(conv.cache.layers(), ref.cache.layers):  # (what a later turn attends to)
                torch.testing.assert_close(k, layer.keys[:, :, :k.shape[2]], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(v, layer.values[:, :, :v.shape[2]], atol=1e-5, rtol=1e-4)
        assert sizes[0] == 3, sizes  # (the round they start in: the three prompts, or their first chunks, at once)
        sizes.clear()
    assert graph_rows.attached_rows(rowed.merged()).free_rows() == 3


def test_memories_wider_than_the_span_graph_ride_several_replays(rowed, tiny_llama):
    """Memories of 3 to 20 slots (the span graph is 9 wide), three answers at once, one starting with `<recall>`:
    each the loop's alone (tokens, recalls, the memories' vectors); the others decode meanwhile."""
    from decoding.engine import Engine
    from decoding.loop import stream_generate
    from decoding.request import Prompt

    recall = kv_recall(rowed)
    batch = Batch()
    ids = [rowed.tokenizer(t, return_tensors="pt").input_ids for t in ("Who am I?", "A fact:", "Tell me.")]
    ids[2] = torch.cat([ids[2], torch.tensor([[rowed.tokens.recall]])], 1)
    settings = recalling(rowed, 5.0, repetition_penalty=1.1)
    got = drive(batch, [(i, lambda x=x: Engine(rowed, batch).stream(Prompt({"input_ids": x}), settings, recall))
                        for i, x in enumerate(ids)])
    rows = graph_rows.attached_rows(rowed.merged())
    widths = []
    for x, events in zip(ids, got):
        want = list(stream_generate(tiny_llama.merged(), {"input_ids": x}, settings, recall=recall,
                                    tokenizer=tiny_llama.tokenizer))
        assert told(events) == told(want)
        a, b = events[-1].result.memory_vectors[0], want[-1].result.memory_vectors[0]
        assert a.keys() == b.keys() and all(torch.equal(a[p], b[p]) for p in a)
        widths += [e.length for e in events if isinstance(e, RecallEvent)]
        assert isinstance(events[-1].result.cache, GraphCache) and events[-1].result.cache.step is rows.graph
    assert max(widths) > 9 and len(widths) >= 4 and rows.free_rows() == 3


def test_a_stop_in_the_rows_ends_that_answer_and_the_others_go_on(rowed, tiny_llama, bank):
    """One answer is stopped mid-way (within one replay); the other two, and the stopped conversation's next turn,
    are still the loop's."""
    batch = Batch()
    convs = [Conversation(rowed, batch=batch) for _ in range(3)]
    refs = [Conversation(tiny_llama) for _ in range(3)]
    stop = threading.Event()
    settings = GenerationSettings(max_new_tokens=30)
    starts = [(0, lambda: convs[0].stream("Hello there.", settings=settings, memory_db=bank)),
              (0, lambda: convs[1].stream("A long story.", settings=settings, interrupt_event=stop)),
              (1, lambda: convs[2].stream("Who am I?", settings=recalling(rowed), memory_db=bank))]
    original = batch.run
    calls = []

    def run():  # the stop comes at the 6th round
        calls.append(1)
        if len(calls) == 6:
            stop.set()
        original()

    batch.run = run
    got = drive(batch, starts)
    stopped = told(got[1])
    assert stopped[-1] == ("finish", "interrupted") and 3 <= len(stopped) - 1 <= 8
    assert told(got[0]) == told(list(refs[0].stream("Hello there.", settings=settings, memory_db=bank)))
    assert told(got[2]) == told(list(refs[2].stream("Who am I?", settings=recalling(rowed), memory_db=bank)))
    # the stopped conversation keeps what it said; its next turn is the loop's over the same ids
    refs[1].ids, refs[1].memory, refs[1].messages, refs[1].cache = list(convs[1].ids), {}, list(convs[1].messages), None
    nxt = drive(batch, [(0, lambda: convs[1].stream("Why?", settings=settings))])[0]
    assert told(nxt) == told(list(refs[1].stream("Why?", settings=settings)))


def test_what_the_rows_do_not_take_decodes_in_the_loop(rowed, tiny_llama):
    """A seeded draw and processors without a tensor form (a suppressed token) are the loop's; both answer as
    alone."""
    batch = Batch()
    rows = graph_rows.attached_rows(rowed.merged())
    for settings in (GenerationSettings(max_new_tokens=8, do_sample=True, seed=3),
                     GenerationSettings(max_new_tokens=8, suppress_tokens=(5,))):
        before = rows.replays
        conv, ref = Conversation(rowed, batch=batch), Conversation(tiny_llama)
        got = drive(batch, [(0, lambda: conv.stream("Hi.", settings=settings))])[0]
        assert told(got) == told(list(ref.stream("Hi.", settings=settings)))
        assert rows.replays == before and not isinstance(conv.cache, GraphCache)


def test_n_gram_bans_in_the_rows_are_each_the_loops_alone(rowed, tiny_llama, bank):
    """No-repeat n-gram bans of other sizes in three rows at once (one answer recalls: its memory's forced tokens
    are in the sequence the ban reads; one has none), and a second turn whose ban reads the first turn too: each the
    loop's conversation alone, and every answer decoded in the rows."""
    batch = Batch()
    rows = graph_rows.attached_rows(rowed.merged())
    plans = [("Tell me a story.", GenerationSettings(max_new_tokens=24, no_repeat_ngram_size=2)),
             ("Who am I?", recalling(rowed, no_repeat_ngram_size=3)),
             ("And then?", GenerationSettings(max_new_tokens=24))]
    convs, refs = [Conversation(rowed, batch=batch) for _ in plans], [Conversation(tiny_llama) for _ in plans]
    before = rows.replays
    for turn in (0, 1):
        texts = [text if turn == 0 else "Go on." for text, _ in plans]
        got = drive(batch, [(i, lambda c=c, t=t, p=p: c.stream(t, settings=p[1], memory_db=bank))
                            for i, (c, t, p) in enumerate(zip(convs, texts, plans))])
        for ref, text, (_, settings), events in zip(refs, texts, plans, got):
            assert told(events) == told(list(ref.stream(text, settings=settings, memory_db=bank))), (turn, text)
        assert all(isinstance(c.cache, GraphCache) and c.cache.step is rows.graph for c in convs)
    assert rows.replays > before + 40 and any(e[0] == "recall" for e in told(got[1]))


def test_sampled_answers_in_the_rows_draw_as_alone(rowed):
    """Unseeded sampling draws each row's tokens from its own hashed noise (its own seed and commits, not its row):
    two answers sampled at once, each replayed alone in the rows with the same seed, draw the same tokens."""
    rows = graph_rows.attached_rows(rowed.merged())
    settings = GenerationSettings(max_new_tokens=16, do_sample=True, temperature=1.5, top_k=50, top_p=0.95,
                                  repetition_penalty=1.2, typical_p=0.9, no_repeat_ngram_size=3)
    seeds = iter([101, 202, 101, 202])
    real = torch.randint

    def seeded(high, size, *a, **k):  # the rows' seed for an unseeded draw (torch.randint(1 << 31, ()))
        return torch.tensor(next(seeds)) if high == 1 << 31 and size == () else real(high, size, *a, **k)

    batch = Batch()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "randint", seeded)
        together = drive(batch, [(0, lambda: Conversation(rowed, batch=batch).stream("Hi.", settings=settings)),
                                 (1, lambda: Conversation(rowed, batch=batch).stream("Hey.", settings=settings))])
        alone = [drive(batch, [(0, lambda t=t: Conversation(rowed, batch=batch).stream(t, settings=settings))])[0]
                 for t in ("Hi.", "Hey.")]
    assert [told(e) for e in together] == [told(e) for e in alone]
    assert rows.free_rows() == 3


@pytest.mark.parametrize("key,value", [("graph_rows", "-1"), ("graph_freeze", "sometimes"),
                                       ("graph_fuse", "sometimes"), ("graph_matvec", "cutlass"),
                                       ("graph_gqa", "grouped"), ("graph_autotune", "max")])
def test_a_bad_graph_value_is_refused_by_name(key, value):
    from chat.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"{key}.*{value}"):
        load_config(overrides=[f"model.{key}={value}"], environ={})


def test_the_service_answers_sessions_in_progress_together_in_the_rows_and_one_alone_on_the_single_step(
        smollm2_dir, tiny_llama):
    """Through the service (`model.graph_step: true`, `model.graph_rows: 2`): two sessions asked at once both decode
    as rows (one replay a round for both; the first took the single-row step, and each round ran its replay and the
    rows' one after the other: 8.6x one session at 32 sessions on an H200, 12.0x with every answer a row); three at
    once, two in the rows and the third, with no row free, on the single-row step; one alone on the single-row step.
    Each answer is that of a service without graph steps, asked alone."""
    from chat.config import load_config
    from chat.service import Service
    from chat.textsearch import TextSearch
    from chat.worker import Request
    from tests_helpers import result

    def config(*more):
        return load_config(overrides=["model.compile=false", "model.graph_max_len=256", *more], environ={})

    search, lm = TextSearch(), make_tiny_llama(smollm2_dir)
    on = Service(config("model.graph_step=true", "model.graph_rows=2"), loader=lambda: lm, text_search=search)
    off = Service(config("model.graph_step=false"), tiny_llama, text_search=search)
    try:
        result(on.ready())
        single, rows = graph.attached(lm.merged()), graph_rows.attached_rows(lm.merged())
        assert single.ready.wait(120) and rows.ready.wait(120)
        settings, recall = GenerationSettings(max_new_tokens=12), RecallSettings(enabled=False)
        for questions, in_rows in ((["Hi there", "Tell me about the sea."], 2),
                                   (["Hi there", "Tell me about the sea.", "What is bread?"], 2),
                                   (["What is bread?"], 0)):
            sessions, held, go = [on.new_session() for _ in questions], threading.Event(), threading.Event()
            on.worker.submit(Request("hold", lambda _: held.set() or go.wait(30), None))  # (all asked before any
            assert held.wait(30)  # starts: the worker starts them in one round)
            turns = [on.chat(s, q, [], settings, recall) for s, q in zip(sessions, questions)]
            go.set()
            for t in turns:
                result(t.request)
            for s, q in zip(sessions, questions):
                alone = off.new_session()
                result(off.chat(alone, q, [], settings, recall).request)
                assert s.conv.ids == alone.conv.ids and s.conv.messages[-1].text == alone.conv.messages[-1].text
            steps = [s.conv.cache.step for s in sessions if isinstance(s.conv.cache, GraphCache)]
            assert len(steps) == len(questions) and steps.count(rows.graph) == in_rows, questions
            assert steps.count(single.graph) == len(questions) - in_rows
        assert rows.free_rows() == 2
    finally:
        on.close()
        off.close()


def test_a_loop_answer_ending_beside_a_parked_row_turn_and_a_failed_round(rowed, tiny_llama):
    """A seeded answer (the loop's) ends in a round where a rows answer has parked its turn: both are as alone. A
    replay that fails fails the answers seated in the rows (their turns not stored); an answer reading its prompt in
    that round (its chunk read by another runner, `decoding.prompt_reads`) keeps its row, and it and the next answer
    (which must take another row) are as alone."""
    batch = Batch()
    a, b = Conversation(rowed, batch=batch), Conversation(rowed, batch=batch)
    sa, sb = GenerationSettings(max_new_tokens=20), GenerationSettings(max_new_tokens=4, do_sample=True, seed=3)
    got = drive(batch, [(0, lambda: a.stream("Who are you?", settings=sa)), (1, lambda: b.stream("Hi.", settings=sb))])
    assert told(got[0]) == told(list(Conversation(tiny_llama).stream("Who are you?", settings=sa)))
    assert told(got[1]) == told(list(Conversation(tiny_llama).stream("Hi.", settings=sb)))

    rows = graph_rows.attached_rows(rowed.merged())
    reading = Conversation(rowed, batch=batch, prefill_chunk=4)  # its prompt 4 tokens a round
    failing, later = Conversation(rowed, batch=batch), Conversation(rowed, batch=batch)
    text = "Tell me everything about the history of the sea and the ships that sailed on it in the old days."
    real, calls = rows.graph._run, []

    def run(*args):  # the second replay fails (out of memory, say)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(*args)

    failed: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rows.graph, "_run", run)
        events = drive(batch, [(0, lambda: reading.stream(text, settings=sa)),
                               (0, lambda: failing.stream("Hi.", settings=sa)),
                               (3, lambda: later.stream("Who are you?", settings=sa))], failed)
    assert list(failed) == [1] and "injected" in failed[1] and not failing.messages  # (its turn was not stored)
    for t, ev in ((text, events[0]), ("Who are you?", events[2])):
        assert told(ev) == told(list(Conversation(tiny_llama).stream(t, settings=sa)))
    assert rows.free_rows() == 3 and not rows.joining


def test_a_prompt_read_that_fails_fails_its_answer_alone(rowed, tiny_llama, monkeypatch):
    """Out of memory reading one answer's prompt (a long one) while another decodes in a row: that answer fails
    with the error, the other goes on to the end as alone, and every row is free after."""
    from decoding.forward import Forward

    real, batch = Forward.prefill, Batch()

    def prefill(self, embeds, *args, **kw):
        if embeds.shape[1] >= 40:
            raise torch.OutOfMemoryError("injected: out of memory reading a long prompt")
        return real(self, embeds, *args, **kw)
    monkeypatch.setattr(Forward, "prefill", prefill)
    a, b = Conversation(rowed, batch=batch), Conversation(rowed, batch=batch)
    s, long = GenerationSettings(max_new_tokens=30), "Tell me everything about the sea and the ships on it. " * 4
    failed: dict = {}
    got = drive(batch, [(0, lambda: a.stream("Who are you?", settings=s)), (3, lambda: b.stream(long, settings=s))],
                failed)
    assert list(failed) == [1] and "out of memory" in failed[1] and not b.messages
    monkeypatch.undo()
    assert told(got[0]) == told(list(Conversation(tiny_llama).stream("Who are you?", settings=s)))
    rows = graph_rows.attached_rows(rowed.merged())
    assert rows.free_rows() == 3 and not rows.joining


def test_an_answer_ending_at_its_seat_keeps_only_what_its_row_holds(rowed, tiny_llama):
    """A prompt ending with `<recall>` whose answer ends inside the memory's span (max_new_tokens 3): it never
    rides a replay, while another row decodes; its cache holds its prompt alone, and its next turn is the loop's."""
    from decoding.engine import Engine
    from decoding.loop import stream_generate
    from decoding.request import Prompt

    recall, tok, batch = kv_recall(rowed), rowed.tokenizer, Batch()
    xa = tok("Tell me a long story.", return_tensors="pt").input_ids
    xb = torch.cat([tok("Once more.", return_tensors="pt").input_ids, torch.tensor([[rowed.tokens.recall]])], 1)
    sa, sb = GenerationSettings(max_new_tokens=40), GenerationSettings(max_new_tokens=3)
    got = drive(batch, [(0, lambda: Engine(rowed, batch).stream(Prompt({"input_ids": xa}), sa, None)),
                        (2, lambda: Engine(rowed, batch).stream(Prompt({"input_ids": xb}), sb, recall))])[1]
    want = list(stream_generate(tiny_llama.merged(), {"input_ids": xb}, sb, recall=recall, tokenizer=tok))
    res, ref = got[-1].result, want[-1].result
    assert told(got) == told(want) and cache_length(res.cache) == xb.shape[1]
    y = torch.cat([res.sequences, tok(" and then?", return_tensors="pt").input_ids], 1)
    s2 = GenerationSettings(max_new_tokens=8)
    nxt = drive(batch, [(0, lambda: Engine(rowed, batch).stream(Prompt({"input_ids": y}, res.cache,
                                                                       res.memory_vectors[0]), s2, recall))])[0]
    assert told(nxt) == told(list(stream_generate(tiny_llama.merged(), Prompt({"input_ids": y}, ref.cache,
                                                                               ref.memory_vectors[0]), s2,
                                                  recall=recall, tokenizer=tok)))


def test_a_rows_handle_read_ahead_on_the_single_step_and_stopped_stays_whole(smollm2_dir, tiny_llama):
    """A conversation answered in the rows, then its next prompt read ahead on the single-row step and stopped
    between chunks: its handle still holds its own positions (the single step did not take it over), and its next
    turn, in the rows while the single step is busy, is the loop's."""
    lm = make_tiny_llama(smollm2_dir)
    graph.enable(lm.merged(), max_len=256, spans=(9,), compile=False).warm_up()
    rows = graph_rows.enable_rows(lm.merged(), rows=2, max_len=256, spans=(9,), compile=False)
    rows.warm_up()
    batch, s = Batch(), GenerationSettings(max_new_tokens=10)
    busy, conv, ref = Conversation(lm, batch=batch), Conversation(lm, batch=batch, prefill_chunk=4), \
        Conversation(tiny_llama)
    drive(batch, [(0, lambda: busy.stream("Hello there.", settings=s)),
                  (0, lambda: conv.stream("What is bread?", settings=s))])
    list(ref.stream("What is bread?", settings=s))
    handle = conv.cache
    assert handle.step is rows.graph and handle.held is not None
    stop = threading.Event()
    stop.set()
    text = "Tell me about the long history of ships and the sea, please."
    list(conv.read_ahead(text, interrupt_event=stop))
    assert conv.cache is handle and handle.held is not None and rows.graph.owner is None
    assert tuple(handle.layers()[0][0].shape)[:1] == (1,) and cache_length(handle) == len(conv.ids) - 1
    got = drive(batch, [(0, lambda: busy.stream("Again.", settings=s)), (0, lambda: conv.stream(text, settings=s))])
    assert told(got[1]) == told(list(ref.stream(text, settings=s)))


def test_the_rows_are_ready_only_once_every_row_is_free(smollm2_dir):
    """`ready` (what the engine checks before it seats an answer) is set after the warm-up's reset of the rows, not
    before it: an answer seated in between would have its row's values cleared under it."""
    lm = make_tiny_llama(smollm2_dir)
    rows = graph_rows.enable_rows(lm.merged(), rows=2, max_len=128, spans=(9,), compile=False)
    seen, reset = [], rows._reset
    rows._reset = lambda: seen.append(rows.ready.is_set()) or reset()
    rows.warm_up()
    assert seen == [False] and rows.ready.is_set() and rows.free_rows() == 2


def test_a_recall_with_nothing_at_min_score_reads_nothing_in_the_rows_as_in_the_loop(rowed, tiny_llama, bank):
    """A bank keyed by `<recall>` states, nothing in it at `min_score`, a model that closes its memories: answers at
    once in the rows read an empty memory at each `<recall>` (`</recall>` alone), each as the loop's alone."""
    import dataclasses
    from models.encoder import MemoryEncoder

    on, off = (dataclasses.replace(lm, encoder=MemoryEncoder(close="</recall>")) for lm in (rowed, tiny_llama))
    strict, batch = RecallSettings(min_score=0.9), Batch()
    plans = [("Who am I?", recalling(on), True), ("And then?", recalling(on, 8.0), False)]
    convs = [Conversation(on, batch=batch) for _ in plans]
    got = drive(batch, [(i, lambda c=c, p=p: c.stream(p[0], settings=p[1], recall=strict, memory_db=bank,
                                                      recall_first=p[2]))
                        for i, (c, p) in enumerate(zip(convs, plans))])
    rows = graph_rows.attached_rows(rowed.merged())
    assert rows.free_rows() == 3 and all(isinstance(c.cache, GraphCache) and c.cache.step is rows.graph for c in convs)
    for conv, (text, settings, first), events in zip(convs, plans, got):
        ref = Conversation(off)
        want = list(ref.stream(text, settings=settings, recall=strict, memory_db=bank, recall_first=first))
        assert told(events) == told(want) and conv.ids == ref.ids and not conv.memory and not ref.memory, text
        at = [i for i, t in enumerate(conv.ids) if t == on.tokens.recall]
        assert at and all(conv.ids[i + 1] == on.tokens.recall_end for i in at if i + 1 < len(conv.ids))
        assert events[-1].result.missed_recall == want[-1].result.missed_recall == [True]


def test_a_memory_past_the_rows_cache_ends_the_answer_before_its_recall(rowed, monkeypatch):
    """A memory wider than `max_slots` (the rows reserve room for one of `max_slots`) that does not fit in what is
    left of the step's cache: the answer ends there, "length", its own `<recall>` dropped and nothing injected, and
    the row is free for the next answer, which decodes as the loop does."""
    from decoding.engine import Engine
    from decoding.events import FinishEvent
    from decoding.loop import stream_generate
    from decoding.request import Prompt

    rows = graph_rows.attached_rows(rowed.merged())
    monkeypatch.setattr(rows.decoder, "max_slots", 0)  # (takes what leaves no room for any memory)
    recall = kv_recall(rowed, n=2, slots=(40, 40))
    text = " ".join(["word"] * 400)
    ids = rowed.tokenizer(text, return_tensors="pt").input_ids[:, :220]  # 220 + 40 + 9 > 256 > 220 + 4 + 9
    settings = GenerationSettings(max_new_tokens=4, sequence_bias=(((rowed.tokens.recall,), 30.0),))
    batch = Batch()
    [events] = drive(batch, [(0, lambda: Engine(rowed, batch).stream(Prompt({"input_ids": ids}), settings, recall))])
    result = events[-1].result
    assert [e.reason for e in events if isinstance(e, FinishEvent)] == ["length"]
    assert not any(isinstance(e, RecallEvent) for e in events) and result.injections == []
    assert torch.equal(result.sequences, ids)  # (the `<recall>` it wrote is dropped)
    assert isinstance(result.cache, GraphCache) and result.cache.step is rows.graph and rows.free_rows() == 3
    short = ids[:, :12]
    [after] = drive(batch, [(0, lambda: Engine(rowed, batch).stream(Prompt({"input_ids": short}), GREEDY_8, None))])
    want = list(stream_generate(rowed.merged(), {"input_ids": short}, GREEDY_8, tokenizer=rowed.tokenizer))
    assert told(after) == told(want)


GREEDY_8 = GenerationSettings(max_new_tokens=8)

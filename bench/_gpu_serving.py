"""`bench/gpu.py`'s measures of the service's work: a recall (the memory head over a bank of 10k / 100k memories on
the device, the wide replay of its span) and N chat sessions at once through the chat service."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from bench._gpu_measure import device_profile, timed
from decoding import graph, graph_rows
from decoding.graph import GraphStep
from decoding.graph_stream import GraphCache
from decoding.memory import MemorySelector, Recall
from decoding.settings import GenerationSettings, RecallSettings
from memory.bank import MemoryVectorDB
from models.loading import LoadedModel

if TYPE_CHECKING:
    from bench.gpu import ModelBench

SLOTS = 16  # a recalled memory's value slots


def recall(mb: ModelBench) -> dict:
    """The memory head over each bank size, the chosen memory's lookup (its token ids' input embeddings), the wide
    replay of its 16 slots and `</recall>`: a recall in decode steps of the graph step; and a recall through the
    decoder."""
    dec, hidden, device, dtype = mb.step_for("recall"), mb.hidden, mb.device, mb.dtype
    recall_id, pad_id, end_id = mb.vocab - 3, mb.vocab - 2, mb.vocab - 1  # random weights: any ids do
    step_ms = mb.info["graph step"]["ms_per_token"]
    frozen_ms = mb.info.get("graph step, frozen", {}).get("ms_per_token")  # (its span graphs are the step's)
    out = {}
    db = MemoryVectorDB(hidden, token_values=True)  # grown from one size to the next
    g, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    for size in sorted(mb.args.memories):
        t = time.perf_counter()
        for start in range(len(db), size, 20_000):
            k = min(20_000, size - start)
            db.add(torch.randn(k, hidden, generator=g), values=list(rng.integers(3, 40000, (k, SLOTS), np.int32)))
        built = time.perf_counter() - t
        rec = Recall(recall_id, pad_id, db, RecallSettings(), suffix=(end_id,)).with_tokens(
            mb.model.get_input_embeddings())
        selector = MemorySelector.of(rec)
        query = torch.randn(hidden, device=device, dtype=dtype)
        upload = timed(lambda: selector.choose(query))  # the keys go to the device once
        head = statistics.median(timed(lambda: selector.choose(query)) for _ in range(20))
        dec.graph.prefill(dec.graph.embed(mb.dev_ids))
        memory = selector.choose(query)
        # the chosen memory's value slots as input embeddings on the device (what the chat's recall does between
        # the head and the span: its token ids looked up in the model's embedding)
        lookup = statistics.median(timed(lambda: rec.embed(rec.values(memory), device, dtype)) for _ in range(20))
        one_span = _span(dec.graph, rec.span(memory), rec.embed(rec.values(memory), device, dtype))
        one_span()
        span_s = statistics.median(one_span() for _ in range(10))
        replay_s = _replay_only(dec.graph, len(rec.span(memory)))
        if size == max(mb.args.memories):  # what a recall runs on the device: the head, the span's replay
            profiles = {"head_kernels": device_profile(lambda: selector.choose(query)),
                        "span_kernels": device_profile(one_span)}
        asking = torch.cat([mb.ids, torch.tensor([[recall_id]])], 1)
        full = dec.generate(asking, mb.greedy(4), recall=rec)
        # the same recall as the chat's loop runs it (head, lookup, span, the host's work between them): a prompt that
        # ends with <recall> read to the first token after the memory, less the same prompt's first token without it
        n = len(rec.span(memory)) + 1  # (the span is forced whole, then one token: no decode step after it)
        recalling = statistics.median(timed(lambda: dec.generate(asking, mb.greedy(n), recall=rec)) for _ in range(10))
        plain = torch.cat([mb.ids, mb.ids[:, -1:]], 1)
        answering = statistics.median(timed(lambda: dec.generate(plain, mb.greedy(1), recall=rec)) for _ in range(10))
        whole = head + lookup + span_s
        out[f"{size}"] = {"bank_build_s": built, "first_search_s": upload, "head_ms": head * 1e3,
                          "lookup_ms": lookup * 1e3, "span_ms": span_s * 1e3, "slots": memory.slots,
                          **({"span_replay_ms": replay_s * 1e3} if replay_s is not None else {}),
                          "decode_steps": whole * 1e3 / step_ms,
                          **({"decode_steps_of_the_frozen_step": whole * 1e3 / frozen_ms} if frozen_ms else {}),
                          "recalled_through_the_decoder": bool(full.recalls),
                          "decoder_recall_ms": (recalling - answering) * 1e3,
                          "decoder_recall_steps": (recalling - answering) * 1e3 / step_ms,
                          **(profiles if size == max(mb.args.memories) else {})}
        selector = rec = None  # (the keys on the device go before the next size's)
    return out


def span_cost(mb: ModelBench, g: GraphStep, step_ms: float) -> dict:
    """A recall's span on the graph step `g` (a variant's): the wide replay of 16 slots of random vectors and
    `</recall>` after the prompt, its replay alone, and with the head's and the lookup's time at the largest bank
    (the recall measure's) a recall in decode steps of `g`'s step (`step_ms`)."""
    g.prefill(g.embed(mb.dev_ids))
    vectors = torch.randn(SLOTS, mb.hidden, generator=torch.Generator().manual_seed(0)).to(mb.device, mb.dtype)
    one_span = _span(g, [mb.vocab - 2] * SLOTS + [mb.vocab - 1], vectors)
    one_span()
    span_s = statistics.median(one_span() for _ in range(10))
    replay_s = _replay_only(g, SLOTS + 1)
    largest = str(max(mb.args.memories)) if mb.args.memories else None
    at = mb.info.get("recall", {}).get(largest, {})
    before_ms = at["head_ms"] + at["lookup_ms"] if "head_ms" in at else None  # (the head's and the lookup's)
    return {"span_ms": span_s * 1e3, **({"span_replay_ms": replay_s * 1e3} if replay_s is not None else {}),
            **({"recall_decode_steps": (before_ms + span_s * 1e3) / step_ms} if before_ms else {})}


def _replay_only(g: GraphStep, n: int) -> float | None:
    """Seconds of the span graph's replay alone, from an idle device to its end (the span's inputs staged by the last
    `forward_span`): beside the span's seconds, what its host work before the replay costs. None without a captured
    graph (CPU, a fallback)."""
    captured = g._captured.get((SLOTS + 1, None, g.window))
    if captured is None:
        return None

    def once() -> float:
        took = timed(captured[0].replay)
        for layer in g.cache.layers:  # (as `_span`'s reset)
            layer.cumulative_length.sub_(n)
        g.one.position.sub_(n)
        return took
    once()
    return statistics.median(once() for _ in range(10))


def _span(g: GraphStep, span: list[int], vectors: torch.Tensor):
    """The wide replay of a memory's span on `g`, in place: its seconds (what the chat runs), then the cache's
    position moved back (the bench's own reset, not timed: a kernel a layer)."""

    def one_span() -> float:
        took = timed(lambda: g.forward_span(span, dict(enumerate(vectors))))
        for layer in g.cache.layers:
            layer.cumulative_length.sub_(len(span))
        g.one.position.sub_(len(span))
        g.length -= len(span)
        return took
    return one_span


def sessions(mb: ModelBench) -> dict:
    """N chat sessions at once through the service, for each N of --sessions (see the module's doc)."""
    if mb.tokenizer is None:
        raise RuntimeError("no tokenizer: the chat service needs one (bench/gpu_prepare.sh)")
    # (here, not at the top: the chat service needs Pillow and pydantic, which a GPU machine may lack; the
    # other measures run without them)
    from chat.config import load_config
    from chat.service import Service

    lm = LoadedModel(model=mb.model, tokenizer=mb.tokenizer, tokens=mb.tokens, name=mb.name)
    counts = mb.args.sessions
    rows = graph_rows.enable_rows(mb.model, rows=max(counts), max_len=mb.args.max_len, spans=(SLOTS + 1,),
                                  graphs=mb.args.graphs)  # (what `model.graph_rows` attaches at start)
    rows_compile_s = rows.warm_up(settings=(GenerationSettings(max_new_tokens=mb.n),))
    cfg = load_config(overrides=[f"app.max_running={max(counts)}", f"generation.max_new_tokens={mb.n}",
                                 f"app.max_new_tokens_cap={max(mb.n, 8)}", "model.compile=false"], environ={})
    svc = Service(cfg, lm)
    out: dict = {}
    try:
        out.update(_sessions_at_once(mb, svc, counts))
        single = graph.attached(mb.model)
        if single is not None and single.ready.is_set():
            # the other policy, side by side: every answer a row (one session too; answers in progress together are
            # rows under both)
            single.ready.clear()
            before = rows.replays
            try:
                out["rows only"] = _sessions_at_once(mb, svc, counts)
            finally:
                single.ready.set()
            out["rows only"]["rows_replays"] = rows.replays - before
        out["batch_forwards"] = svc.worker.batch.forwards  # (the loop's: none while the rows take every answer)
        out["rows_replays"], out["rows_compile_s"] = rows.replays, rows_compile_s
        out["prompt_reads"] = {"forwards": rows.reader.forwards, "turns": rows.reader.turns}  # (read together)
    finally:
        svc.close()
    return out


def _sessions_at_once(mb: ModelBench, svc, counts: list[int]) -> dict:
    from bench.serving import OFF, QUESTIONS, Follow, wait

    # (no min_new_tokens: its processor has no tensor form, so neither graph path would take the answers; a
    # random model's end token is one of 49k, so the answers run their length all the same)
    settings, out = GenerationSettings(max_new_tokens=mb.n), {}
    warm = svc.new_session()  # (uncounted: run 4's first session paid 137 ms of first calls in its TTFT)
    wait([Follow(svc, svc.chat(warm, QUESTIONS[0], [], GenerationSettings(max_new_tokens=4), OFF),
                 time.perf_counter())])
    svc.end_session(warm)
    for n in counts:
        sessions = [svc.new_session() for _ in range(n)]
        t0 = time.perf_counter()
        follows = [Follow(svc, svc.chat(s, QUESTIONS[i % len(QUESTIONS)], [], settings, OFF),
                          time.perf_counter()) for i, s in enumerate(sessions)]
        wait(follows)
        wall = time.perf_counter() - t0
        made = sum(len(f.result.new_tokens[0]) for f in follows)
        single = graph.attached(mb.model)  # (an answer that started before the next was asked took it)
        alone = sum(single is not None and isinstance(s.conv.cache, GraphCache) and s.conv.cache.step is single.graph
                    for s in sessions)
        for s in sessions:
            svc.end_session(s)
        out[str(n)] = {"tokens_per_s": made / wall, "tokens": made,
                       "ttft_ms": statistics.median(f.ttft for f in follows) * 1e3,
                       "ttft_max_ms": max(f.ttft for f in follows) * 1e3, "on_the_single_step": alone}
        if "1" in out:
            out[str(n)]["vs_1_session"] = out[str(n)]["tokens_per_s"] / out["1"]["tokens_per_s"]
    return out

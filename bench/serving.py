"""Serving many people: aggregate decode speed and time to first token with 1, 2, 4, 8 sessions at once,
batched (answers decode as rows of one forward, the default) against taking turns (`app.batching=false`:
one forward per answer per round), on the embedded SmolLM2 through the chat service, in one run.

    .venv/bin/python bench/serving.py [--tokens 64] [--no-compile]
    .venv/bin/python bench/serving.py --replicas 1,2 [--tokens 64]     (needs the extra scale)

Every answer is greedy and exactly `--tokens` long (min_new_tokens), so every run decodes the same
amount. Aggregate tokens/s = all answers' tokens / wall time from submitting to the last one's end.
Time to first token is per session, from its submission. The join row: 7 sessions are busy with long
answers when an 8th sends its message; its time to first token is reported in ms, in batch forwards
(rounds) between its submission and its first token, and next to its own prefill time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402

from chat.config import load_config  # noqa: E402
from chat.service import Service  # noqa: E402
from chat.worker import END  # noqa: E402
from decoding import compiled  # noqa: E402
from decoding.events import DoneEvent, TokenEvent  # noqa: E402
from decoding.settings import GenerationSettings, RecallSettings  # noqa: E402

QUESTIONS = ["Write about the sea.", "Tell me about bread.", "Describe a forest in autumn.", "What is a comet?",
             "Explain how a bicycle works.", "Write a poem about rain.", "Why do cats purr?", "Describe a city at night."]
OFF = RecallSettings(enabled=False)


class Follow:
    """Reads one request's events on a thread: when its first token came, and its result."""

    def __init__(self, svc: Service, turn, submitted: float):
        self.svc, self.req, self.submitted = svc, turn.request, submitted
        self.first: float | None = None
        self.first_round: int | None = None
        self.result = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while (event := self.req.events.get()) is not END:
            if isinstance(event, TokenEvent) and self.first is None:
                batch = getattr(self.svc.worker, "batch", None)  # (replicas: their batches are theirs)
                self.first, self.first_round = time.perf_counter(), batch.forwards if batch else None
            elif isinstance(event, DoneEvent):
                self.result = event.result

    @property
    def ttft(self) -> float:
        return self.first - self.submitted


def chat_all(svc: Service, sessions, settings: GenerationSettings, questions) -> list[Follow]:
    follows = []
    for s, q in zip(sessions, questions):
        t = time.perf_counter()
        follows.append(Follow(svc, svc.chat(s, q, [], settings, OFF), t))
    return follows


def wait(follows: list[Follow]) -> None:
    for f in follows:
        f.thread.join()
        if f.req.error:
            raise RuntimeError(f.req.error)


def concurrent(svc: Service, n: int, tokens: int) -> dict:
    sessions = [svc.new_session() for _ in range(n)]
    settings = GenerationSettings(max_new_tokens=tokens, min_new_tokens=tokens)
    t0 = time.perf_counter()
    follows = chat_all(svc, sessions, settings, QUESTIONS[:n])
    wait(follows)
    wall = time.perf_counter() - t0
    produced = sum(len(f.result.new_tokens[0]) for f in follows)
    for s in sessions:
        svc.end_session(s)
    return {"tok_s": produced / wall, "ttft_ms": statistics.median(f.ttft for f in follows) * 1e3,
            "ttft_max_ms": max(f.ttft for f in follows) * 1e3, "answers": [f.result.new_tokens[0].tolist() for f in follows]}


def join(svc: Service, tokens: int) -> dict:
    """7 sessions decode long answers; an 8th joins after they are well under way."""
    busy = [svc.new_session() for _ in range(7)]
    follows = chat_all(svc, busy, GenerationSettings(max_new_tokens=4 * tokens, min_new_tokens=4 * tokens),
                       QUESTIONS[:7])
    while min(f.req.steps for f in follows) < 10:
        time.sleep(0.01)
    newcomer = svc.new_session()
    before = svc.worker.batch.forwards
    mine = chat_all(svc, [newcomer], GenerationSettings(max_new_tokens=8, min_new_tokens=8), QUESTIONS[7:])[0]
    wait([mine])
    for s in busy:
        svc.stop(s)
    wait(follows)
    for s in [*busy, newcomer]:
        svc.end_session(s)
    return {"ttft_ms": mine.ttft * 1e3, "rounds": mine.first_round - before,
            "prefill_ms": mine.result.prefill_seconds * 1e3}


def service(batching: bool, compile_: bool) -> Service:
    cfg = load_config(overrides=[f"app.batching={str(batching).lower()}", f"model.compile={str(compile_).lower()}",
                                 "generation.max_new_tokens=512"], environ={})
    svc = Service(cfg)
    req = svc.ready()
    req.done.wait()
    step = compiled.attached(svc.lm.model)
    if step is not None:  # every bucket compiled before measuring (the warm-up thread ends with the longest)
        while step.error is None and compiled.BUCKETS[-1] not in step.lengths:
            time.sleep(0.5)
    return svc


def overhead(svc, tokens: int, repeats: int = 5) -> dict:
    """What a request and a token cost on their way, besides the model's own work: the time to first token
    less the loop's prefill, and the time between the first and the last token less the loop's decode time
    for them (medians over `repeats` single-session answers of the same prompt)."""
    per_request, per_token = [], []
    settings = GenerationSettings(max_new_tokens=tokens, min_new_tokens=tokens)
    for _ in range(repeats):
        s = svc.new_session()
        t0, first, last, result = time.perf_counter(), None, None, None
        req = svc.chat(s, QUESTIONS[0], [], settings, OFF).request
        while (event := req.events.get()) is not END:
            if isinstance(event, TokenEvent):
                first, last = first or time.perf_counter(), time.perf_counter()
            elif isinstance(event, DoneEvent):
                result = event.result
        n = len(result.new_tokens[0])
        per_request.append(first - t0 - result.prefill_seconds)
        per_token.append(((last - first) - result.decode_seconds * (n - 1) / n) / (n - 1))
        svc.end_session(s)
    return {"request_ms": statistics.median(per_request) * 1e3, "token_ms": statistics.median(per_token) * 1e3}


def replicas_run(counts: list[int], tokens: int) -> None:
    """In process against 1 and 2 Ray Serve replicas of the same model on this machine, in one run."""
    import ray

    from serve.front import RemoteService

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    base = ["app.batching=true", "model.compile=false", "generation.max_new_tokens=512"]
    rows, answers = {}, {}
    setups = [("in-process", None)] + [(f"{n} replica{'s' if n > 1 else ''}", n) for n in counts]
    for name, n in setups:
        cpus = 2 / n if n else 2
        cfg = load_config(overrides=base + ([f"serve.replicas={n}", f"serve.replica_cpus={cpus}"] if n else []),
                          environ={})
        t = time.perf_counter()
        svc = RemoteService(cfg) if n else Service(cfg)
        if not n:
            svc.ready().done.wait()
        print(f"{name}: started in {time.perf_counter() - t:.1f} s", flush=True)
        try:
            concurrent(svc, 1, 8)  # warm
            rows[(name, "overhead")] = overhead(svc, 16)
            for k in (1, 2, 4, 8):
                out = concurrent(svc, k, tokens)
                answers[(name, k)] = out.pop("answers")
                rows[(name, k)] = out
                print(f"{name} {k} sessions: {out['tok_s']:6.1f} tok/s  TTFT median {out['ttft_ms']:6.0f} ms, "
                      f"max {out['ttft_max_ms']:6.0f} ms", flush=True)
        finally:
            svc.close()
    same = all(answers[(name, k)] == answers[("in-process", k)] for name, _ in setups for k in (1, 2, 4, 8))
    print(f"\nanswers through the replicas == in-process answers (greedy): {same}")
    names = [name for name, _ in setups]
    print("\n| sessions | " + " | ".join(f"{n} tok/s" for n in names) + " | " +
          " | ".join(f"{n} TTFT median (ms)" for n in names) + " |")
    print("|---" * (1 + 2 * len(names)) + "|")
    for k in (1, 2, 4, 8):
        print(f"| {k} | " + " | ".join(f"{rows[(n, k)]['tok_s']:.1f}" for n in names) + " | " +
              " | ".join(f"{rows[(n, k)]['ttft_ms']:.0f}" for n in names) + " |")
    print("\n| path | per request: TTFT less prefill (ms) | per token: gap less decode (ms) |")
    print("|---|---|---|")
    for n in names:
        o = rows[(n, "overhead")]
        print(f"| {n} | {o['request_ms']:.1f} | {o['token_ms']:.2f} |")
    for n in names[1:]:
        o, b = rows[(n, "overhead")], rows[("in-process", "overhead")]
        print(f"routing overhead of {n} over in-process: {o['request_ms'] - b['request_ms']:.1f} ms a request, "
              f"{o['token_ms'] - b['token_ms']:.2f} ms a token")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--replicas", help="compare in-process with these replica counts on Ray Serve, e.g. 1,2")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    transformers.logging.set_verbosity_error()
    if args.replicas:
        return replicas_run([int(n) for n in args.replicas.split(",")], args.tokens)
    rows, answers = {}, {}
    for batching in (True, False):
        svc = service(batching, not args.no_compile)
        try:
            concurrent(svc, 1, 8)  # warm
            for n in (1, 2, 4, 8):
                out = concurrent(svc, n, args.tokens)
                answers[(batching, n)] = out.pop("answers")
                rows[(batching, n)] = out
                print(f"{'batched' if batching else 'turns  '} {n} sessions: {out['tok_s']:6.1f} tok/s  "
                      f"TTFT median {out['ttft_ms']:6.0f} ms, max {out['ttft_max_ms']:6.0f} ms", flush=True)
            j = join(svc, args.tokens)
            rows[(batching, "join")] = j
            print(f"{'batched' if batching else 'turns  '} joining 7 busy: TTFT {j['ttft_ms']:.0f} ms "
                  f"({j['rounds']} batch rounds), its prefill {j['prefill_ms']:.0f} ms", flush=True)
        finally:
            svc.close()
    same = all(answers[(True, n)] == answers[(False, n)] for n in (1, 2, 4, 8))
    print(f"\nbatched answers == answers taking turns (greedy): {same}")
    print("\n| sessions | batched tok/s | taking turns tok/s | batched TTFT median / max (ms) | turns TTFT median / max (ms) |")
    print("|---|---|---|---|---|")
    for n in (1, 2, 4, 8):
        b, t = rows[(True, n)], rows[(False, n)]
        print(f"| {n} | {b['tok_s']:.1f} | {t['tok_s']:.1f} | {b['ttft_ms']:.0f} / {b['ttft_max_ms']:.0f} | "
              f"{t['ttft_ms']:.0f} / {t['ttft_max_ms']:.0f} |")
    print(f"\naggregate 8 ÷ 1 sessions: batched {rows[(True, 8)]['tok_s'] / rows[(True, 1)]['tok_s']:.2f}x, "
          f"taking turns {rows[(False, 8)]['tok_s'] / rows[(False, 1)]['tok_s']:.2f}x")
    for batching in (True, False):
        j = rows[(batching, "join")]
        rounds = f"{j['rounds']} batch rounds, " if batching else ""
        print(f"{'batched' if batching else 'turns'}: a session joining 7 busy ones: first token after {rounds}"
              f"{j['ttft_ms']:.0f} ms (its own prefill {j['prefill_ms']:.0f} ms)")


if __name__ == "__main__":
    main()

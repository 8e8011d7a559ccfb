"""The model worker: order, positions, withdrawal, context variables, errors as messages."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest

from chat.worker import END, SHUTTING_DOWN, Failed, Request, ServiceError, ShuttingDown, Waiting, Worker
from decoding.events import FinishEvent, TokenEvent
from tests_helpers import drain, result


def test_worker_runs_in_order_and_reports_positions():
    worker = Worker()
    gate, order = threading.Event(), []
    try:
        blocker = worker.submit(Request("gate", lambda _: gate.wait(10)))
        while blocker not in worker.running:
            time.sleep(0.001)
        reqs = [worker.submit(Request(f"r{i}", lambda _, i=i: order.append(i) or i)) for i in range(3)]
        assert [r.events.get(timeout=5) for r in reqs] == [Waiting(1), Waiting(2), Waiting(3)]
        gate.set()
        assert [result(r) for r in reqs] == [0, 1, 2] and order == [0, 1, 2]
        assert blocker.done.is_set()
        # after the gate ended, every request was told when it moved up, down to 0 (running)
        assert [e.ahead for e in drain(reqs[2])] == [2, 1, 0]
    finally:
        worker.close()


def test_withdrawn_waiting_request_never_runs():
    worker = Worker()
    gate, ran = threading.Event(), []
    try:
        worker.submit(Request("gate", lambda _: gate.wait(10)))
        req = worker.submit(Request("job", lambda _: ran.append(1)))
        worker.withdraw(req)
        assert req.done.is_set() and req.reason == "interrupted"
        gate.set()
        later = worker.submit(Request("later", lambda _: "ok"))
        assert result(later) == "ok" and ran == []
    finally:
        worker.close()


def test_requests_run_in_the_submitters_context():
    """Gradio's progress bars follow tqdm through the handler's context variables: the worker keeps them."""
    where = contextvars.ContextVar("where", default="worker")
    worker = Worker()
    try:
        where.set("handler")
        assert result(worker.submit(Request("ctx", lambda _: where.get()))) == "handler"
    finally:
        worker.close()


def test_errors_become_messages_not_tracebacks():
    worker = Worker()
    try:
        def boom(_):
            raise ValueError("the bank has dimension 64, the model 576")

        req = worker.submit(Request("boom", boom))
        events = drain(req)
        assert Failed("the bank has dimension 64, the model 576") in events
        assert "Traceback" not in req.error
        def crash(_):
            return {}["missing"]

        assert "missing" in result_error(worker.submit(Request("crash", crash)))
    finally:
        worker.close()


def result_error(req: Request) -> str:
    req.done.wait(10)
    return req.error


def endless(started: threading.Event):
    """A request that streams a token every 10 ms until it is stopped, then finishes "interrupted"."""
    def run(interrupt: threading.Event):
        def events():
            started.set()
            while not interrupt.is_set():
                yield TokenEvent(0, 1, 0, "x")
                time.sleep(0.01)
            yield FinishEvent(0, "interrupted")
        return events()
    return run


def test_close_gives_every_request_a_last_event_and_followers_still_read_it():
    """SIGTERM closes the worker while HTTP streams follow its requests: each request (running or waiting) is told
    the server is shutting down and ends, and `next_event`, called after the close, still reads its events to
    END (it once raised "cannot schedule new futures after shutdown", cutting the stream off)."""
    worker, started = Worker(), threading.Event()
    running = worker.submit(Request("chat", endless(started), session_id=1))
    waiting = worker.submit(Request("chat", endless(threading.Event()), session_id=1))  # (its session is busy)
    assert started.wait(10)
    worker.close()

    async def follow(req):
        events = []
        while (event := await worker.next_event(req, 0.5)) is not END:
            if event is not None:
                events.append(event)
        return events

    seen = {req.id: asyncio.run(follow(req)) for req in (running, waiting)}
    for req in (running, waiting):
        assert Failed(SHUTTING_DOWN, "shutdown") in seen[req.id] and req.done.is_set()
        with pytest.raises(ShuttingDown):
            asyncio.run(worker.wait_for(req))
    assert waiting.started is None and not any(isinstance(e, TokenEvent) for e in seen[waiting.id])  # never ran
    with pytest.raises(ShuttingDown):
        worker.submit(Request("late", lambda _: 1))


def test_a_refusal_is_told_apart_from_a_failure():
    """A `ServiceError` (what the request asked for cannot be done) is a refusal, with its wording for the OpenAI
    API; any other exception a failure (the API's 400 and 500)."""
    worker = Worker()
    try:
        def refuse(_):
            raise ServiceError("clear the conversation", api="messages: expected at most 10 tokens, got 20")

        def fail(_):
            raise RuntimeError("out of memory")

        assert Failed("clear the conversation", "refused", "messages: expected at most 10 tokens, got 20") in drain(
            worker.submit(Request("refused", refuse)))
        assert Failed("out of memory") in drain(worker.submit(Request("failed", fail)))
    finally:
        worker.close()


class Rounds:
    """A runner of parked turns that records how many each round brought (as the graph rows' runners do)."""

    def __init__(self):
        self.sizes: list[int] = []

    def run(self, turns) -> None:
        self.sizes.append(len(turns))


def parking(worker: Worker, runner: Rounds, turns: int | None):
    """An answer's `run`: `turns` turns parked for the rounds, one a round (None: until it is stopped)."""
    from decoding.batch import Parked

    def run(interrupt):
        n = 0
        while (n < turns) if turns is not None else not interrupt.is_set():
            n += 1
            turn = Parked()
            turn.runner = runner
            yield from worker.batch.park(turn)
        return "done"
    return run


def test_answers_waiting_together_start_in_the_same_round():
    """Three answers that waited behind a long request all start at the next round, so their first turns run
    together (the graph rows then read their prompts in one forward); one a round before."""
    worker, gate, runner = Worker(), threading.Event(), Rounds()
    try:
        blocker = worker.submit(Request("gate", lambda _: gate.wait(10)))
        while blocker not in worker.running:
            time.sleep(0.001)
        answers = [worker.submit(Request("generate", parking(worker, runner, 3))) for _ in range(3)]
        gate.set()
        assert [result(a) for a in answers] == ["done"] * 3
        assert runner.sizes == [3, 3, 3]
    finally:
        worker.close()


def test_at_most_one_request_that_runs_whole_starts_a_round():
    """Two bank edits waiting beside a running answer: the answer gets a round between them (a whole request holds
    the model; the answers are not held for two in a row)."""
    worker, runner, seen = Worker(), Rounds(), []
    try:
        answer = worker.submit(Request("generate", parking(worker, runner, None)))
        while len(runner.sizes) < 2:
            time.sleep(0.001)
        gate = threading.Event()
        first = worker.submit(Request("edit", lambda _: (gate.wait(10), seen.append(len(runner.sizes)))))
        second = worker.submit(Request("edit", lambda _: seen.append(len(runner.sizes))))
        gate.set()
        result(first), result(second)
        assert seen[1] > seen[0], seen
        answer.stop()
        assert result(answer) == "done"
    finally:
        worker.close()


def test_a_request_running_whole_at_shutdown_ends_with_its_own_result():
    """A shutdown while a memory is being written (a request that runs whole): the write is made, so its requester
    gets its result, not "stopped"; the one waiting behind it never runs and is told the server stopped it."""
    worker, gate, written = Worker(), threading.Event(), []
    write = worker.submit(Request("edit", lambda _: (gate.wait(10), written.append("the dog is called T0"), "made")[2]))
    while write.started is None:
        time.sleep(0.001)
    behind = worker.submit(Request("edit", lambda _: written.append("never")))
    closing = threading.Thread(target=worker.close)
    closing.start()
    while not worker._closed:
        time.sleep(0.001)
    gate.set()
    closing.join(10)
    assert result(write) == "made" and written == ["the dog is called T0"]
    with pytest.raises(ServiceError, match="shutting down"):
        result(behind)

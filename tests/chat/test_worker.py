"""The model worker: order, positions, withdrawal, context variables, errors as messages."""

from __future__ import annotations

import contextvars
import threading
import time

from chat.worker import Failed, Request, Waiting, Worker
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

"""The model worker: one thread that owns the model and runs every request, each with its own event queue.

Generation, memory encoding and bank edits are requests on its queue. Running answers decode
together: each round, every answer is advanced to its next decode step, and the worker's `Batch`
runs those steps as rows of one forward (continuous batching, `decoding/batch.py`); an answer
joins at a round's boundary and leaves when it ends. A bank edit runs whole between rounds, so a
bank is never edited in the middle of a recall. Every request has its own interrupt event and its
own event queue, which ends with `END`; a waiting request is told how many requests are ahead of it.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import GeneratorType
from typing import Any

from decoding.backend import Unsupported
from decoding.batch import Batch, Parked
from decoding.events import FinishEvent, TokenEvent

log = logging.getLogger("chat.worker")

END = object()  # the last item of every request's event queue


class ServiceError(ValueError):
    """A request that could not be done; the message is meant for the user. `api`: the message as the OpenAI API
    words it (its field names, no page controls), where that differs."""

    def __init__(self, message: str, api: str | None = None):
        super().__init__(message)
        self.api = api


class ShuttingDown(ServiceError):
    """The server is shutting down: the request was not taken, or was stopped."""


class ServerFault(ServiceError):
    """A request whose work failed on the server's side (a memory file that cannot be written), not one the
    requester asked wrongly: the OpenAI API's 500, not its 400."""


SHUTTING_DOWN = "the server is shutting down: this request was stopped"


@dataclass(frozen=True)
class Waiting:
    ahead: int  # requests before this one; 0 = it is running


@dataclass(frozen=True)
class Notice:
    text: str


@dataclass(frozen=True)
class Failed:
    """A request's end in failure. `cause`: "error" (the work failed), "refused" (a `ServiceError`: the request
    asked for what cannot be done, the requester's to change) or "shutdown" (stopped as the server closes)."""

    message: str
    cause: str = "error"
    api: str | None = None  # the message in the OpenAI API's terms, where they differ (`ServiceError.api`)


@dataclass(eq=False)
class Request:
    """One piece of work for the model worker. `run(interrupt)` returns a value or an event generator."""

    kind: str
    run: Callable[[threading.Event], Any]
    session_id: int | None = None
    label: str = ""
    id: int = 0  # numbered by the worker on submission
    interrupt: threading.Event = field(default_factory=threading.Event)
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    context: contextvars.Context = field(default_factory=contextvars.copy_context)  # the submitter's (progress bars)
    done: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    stop_requested: float | None = None
    finished: float | None = None
    steps: int = 0  # tokens generated
    reason: str | None = None  # finish reason of a generation
    result: Any = None
    error: str | None = None
    failed: str | None = None  # how it failed, when it did: `Failed.cause`
    on_withdraw: Callable[[], None] | None = None  # called when withdrawn before it ran (off the worker)
    whole: bool = False  # inside its `run` now (a bank edit runs whole there): a shutdown lets it end with its result

    def stop(self) -> None:
        if self.stop_requested is None:
            self.stop_requested = time.perf_counter()
        self.interrupt.set()


def describe(exc: BaseException) -> str:
    """A one-line message for the user, never a traceback."""
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    if isinstance(exc, (ValueError, FileNotFoundError, RuntimeError)) and str(exc):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class Runner:
    """What every runner of requests keeps: their ids, the running ones, the records of the last 256 finished,
    and waiting on them. `Worker` runs them here; `serve.front.RemoteWorker` follows them on replicas."""

    def __init__(self, name: str):
        self._ids = itertools.count(1)
        self.waiters = ThreadPoolExecutor(max_workers=64, thread_name_prefix=f"{name}-wait")  # blocked on queues
        self.running: list[Request] = []
        self.history: deque[Request] = deque(maxlen=256)  # records of finished requests, newest last

    @staticmethod
    def _put(req: Request, event: Any) -> None:
        """Pass an event on to the request's queue, counting its tokens and noting how it ended."""
        if isinstance(event, TokenEvent):
            req.steps += 1
        elif isinstance(event, FinishEvent):
            req.reason = event.reason
        elif isinstance(event, Failed):
            req.error, req.failed = event.message, event.cause
        req.events.put(event)

    def _close(self, req: Request) -> None:
        req.finished = time.perf_counter()
        req.run = req.on_withdraw = None  # their closures hold the session (conversation, KV cache, bank)
        self.history.append(dataclasses.replace(req, events=None, result=None))  # a record, holding nothing big
        req.events.put(END)
        req.done.set()

    def withdraw(self, req: Request) -> None:
        raise NotImplementedError

    async def wait_for(self, req: Request) -> Any:
        """Await a request's end; its result, or `ServiceError` with its message (`ShuttingDown` when the server
        stopped it, `ServerFault` when its work failed on the server's side)."""
        try:
            await asyncio.get_running_loop().run_in_executor(self.waiters, req.done.wait)
        except RuntimeError:  # the waiters are shut down (`close`): polled here
            while not req.done.is_set():
                await asyncio.sleep(0.02)
        if req.error is not None:
            shut, fault = req.error == SHUTTING_DOWN, req.failed == "error"
            raise (ShuttingDown if shut else ServerFault if fault else ServiceError)(req.error)
        return req.result

    async def next_event(self, req: Request, timeout: float | None) -> Any:
        """The request's next event, or None after `timeout` seconds without one.

        After `close` (its waiters shut down) the queue is polled here: every request has ended or is ending
        then, and a stream still reads its last events (the HTTP server closes after the runner)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.waiters, req.events.get, True, timeout)
        except queue.Empty:
            return None
        except RuntimeError:  # "cannot schedule new futures after shutdown"
            pass
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return req.events.get_nowait()
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                await asyncio.sleep(0.02)


class Worker(Runner):
    """One thread owns the model and runs every request; answers decode together, a round at a time.

    A request whose `run` returns a value (a bank edit, loading the model) runs whole, at most one
    a round. One that returns an event generator (an answer) joins the running ones, up to
    `max_running`, every waiting one at the next round (so answers that arrive together start
    together: the graph rows read their prompts in one forward), and each
    round the worker advances every one of them: an answer that decodes in `batch` up to its next
    decode `Step` (which the batch then runs with the others' as one forward), any other generator
    by one event (a chunk of a long prompt, a token of a decoder that runs alone). So no request
    holds the model for more than one forward while others wait. Two requests of the same session
    never run together: the second waits for the first.
    """

    def __init__(self, name: str = "recall-chat-model", max_running: int = 8):
        super().__init__(name)
        self._pending: deque[Request] = deque()
        self._cond = threading.Condition()
        self.max_running = max_running
        self.batch = Batch()  # the decode steps of this round's answers, run as one forward
        self._stepping: set[int] = set()  # requests whose generator decodes in `batch`
        self._parked: list[Request] = []  # requests waiting for this round's batch to run
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> Request:
        with self._cond:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            req.id = next(self._ids)
            self._pending.append(req)
            req.events.put(Waiting(len(self._pending)))
            self._cond.notify()
        return req

    def withdraw(self, req: Request) -> None:
        """Stop `req`: a running one ends within one decoding step, a waiting one leaves the queue now."""
        req.stop()
        with self._cond:
            if req not in self._pending:
                return
            self._pending.remove(req)
            self._announce()
        self._withdrawn(req)

    def _withdrawn(self, req: Request) -> None:
        """End a request taken off the queue before it ran."""
        req.reason = "interrupted"
        try:
            if req.on_withdraw is not None:
                req.on_withdraw()
        except Exception:  # noqa: BLE001 - the stop itself must succeed
            log.exception("request %d: recording its withdrawal failed", req.id)
        finally:
            self._close(req)

    def _announce(self) -> None:
        for i, req in enumerate(self._pending):
            req.events.put(Waiting(i + 1))

    def _next_to_start(self) -> Request | None:
        """The first waiting request that may start now (under the lock)."""
        busy = {r.session_id for r in self.running if r.session_id is not None}
        for req in self._pending:
            if len(self.running) < self.max_running and (req.session_id is None or req.session_id not in busy):
                self._pending.remove(req)
                return req
        return None

    def _loop(self) -> None:
        generators: dict[int, Iterator[Any]] = {}
        while True:
            with self._cond:
                while not self.running and not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed and not self.running and not self._pending:
                    return
            self._start_waiting(generators)
            self.batch.concurrent = len(generators)  # (an answer alone takes the single-row graph step; else rows)
            with self._cond:
                turn = list(self.running)
            for r in turn:  # each to its next decode step (or one event), in turn
                if r.id in generators:
                    self._step(r, generators)
            self._run_batch(generators)

    def _start_waiting(self, generators: dict[int, Iterator[Any]]) -> None:
        """Start the waiting requests that may start now, in order: every answer (their prompts may then be read
        together, `decoding.prompt_reads`), but at most one request that runs whole (a bank edit: the running answers
        get their round between two)."""
        while True:
            with self._cond:
                req = self._next_to_start()
                if req is None:
                    return
                self.running.append(req)
                req.events.put(Waiting(0))
                self._announce()
            self._start(req, generators)
            if req.id not in generators:  # (it ran whole, or failed)
                return

    def _start(self, req: Request, generators: dict[int, Iterator[Any]]) -> None:
        with self._cond:
            if self._closed:  # `close` stopped it before it ran (and told it so)
                return self._finish(req)
            req.started, req.whole = time.perf_counter(), True
        out = failed = None
        try:
            out = req.context.run(req.run, req.interrupt)
        except Exception as e:  # noqa: BLE001 - reported to the requester
            failed = e
        with self._cond:
            req.whole = False
            if self._closed and isinstance(out, GeneratorType) and req.error is None:
                self._put(req, Failed(SHUTTING_DOWN, "shutdown"))  # (`close` came while its run made the answer)
        if failed is not None:
            return self._fail(req, failed)
        if isinstance(out, GeneratorType):
            generators[req.id] = out
        else:
            req.result = out
            self._finish(req)

    def _step(self, req: Request, generators: dict[int, Iterator[Any]]) -> None:
        """Advance a generator to its next decode `Step` (it is then parked until the batch runs), to its
        end, or by one event when it does not decode in the batch (yet)."""
        while True:
            try:
                event = req.context.run(next, generators[req.id])
            except StopIteration as stop:
                self._drop(req, generators)
                req.result = stop.value
                return self._finish(req)
            except Exception as e:  # noqa: BLE001 - reported to the requester
                self._drop(req, generators)
                return self._fail(req, e)
            if isinstance(event, Parked):
                self._stepping.add(req.id)
                self._parked.append(req)
                return
            self._put(req, event)
            if req.id not in self._stepping:
                return

    def _drop(self, req: Request, generators: dict[int, Iterator[Any]]) -> None:
        del generators[req.id]
        self._stepping.discard(req.id)

    def _run_batch(self, generators: dict[int, Iterator[Any]]) -> None:
        """Run the round's decode steps; if that fails, every request in it fails with the message."""
        parked, self._parked = self._parked, []
        try:
            self.batch.run()
        except Exception as e:  # noqa: BLE001 - reported to each requester
            for req in parked:
                try:
                    req.context.run(generators[req.id].close)  # its cleanup runs: the turn is not stored
                except Exception:  # noqa: BLE001 - the worker goes on whatever a cleanup does
                    log.exception("request %d: closing it after a failed batch failed", req.id)
                self._drop(req, generators)
                self._fail(req, e)
            self.batch.clear()  # every seated request was in this round: all have failed

    def _fail(self, req: Request, e: Exception) -> None:
        if not isinstance(e, (ValueError, KeyError, FileNotFoundError)):  # (called after its except: its traceback
            log.error("request %d (%s) failed", req.id, req.kind, exc_info=e)  # given, "NoneType: None" was logged)
        refused = isinstance(e, (ServiceError, Unsupported))  # (the requester's to change: the OpenAI API's 400)
        self._put(req, Failed(describe(e), "refused", getattr(e, "api", None)) if refused else Failed(describe(e)))
        self._finish(req)

    def _finish(self, req: Request) -> None:
        with self._cond:
            self.running.remove(req)
        self._close(req)

    def close(self, timeout: float | None = 5.0) -> None:
        """Take no more requests and end every one: each is told `SHUTTING_DOWN` (a `Failed` event), a waiting one
        leaves the queue unrun, a running one stops within a step; but one running whole now (a bank edit, a
        memory written) ends with its own result, which it has made. Then the worker thread ends (waiting
        `timeout` seconds at most). Those following a request still read its last events (`next_event`)."""
        with self._cond:
            self._closed = True
            pending, running = list(self._pending), list(self.running)
            self._pending.clear()
            for req in [*pending, *running]:
                if not req.whole:
                    self._put(req, Failed(SHUTTING_DOWN, "shutdown"))
                req.stop()
            self._cond.notify_all()
        for req in pending:
            self._withdrawn(req)
        self._thread.join(timeout)
        self.waiters.shutdown(wait=False)  # (not cancelling a wait in flight: its request has ended, or ends)

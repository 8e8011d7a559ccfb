"""The front door past one machine: the page and `/v1` in this process, the model in N Ray Serve replicas.

`RemoteService` is the `chat.api.ChatService` of the front door. It sends every session operation of
`chat.operations` by name to the replica Ray Serve routes the session to: the deployment's request router is
Ray Serve's `ConsistentHashRouter` over the session id (`handle.options(session_id=...)`, no fallback), so a
session stays on one replica while that replica lives, and moves, rebuilt from its record, when it does not.
The front door keeps each session's `Record` (the exact conversation, and its `SessionState` for the page).
The cluster itself is started by `serve.cluster`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Concatenate

from chat.api import P, R, SessionService
from chat.config import Config
from chat.operations import Operation, operation_of
from chat.session import Session
from chat.state import SessionState
from chat.worker import END, Failed, Request, Runner, ServiceError, describe
from decoding.events import TokenEvent
from serve.cluster import APP, DEPLOYMENT, live_replicas, shared_store, start_replicas
from serve.replica import Missing, Record, Result

log = logging.getLogger("serve.front")


@dataclass(frozen=True)
class ModelInfo:
    name: str
    is_vision: bool


class RemoteWorker(Runner):
    """Follows requests that run on replicas: one thread a request pumps its events from the replica's stream
    into the request's queue, as `chat.worker.Worker` does for local requests."""

    def __init__(self, stop_session: Callable[[int], None]):
        super().__init__("recall-chat-remote")
        self._stop_session = stop_session

    def submit(self, req: Request) -> Request:
        req.id = next(self._ids)
        self.running.append(req)
        threading.Thread(target=self._pump, args=(req,), name=f"recall-chat-remote-{req.id}", daemon=True).start()
        return req

    def _pump(self, req: Request) -> None:
        req.started = time.perf_counter()
        try:
            events = req.run(req.interrupt)
            while True:
                try:
                    event = next(events)
                except StopIteration as stop:
                    req.result = stop.value
                    break
                self._put(req, event)
        except Exception as e:  # noqa: BLE001 - reported to the requester
            self._put(req, Failed(describe(e)))
        finally:
            self.running.remove(req)
            self._close(req)

    def withdraw(self, req: Request) -> None:
        """Stop `req` on its replica (within one decode step there)."""
        req.stop()
        if not req.done.is_set() and req.session_id is not None:
            self._stop_session(req.session_id)

    def close(self) -> None:
        for req in list(self.running):
            self.withdraw(req)
        self.waiters.shutdown(wait=False, cancel_futures=True)


class RemoteService(SessionService):
    """The chat service of the page and `/v1`, with the model in Ray Serve replicas. Thread-safe."""

    def __init__(self, cfg: Config, loader: Callable | None = None):
        super().__init__(shared_store(cfg))
        self.prefix = uuid.uuid4().hex[:8]  # session keys of this front door, unique on the replicas
        self.records: dict[int, Record] = {}
        self._lock = threading.Lock()  # records, served_by, seen: written by the threads following requests
        self.served_by: dict[int, list[str]] = {}  # each session's calls: the replica that ran each
        self.seen: dict[str, Record] = {}  # each replica's latest record
        self.handle = start_replicas(self.cfg, loader)
        first = self.handle.health.remote().result()["replicas"][0]
        self.lm = ModelInfo(first["model"], first["vision"])
        self.worker = RemoteWorker(self._stop_remote)

    def close(self) -> None:
        self.worker.close()
        from ray import serve

        try:
            serve.delete(APP)
        except Exception:  # noqa: BLE001 - closing what may already be gone
            log.exception("stopping the replicas failed")
        super().close()

    # ----------------------------------------------------------------- sessions

    def _key(self, session_id: int) -> str:
        return f"{self.prefix}-{session_id}"

    def _open(self, s: Session) -> None:
        super()._open(s)
        self.records[s.id] = Record()

    def _free(self, s: Session) -> None:
        self.stop(s)  # (not waited for: an API request ends here, on the event loop)
        with self._lock:
            self.records.pop(s.id, None)
            self.served_by.pop(s.id, None)
        try:
            self.handle.options(session_id=self._key(s.id)).end.remote(self._key(s.id))
        except Exception:  # noqa: BLE001 - the replica may be gone: then so is the session there
            log.warning("session %d: could not free it on its replica", s.id)

    def _stop_remote(self, session_id: int) -> None:
        """Tell the session's replica to stop its answers (off the caller's thread: it may be an event loop)."""
        key = self._key(session_id)

        def send() -> None:
            try:
                self.handle.options(session_id=key).stop.remote(key).result(timeout_s=30)
            except Exception as e:  # noqa: BLE001
                log.warning("session %d: the stop did not reach its replica: %s", session_id, describe(e))

        self.worker.waiters.submit(send)

    # ----------------------------------------------------------------- operations, on the replicas

    def run(self, op: Callable[Concatenate[Any, Session, P], R], s: Session, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run a session operation of `chat.operations` on the session's replica: a queued one as a request
        followed here, any other to its value (`ServiceError` with its failure)."""
        operation = operation_of(op)
        self.touch(s)
        sent = operation.pack(operation.arguments(*args, **kwargs), self.cfg.memory.max_upload_mb)
        if operation.queued:
            req = Request(operation.name, lambda interrupt: self._stream(s, operation, sent, interrupt), s.id)
            s.active = [r for r in s.active if not r.done.is_set()] + [self.worker.submit(req)]
            return req
        events, failed, missing = self._stream(s, operation, sent, threading.Event()), None, None
        while True:  # to the end of the stream, failed or not: its record comes last
            try:
                event = next(events)
            except StopIteration as stop:
                if missing is not None:
                    raise KeyError(missing) from None
                if failed is not None:
                    raise ServiceError(failed) from None
                return stop.value
            if isinstance(event, Missing):
                missing = event.message
            elif isinstance(event, Failed):
                failed = event.message

    def _stream(self, s: Session, op: Operation, args: dict, interrupt: threading.Event) -> Iterator[Any]:
        """Run `op` on the session's replica: its events; returns its value. A replica that is gone before the
        call started is retried (Ray Serve's router then drops it and the session moves, rebuilt)."""
        from ray.exceptions import RayActorError

        key = self._key(s.id)
        for attempt in range(4):
            if interrupt.is_set():
                return None
            started, value = False, None
            try:
                record = dataclasses.replace(self.records[s.id], user=s.user)  # (the login or key says whose memory)
                stream = self.handle.options(stream=True, session_id=key).call.remote(key, record, op.name, args)
                for item in stream:
                    if isinstance(item, Record):
                        self._keep(s, item)
                    elif isinstance(item, Result):
                        value = item.value
                    else:
                        started = started or isinstance(item, TokenEvent)
                        yield item
                return op.unpack_result(value, s.files)
            except RayActorError as e:
                if started:  # (the page said all of Ray's report: pid, node, actor id, advice on memory; it is logged)
                    log.warning("session %d: the replica writing its answer stopped: %s", s.id, describe(e))
                    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
                    raise ServiceError("the model replica writing this answer stopped; the conversation is as it "
                                       f"was before this message: send it again ({first})") from None
                log.warning("session %d: replica gone (%s); trying again", s.id, describe(e))
                time.sleep(0.5 * (attempt + 1))
        raise ServiceError("no model replica answered (serve.replicas, or the Ray cluster at serve.ray_address)")

    def _keep(self, s: Session, record: Record) -> None:
        """A record a replica sent back: the session's, when it is newer than the one kept (calls of one
        session may overlap and end in any order)."""
        with self._lock:
            if s.id not in self.sessions:  # ended meanwhile
                return
            if record.version > self.records[s.id].version:
                self.records[s.id] = record
            served = self.served_by.setdefault(s.id, [])
            served[:] = served[-15:] + [record.replica]  # (the last few are enough to tell where it ran)
            self.seen[record.replica] = record

    # ----------------------------------------------------------------- the model, the page

    def ready(self) -> Request:
        """The replicas loaded their models before the app started: a request already done."""
        req = Request("load", None, result=self.lm.name)
        req.done.set()
        req.events.put(END)
        return req

    def state(self, s: Session, details: bool = False) -> SessionState:
        """The session as its replica last described it (every call brings that back), with where it runs."""
        self.touch(s)
        record = self.records.get(s.id)
        state = record.state if record is not None and record.state is not None else SessionState(model=self.lm.name)
        return dataclasses.replace(state, where=f"{self.cfg.serve.replicas} replicas")

    def health(self) -> dict:
        """The replicas as Ray Serve reports them (with the answers each last said it was running), the
        shared bank's store and size (asked of one replica)."""
        from ray import serve

        deployment = serve.status().applications[APP].deployments[DEPLOYMENT]
        try:
            bank = self.handle.health.remote().result(timeout_s=10)["bank"]
        except Exception as e:  # noqa: BLE001
            bank = {"store": self.cfg.memory.store, "size": f"unreachable: {describe(e)}"}
        with self._lock:
            seen = sorted(self.seen.items())
            last = [served[-1] for served in self.served_by.values() if served]
        live, seen = live_replicas(), dict(seen)
        return {"replicas": [{"replica": name, "alive": name in live,
                              "running": seen[name].running if name in seen else 0,  # as it last said
                              "sessions": last.count(name)} for name in sorted(set(live) | set(seen))],
                "replica_states": dict(deployment.replica_states), "deployment": str(deployment.status),
                "wanted": self.cfg.serve.replicas, "bank": bank}

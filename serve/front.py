"""The front door past one machine: the page and `/v1` in this process, the model in N Ray Serve replicas.

`RemoteService` answers what the page and the OpenAI API ask of `chat.service.Service`, and sends every
model call of a session to the replica Ray Serve routes it to: the deployment's request router is Ray
Serve's `ConsistentHashRouter` over the session id (`handle.options(session_id=...)`, no fallback), so a
session stays on one replica while that replica lives, and moves, rebuilt from its record, when it does
not. The front door keeps each session's `Record` (exact conversation, what the page shows).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import ray  # the extra `scale`: without it, importing this module says what to install

from chat.config import Config
from chat.inputs import Limits, check_new_tokens, read_upload_text
from chat.service import Service, Turn
from chat.session import Session
from chat.view import RECALL_COLUMNS, TurnView, status_line, user_message
from chat.worker import END, Failed, Request, ServiceError, Worker, describe
from decoding.events import FinishEvent, TokenEvent
from memory import MemoryVectorDB
from memory.files import atomic_write
from serve.replica import ChatReplica, Record, Result

log = logging.getLogger("serve.front")

APP, DEPLOYMENT = "recall-chat", "ChatReplica"
ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"


class ServeError(RuntimeError):
    """The replicas could not be started or reached; the message names the setting to look at."""


@dataclass(frozen=True)
class ModelInfo:
    name: str


def shared_store(cfg: Config) -> Config:
    """`cfg` as the replicas get it. A milvus-lite store is a file only one process may open: this one (the
    front door) opens it and serves it to the replicas on this machine at its http address; a Milvus server
    URI goes to the replicas as it is. Refuses to start, naming the URI, when nothing answers there."""
    mem = cfg.memory
    if mem.store != "milvus":
        return cfg
    from memory.milvus import MilvusBank, StoreError, load_into

    client = MilvusBank.connect(mem.milvus_uri)
    if mem.bank is not None and not client.has_collection(mem.milvus_collection):
        # filled once, here, from the bank file (checked as any bank file), before any replica opens it
        load_into(MemoryVectorDB.load(mem.bank), mem.milvus_uri, mem.milvus_collection, index=mem.index,
                  client=client)
    if mem.milvus_uri.startswith(("http://", "https://", "tcp://", "unix:")):
        return cfg
    if cfg.serve.ray_address is not None:
        raise StoreError(f"memory.milvus_uri={mem.milvus_uri!r} is a milvus-lite file, which only this machine "
                         f"can reach; with a Ray cluster (serve.ray_address={cfg.serve.ray_address!r}) use a "
                         "Milvus server: memory.milvus_uri=http://host:19530")
    from milvus_lite.server_manager import server_manager_instance  # the same server for the same file

    uri = server_manager_instance.start_and_get_uri(mem.milvus_uri)
    if uri is None:
        raise StoreError(f"could not serve the milvus-lite file memory.milvus_uri={mem.milvus_uri!r} to the replicas")
    return dataclasses.replace(cfg, memory=dataclasses.replace(mem, milvus_uri=uri))


def start_replicas(cfg: Config, loader: Callable | None = None, name: str = APP):
    """Start (or join) Ray, and run `serve.replicas` replicas of the model as the Serve application `name`;
    their handle."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    cfg = shared_store(cfg)
    address = cfg.serve.ray_address
    if not ray.is_initialized():
        try:
            _reachable(address)
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        except Exception as e:  # noqa: BLE001 - Ray raises many kinds (ConnectionError, RuntimeError, ...)
            where = "start a local Ray" if address is None else f"join the Ray cluster at {address}"
            raise ServeError(f"could not {where} (serve.ray_address={address!r}): {describe(e)}") from None
    want, have = cfg.serve.replicas * cfg.serve.replica_cpus, ray.cluster_resources().get("CPU", 0)
    if want > have:  # Serve would wait for them forever
        raise ServeError(f"serve.replicas={cfg.serve.replicas} x serve.replica_cpus={cfg.serve.replica_cpus} needs "
                         f"{want:g} CPUs; the Ray cluster has {have:g}: lower either, or add nodes")
    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(
        ChatReplica, name=DEPLOYMENT, num_replicas=cfg.serve.replicas, max_ongoing_requests=64,
        max_constructor_retry_count=3,  # a model that does not load: say so, do not retry it 20 times
        logging_config={"enable_access_log": False, "log_level": "WARNING"},  # no log line a call
        ray_actor_options={"num_cpus": cfg.serve.replica_cpus, "num_gpus": cfg.serve.replica_gpus},
        request_router_config=RequestRouterConfig(request_router_class=ROUTER,
                                                  request_router_kwargs={"num_fallback_replicas": 0}))
    try:
        return serve.run(deployment.bind(cfg, loader), name=name, route_prefix=None)
    except Exception as e:  # noqa: BLE001 - a replica's constructor failed: say which and why
        try:  # the constructor's own error is in the deployment's status, not in serve.run's
            text = serve.status().applications[name].deployments[DEPLOYMENT].message + "\n" + str(e)
        except Exception:  # noqa: BLE001
            text = str(e)
        why = next((line.strip().removeprefix("RuntimeError: ") for line in text.splitlines()
                    if line.startswith("RuntimeError: model replica")), text[-2000:])
        raise ServeError(f"the model replicas did not start (serve.replicas={cfg.serve.replicas}): {why}") from None


def _reachable(address: str | None) -> None:
    """A `host:port` cluster address must accept a connection (ray.init would retry it for minutes)."""
    host, sep, port = (address or "").removeprefix("ray://").rpartition(":")
    if address is None or not sep or not port.isdigit():
        return
    with socket.create_connection((host, int(port)), timeout=10):
        pass


class RemoteWorker:
    """Follows requests that run on replicas: one thread a request pumps its events from the replica's stream
    into the request's queue, as `chat.worker.Worker` does for local requests."""

    next_event = Worker.next_event
    wait_for = Worker.wait_for

    def __init__(self, stop_session: Callable[[int], None]):
        self.waiters = ThreadPoolExecutor(max_workers=64, thread_name_prefix="recall-chat-remote-wait")
        self.running: list[Request] = []
        self.history: deque[Request] = deque(maxlen=256)
        self._ids = itertools.count(1)
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
                if isinstance(event, TokenEvent):
                    req.steps += 1
                elif isinstance(event, FinishEvent):
                    req.reason = event.reason
                elif isinstance(event, Failed):
                    req.error = event.message
                req.events.put(event)
        except Exception as e:  # noqa: BLE001 - reported to the requester
            req.error = describe(e)
            req.events.put(Failed(req.error))
        finally:
            req.finished = time.perf_counter()
            req.run = None
            self.running.remove(req)
            self.history.append(dataclasses.replace(req, events=None, result=None))
            req.events.put(END)
            req.done.set()

    def withdraw(self, req: Request) -> None:
        """Stop `req` on its replica (within one decode step there)."""
        req.stop()
        if not req.done.is_set() and req.session_id is not None:
            self._stop_session(req.session_id)

    def close(self) -> None:
        for req in list(self.running):
            self.withdraw(req)
        self.waiters.shutdown(wait=False, cancel_futures=True)


class RemoteBanks:
    """`chat.banks.Banks` as the page uses it, each call run on the session's replica."""

    def __init__(self, service: "RemoteService"):
        self.service = service

    def build_example(self, s: Session) -> Request:
        return self.service.submit(s, "build_example_bank", "build_example")

    def write(self, s: Session, text: str, images: Sequence[str] = ()) -> Request:
        return self.service.submit(s, "write_memories", "write", text=text, images=_read(images))

    def delete(self, s: Session, ids_text: str) -> Request:
        return self.service.submit(s, "delete_memories", "delete", ids=ids_text)

    def upload(self, s: Session, path: str | Path) -> int:
        size = Path(path).stat().st_size
        if size > self.service.cfg.memory.max_upload_mb * 2 ** 20:
            raise ServiceError(f"{Path(path).name}: expected at most {self.service.cfg.memory.max_upload_mb} MB")
        return self.service.call(s, "upload", name=Path(path).name, data=Path(path).read_bytes())

    def use(self, s: Session, which: str) -> None:
        self.service.call(s, "use", which=which)

    def find(self, s: Session, query: str, top_k: int = 5) -> list[dict[str, Any]]:
        return self.service.call(s, "find", query=query, top_k=int(top_k))

    def save(self, s: Session, fmt: str = ".pt") -> Path:
        name, data = self.service.call(s, "save_bank", fmt=fmt)
        path = s.files / name
        path.write_bytes(data)
        return path


def _replicas() -> list[str]:
    """The live replica actors of the deployment (Ray Serve names them by replica id)."""
    prefix = f"SERVE_REPLICA::{APP}#{DEPLOYMENT}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and a["name"].startswith(prefix))


def _read(paths: Sequence[str]) -> list[tuple[str, bytes]]:
    return [(Path(p).name, Path(p).read_bytes()) for p in paths or ()]


class RemoteService:
    """`chat.service.Service` for the page and `/v1`, with the model in Ray Serve replicas. Thread-safe."""

    # the same following, stopping and streaming of a turn's events as in process, over `RemoteWorker`
    follow, stop, settle, checked = Service.follow, Service.stop, Service.settle, Service.checked
    next_event, withdraw = Service.next_event, Service.withdraw

    def __init__(self, cfg: Config, loader: Callable | None = None):
        self.cfg = shared_store(cfg)
        self.limits = Limits(cfg.app.max_message_chars, cfg.app.max_input_tokens, cfg.app.max_new_tokens_cap,
                             cfg.memory.max_memories_per_session)
        self.files = Path(tempfile.mkdtemp(prefix="recall-chat-"))
        self.prefix = uuid.uuid4().hex[:8]  # session keys of this front door, unique on the replicas
        self._ids = itertools.count(1)
        self.sessions: dict[int, Session] = {}
        self.records: dict[int, Record] = {}
        self._lock = threading.Lock()  # records, served_by, seen: written by the threads following requests
        self.served_by: dict[int, list[str]] = {}  # each session's calls: the replica that ran each
        self.seen: dict[str, Record] = {}  # each replica's latest record
        self._history: dict[int, list] = {}  # an API conversation's earlier messages, sent with its question
        self.handle = start_replicas(self.cfg, loader)
        first = self.handle.health.remote().result()["replicas"][0]
        self.lm = ModelInfo(first["model"])
        self.worker = RemoteWorker(self._stop_remote)
        self.banks = RemoteBanks(self)

    def close(self) -> None:
        self.worker.close()
        from ray import serve

        try:
            serve.delete(APP)
        except Exception:  # noqa: BLE001 - closing what may already be gone
            log.exception("stopping the replicas failed")
        shutil.rmtree(self.files, ignore_errors=True)

    # ----------------------------------------------------------------- sessions

    def _key(self, session_id: int) -> str:
        return f"{self.prefix}-{session_id}"

    def new_session(self) -> Session:
        s = Session(next(self._ids))
        s.files = self.files / f"session-{s.id}"
        s.files.mkdir()
        self.sessions[s.id], self.records[s.id] = s, Record()
        return s

    def touch(self, s: Session) -> None:
        s.last_used = time.monotonic()
        if s.id not in self.sessions:  # freed, and back: it starts again, empty
            s.files = self.files / f"session-{s.id}"
            s.files.mkdir(exist_ok=True)
            self.sessions[s.id], self.records[s.id] = s, Record()

    def end_session(self, session: Session | None) -> None:
        if not isinstance(session, Session) or self.sessions.pop(session.id, None) is None:
            return
        self.stop(session)  # (not waited for: an API request ends here, on the event loop)
        with self._lock:
            self.records.pop(session.id, None)
            self._history.pop(session.id, None)
            self.served_by.pop(session.id, None)
        try:
            self.handle.options(session_id=self._key(session.id)).end.remote(self._key(session.id))
        except Exception:  # noqa: BLE001 - the replica may be gone: then so is the session there
            log.warning("session %d: could not free it on its replica", session.id)
        shutil.rmtree(session.files, ignore_errors=True)

    def _stop_remote(self, session_id: int) -> None:
        """Tell the session's replica to stop its answers (off the caller's thread: it may be an event loop)."""
        key = self._key(session_id)

        def send() -> None:
            try:
                self.handle.options(session_id=key).stop.remote(key).result(timeout_s=30)
            except Exception as e:  # noqa: BLE001
                log.warning("session %d: the stop did not reach its replica: %s", session_id, describe(e))

        self.worker.waiters.submit(send)

    # ----------------------------------------------------------------- calls to the replicas

    def _stream(self, s: Session, op: str, args: dict, interrupt: threading.Event | None = None) -> Iterator[Any]:
        """Run `op` on the session's replica: its events; returns its value. A replica that is gone before the
        call started is retried (Ray Serve's router then drops it and the session moves, rebuilt)."""
        from ray.exceptions import RayActorError

        key = self._key(s.id)
        for attempt in range(4):
            if interrupt is not None and interrupt.is_set():
                return None
            started, value = False, None
            try:
                stream = self.handle.options(stream=True, session_id=key).call.remote(key, self.records[s.id], op, args)
                for item in stream:
                    if isinstance(item, Record):
                        self._keep(s, item)
                    elif isinstance(item, Result):
                        value = item.value
                    else:
                        started = started or isinstance(item, TokenEvent)
                        yield item
                return value
            except RayActorError as e:
                if started:
                    raise ServiceError("the model replica writing this answer stopped; the conversation is as it "
                                       f"was before this message: send it again ({describe(e)})") from None
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
                s.bank_use, s.last_speed, s.last_plot, s.last_note = (record.bank_use, record.last_speed,
                                                                      record.last_plot, record.last_note)
            served = self.served_by.setdefault(s.id, [])
            served[:] = served[-15:] + [record.replica]  # (the last few are enough to tell where it ran)
            self.seen[record.replica] = record

    def submit(self, s: Session, kind: str, op: str, label: str = "", **args: Any) -> Request:
        """A request running `op` on the session's replica, followed as a local one is."""
        self.touch(s)
        req = Request(kind, lambda interrupt: self._stream(s, op, args, interrupt), s.id, label)
        s.active = [r for r in s.active if not r.done.is_set()] + [self.worker.submit(req)]
        return req

    def call(self, s: Session, op: str, **args: Any) -> Any:
        """Run `op` on the session's replica and wait for its value; `ServiceError` with its failure."""
        self.touch(s)
        events, failed = self._stream(s, op, args), None
        while True:  # to the end of the stream, failed or not: its record comes last
            try:
                event = next(events)
            except StopIteration as stop:
                if failed is not None:
                    raise ServiceError(failed) from None
                return stop.value
            if isinstance(event, Failed):
                failed = event.message

    # ----------------------------------------------------------------- the model

    def ready(self) -> Request:
        """The replicas loaded their models before the app started: a request already done."""
        req = Request("load", None, result=self.lm.name)
        req.done.set()
        req.events.put(END)
        return req

    async def wait_for(self, req: Request) -> Any:
        return await self.worker.wait_for(req)

    # ----------------------------------------------------------------- chatting

    def add_history(self, s: Session, role: str, text: str, images: Sequence[str] = ()) -> None:
        self._history.setdefault(s.id, []).append((role, text, _read(images) if role == "user" else []))

    def chat(self, s: Session, text: str, images: Sequence[str], settings, recall, recall_first: bool = False) -> Turn:
        self.touch(s)
        text, images = self.checked(text, images, settings)
        history = list(self.records[s.id].messages)
        req = self.submit(s, "chat", "chat", text[:80], text=text, images=_read(images), settings=settings,
                          recall=recall, recall_first=recall_first, history=self._history.pop(s.id, []))
        return Turn(req, TurnView(), history, user_message(text, images))

    def regenerate(self, s: Session, settings, recall) -> Turn:
        messages = self.records[s.id].messages
        if not messages or messages[-1]["role"] != "assistant":
            raise ServiceError("there is no answer to regenerate yet")
        check_new_tokens(settings.max_new_tokens, self.limits)
        req = self.submit(s, "regenerate", "regenerate", "regenerate", settings=settings, recall=recall)
        return Turn(req, TurnView(), list(messages[:-1]), None)

    def clear(self, s: Session) -> None:
        self.settle(s)
        self.call(s, "clear")

    def save_conversation(self, s: Session) -> Path:
        text = self.records[s.id].conversation
        if text is None:
            raise ServiceError("there is no conversation to save yet")
        path = s.files / f"conversation-{s.id}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        atomic_write(path, lambda fh: fh.write(text.encode()))
        return path

    def load_conversation(self, s: Session, path: str | Path) -> None:
        self.settle(s)
        name = Path(path).name
        try:
            text = read_upload_text(path, self.cfg.memory.max_upload_mb)
        except ValueError as e:
            raise ServiceError(str(e)) from None
        try:
            self.call(s, "load_conversation", text=text)
        except ServiceError as e:
            raise ServiceError(f"{name}: {e}") from None

    # ----------------------------------------------------------------- what the page shows

    def messages(self, s: Session, upto: int | None = None) -> list[dict]:
        return list(self.records[s.id].messages[:upto]) if s.id in self.records else []

    def recall_log(self, s: Session, live: TurnView | None = None) -> pd.DataFrame:
        answers = list(self.records[s.id].recalls) if s.id in self.records else []
        if live is not None and not live.done:
            answers.append(live.recalls)
        rows = [(turn, r.position, r.length, round(r.score, 4), r.memory_index, r.text or "")
                for turn, recalls in enumerate(answers, 1) for r in recalls]
        return pd.DataFrame(rows, columns=RECALL_COLUMNS)

    def bank_view(self, s: Session) -> tuple[str, Any, str]:
        record = self.records.get(s.id) or Record()
        if record.version == 0:  # nothing asked of a replica yet
            return "**Bank:** the shared bank (on the replicas)", None, s.bank_use
        return record.bank

    def status(self, s: Session, state: str = "") -> str:
        self.touch(s)
        replicas = f"{self.cfg.serve.replicas} replicas"
        record = self.records[s.id]
        line = record.status or status_line(f"**{self.lm.name}**", None, s.bank_use, None)
        return " · ".join(filter(None, [line, replicas, state]))

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
        live, seen = _replicas(), dict(seen)
        return {"replicas": [{"replica": name, "alive": name in live,
                              "running": seen[name].running if name in seen else 0,  # as it last said
                              "sessions": last.count(name)} for name in sorted(set(live) | set(seen))],
                "replica_states": dict(deployment.replica_states), "deployment": str(deployment.status),
                "wanted": self.cfg.serve.replicas, "bank": bank}

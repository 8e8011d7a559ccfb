"""One model replica: a Ray Serve deployment that runs the in-process chat `Service` (its own model,
continuous batch and compiled step) for the sessions routed to it.

The front door (`serve.front`) keeps every session's `Record`: the exact conversation (`Conversation.to_json`:
token ids, injected vectors, images inline) and what the page shows of it. Each call brings the record; the
replica answers on its live session (and KV cache) when it holds the same version, and otherwise rebuilds
the session from the record first: the session came from a replica that died or was removed. Every call
streams its events and ends with the session's new record.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chat.config import Config
from chat.session import Session
from chat.worker import Notice, Request, describe
from decoding.events import DoneEvent

log = logging.getLogger("serve.replica")


@dataclass
class Record:
    """A session as the front door keeps it: enough to show it, and to rebuild it on any replica."""

    version: int = 0  # counts the calls that ended on it; a replica with another version rebuilds
    conversation: str | None = None  # Conversation.to_json(), None while empty
    bank_use: str = "shared"
    messages: list[dict] = field(default_factory=list)  # the chat window
    recalls: list = field(default_factory=list)  # each stored answer's RecallEvents
    status: str = ""  # the status line, without the front door's state
    bank: tuple = ("", None, "shared")  # bank summary, sample, which bank
    last_speed: float | None = None
    last_plot: tuple | None = None
    last_note: str = ""
    replica: str = ""  # the replica that wrote it (Ray Serve's replica id)
    running: int = 0  # answers running on that replica when it wrote it


@dataclass(frozen=True)
class Result:
    """The value of a call that is not an answer (a bank edit, a search, a saved file)."""

    value: Any


def _slim(event: Any) -> Any:
    """What travels of an event: a finished answer's result without its KV cache and vectors."""
    if isinstance(event, DoneEvent):
        result = dataclasses.replace(event.result, cache=None, memory_vectors=[], logits=None, attention_mask=None)
        return DoneEvent(result)
    return event


class ChatReplica:
    """The Ray Serve deployment class. `loader` (optional, picklable) builds the model; by default the
    configured one is loaded. A replica whose model does not load fails to start, saying which and why."""

    def __init__(self, cfg: Config, loader: Callable | None = None):
        import torch
        from ray import serve

        from chat.service import Service

        torch.set_num_threads(max(1, int(cfg.serve.replica_cpus)))
        try:
            self.id = serve.get_replica_context().replica_id.to_full_id_str()
        except Exception:  # noqa: BLE001 - outside Serve (a unit test)
            self.id = f"local-{os.getpid()}"
        self.service = Service(cfg, loader=loader)
        self.sessions: dict[str, tuple[Session, int]] = {}  # session key -> (its session, its record version)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        req = self.service.ready()
        req.done.wait()
        if req.error:
            self.service.close()
            raise RuntimeError(f"model replica {self.id} on {os.uname().nodename} could not load its model "
                               f"({cfg.model.path or 'the embedded SmolLM2'}): {req.error}")
        log.info("replica %s ready with %s", self.id, self.service.lm.name)

    # ----------------------------------------------------------------- sessions

    def _session(self, key: str, record: Record) -> tuple[Session, list[Notice]]:
        """The live session for `key`, or one rebuilt from the record when this replica holds none, or an older
        version than the front door's (the session was served elsewhere meanwhile)."""
        with self._lock(key):
            held = self.sessions.get(key)
            if held is not None and held[1] >= record.version and held[0].id in self.service.sessions:
                return held[0], []
            svc = self.service
            s = held[0] if held is not None else svc.new_session()
            svc.touch(s)
            notices = []
            with s.lock:
                s.conv = None
                if record.conversation is not None:
                    svc.conversation(s).load_json(record.conversation, s.files)
                    why = ("was freed here after being idle" if record.replica == self.id else
                           "moved to another model replica (its replica stopped or was removed, or replicas were "
                           "added)")
                    notices.append(Notice(f"this conversation {why}: it was rebuilt from its record, nothing is "
                                          "lost"))
            use = record.bank_use
            if (use == "own" and s.own_bank is None) or (use == "example" and svc.banks.example is None):
                notices.append(Notice(f"your {'own' if use == 'own' else 'example'} bank was kept on the replica that "
                                      "served this conversation before: using the shared bank (upload or build it "
                                      "again)"))
                use = "shared"
            s.bank_use = use
            self.sessions[key] = (s, record.version)
            return s, notices

    def _lock(self, key: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(key, threading.Lock())

    def _record(self, key: str) -> Record:
        """The session's record after a call: one version past the newest this replica gave out for it."""
        with self._lock(key):
            s, version = self.sessions[key]
            version += 1
            self.sessions[key] = (s, version)
        svc, conv = self.service, s.conv
        with s.lock:
            text = conv.to_json() if conv is not None and conv.messages else None
            recalls = [m.recalls for m in conv.messages if m.role == "assistant"] if conv is not None else []
        return Record(version, text, s.bank_use, svc.messages(s), recalls, svc.status(s), svc.bank_view(s), s.last_speed,
                      s.last_plot, s.last_note, self.id, len(svc.worker.running))

    # ----------------------------------------------------------------- calls

    async def call(self, key: str, record: Record, op: str, args: dict) -> AsyncIterator[Any]:
        """Run `op` for the session `key`: stream its events, then a `Result` (for a value), then its `Record`.
        An error is a `chat.worker.Failed` event; the record is sent whatever happened."""
        from chat.worker import END, Failed

        try:
            s, notices = await asyncio.to_thread(self._session, key, record)
        except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
            yield Failed(f"this conversation could not be rebuilt on replica {self.id}: {describe(e)}")
            return
        for notice in notices:
            yield notice
        out = None
        try:
            out = await asyncio.to_thread(getattr(self, f"op_{op}"), s, **args)
            if isinstance(out, Request):
                while (event := await self.service.next_event(out, None)) is not END:
                    yield _slim(event)
                if out.error is None and out.kind != "chat" and out.kind != "regenerate":
                    yield Result(out.result)
            else:
                yield Result(out)
        except (ValueError, KeyError, FileNotFoundError, OSError) as e:
            yield Failed(describe(e))
        except BaseException:  # the caller went away (its stream was cancelled): the answer stops within a step
            if isinstance(out, Request) and not out.done.is_set():
                self.service.withdraw(out)
            raise
        yield await asyncio.to_thread(self._record, key)

    def stop(self, key: str) -> int:
        """Stop the session's answers (within one decode step); how many were running."""
        held = self.sessions.get(key)
        return len(self.service.stop(held[0])) if held else 0

    def end(self, key: str) -> None:
        """The session ended at the front door: free it here."""
        held = self.sessions.pop(key, None)
        if held:
            self.service.end_session(held[0])

    def health(self) -> dict:
        out = self.service.health()
        out["replicas"][0].update(replica=self.id, sessions=len(self.sessions), node=os.uname().nodename)
        return out

    # ----------------------------------------------------------------- the operations a session asks for

    def _files(self, s: Session, images: list[tuple[str, bytes]]) -> list[str]:
        paths = []
        for name, raw in images:
            path = s.files / f"upload-{time.monotonic_ns()}-{Path(name).name}"
            path.write_bytes(raw)
            paths.append(str(path))
        return paths

    def op_chat(self, s: Session, text: str, images: list, settings, recall, recall_first: bool = False,
                history: list = ()) -> Request:
        for role, past, past_images in history:
            self.service.add_history(s, role, past, self._files(s, past_images))
        return self.service.chat(s, text, self._files(s, images), settings, recall, recall_first).request

    def op_regenerate(self, s: Session, settings, recall) -> Request:
        return self.service.regenerate(s, settings, recall).request

    def op_clear(self, s: Session) -> None:
        self.service.clear(s)

    def op_load_conversation(self, s: Session, text: str) -> None:
        with tempfile.NamedTemporaryFile("w", suffix=".json", dir=s.files, delete=False, encoding="utf-8") as fh:
            fh.write(text)
        self.service.load_conversation(s, fh.name)

    def op_build_example(self, s: Session) -> Request:
        return self.service.banks.build_example(s)

    def op_write(self, s: Session, text: str, images: list) -> Request:
        return self.service.banks.write(s, text, self._files(s, images))

    def op_delete(self, s: Session, ids: str) -> Request:
        return self.service.banks.delete(s, ids)

    def op_upload(self, s: Session, name: str, data: bytes) -> int:
        path = s.files / Path(name).name
        path.write_bytes(data)
        return len(self.service.banks.upload(s, path))

    def op_use(self, s: Session, which: str) -> None:
        self.service.banks.use(s, which)

    def op_find(self, s: Session, query: str, top_k: int) -> list[dict]:
        return self.service.banks.find(s, query, top_k)

    def op_save_bank(self, s: Session, fmt: str) -> tuple[str, bytes]:
        path = self.service.banks.save(s, fmt)
        return path.name, path.read_bytes()


"""One model replica: a Ray Serve deployment that runs the in-process chat `Service` (its own model,
continuous batch and compiled step) for the sessions routed to it.

The front door (`serve.front`) keeps every session's `Record`: the exact conversation (`Conversation.to_json`:
token ids, injected vectors, images inline) and what the page shows of it (`chat.state.SessionState`). Each call
brings the record and names a session operation of `chat.operations`; the replica runs it on its live session
(and KV cache) when it holds the same version, and otherwise rebuilds the session from the record first: the
session came from a replica that died or was removed. Every call streams its events and ends with the session's
new record.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from chat.config import Config
from chat.operations import OPERATIONS, Operation
from chat import transcript
from chat.session import Session
from chat.state import SessionState
from chat.users import LOCAL
from chat.worker import Failed, Notice, Request, ServiceError, describe
from decoding.events import DoneEvent

log = logging.getLogger("serve.replica")


@dataclass
class Record:
    """A session as the front door keeps it: enough to show it, and to rebuild it on any replica."""

    version: int = 0  # counts the calls that ended on it; a replica with another version rebuilds
    conversation: str | None = None  # chat.transcript.save, None while empty
    bank_use: str = "shared"
    state: SessionState | None = None  # what the page shows; None before the first call
    replica: str = ""  # the replica that wrote it (Ray Serve's replica id)
    running: int = 0  # answers running on that replica when it wrote it
    user: str = LOCAL  # whose memory the session reads and writes: the front door's (its login or `/v1` key)


@dataclass(frozen=True)
class Result:
    """The value of a call that is not an answer (a bank edit's, a search's, a file as an `Upload`)."""

    value: Any


@dataclass(frozen=True)
class Missing:
    """A call that is not queued named what is not there (its `KeyError`: "no such memory of yours"), raised again at
    the front door as it is in one process (the API's 404)."""

    message: str


def _slim(event: Any) -> Any:
    """What travels of an event: a finished answer's result without its KV cache and vectors."""
    if isinstance(event, DoneEvent):
        result = dataclasses.replace(event.result, cache=None, memory_vectors=[], logits=None, attention_mask=None)
        return DoneEvent(result)
    return event


def _as_user(s: Session, user: str) -> None:
    """The session is `user`'s from now on; a change to another user's memory is not theirs to undo."""
    if s.user != user:
        s.user, s.last_change = user, None


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
        version than the front door's (the session was served elsewhere meanwhile). Either way it is the record's
        user's: every memory of theirs it reads or writes here is theirs, as in one process."""
        with self._lock(key):
            held = self.sessions.get(key)
            if held is not None and held[1] >= record.version and held[0].id in self.service.sessions:
                _as_user(held[0], record.user)
                return held[0], []
            svc = self.service
            s = held[0] if held is not None else svc.new_session(record.user)
            _as_user(s, record.user)
            svc.touch(s)
            notices = []
            with s.lock:
                s.conv = None
                if record.conversation is not None:
                    transcript.load(svc.conversation(s), record.conversation, s.files)
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
        conv = s.conv
        with s.lock:
            text = transcript.save(conv) if conv is not None and conv.messages else None
        return Record(version, text, s.bank_use, self.service.state(s, details=True), self.id,
                      len(self.service.worker.running), user=s.user)

    # ----------------------------------------------------------------- calls

    async def call(self, key: str, record: Record, op: str, args: dict) -> AsyncIterator[Any]:
        """Run the operation `op` for the session `key`: stream its events, then a `Result`, then its `Record`.
        An error is a `chat.worker.Failed` event; the record is sent whatever happened."""
        from chat.worker import END

        if op not in OPERATIONS:
            yield Failed(f"replica {self.id} has no operation {op!r}: expected one of {', '.join(OPERATIONS)}")
            return
        try:
            s, notices = await asyncio.to_thread(self._session, key, record)
        except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
            yield Failed(f"this conversation could not be rebuilt on replica {self.id}: {describe(e)}")
            return
        for notice in notices:
            yield notice
        operation, out = OPERATIONS[op], None
        try:
            out = await asyncio.to_thread(self._run, operation, s, args)
            if isinstance(out, Request):
                while (event := await self.service.next_event(out, None)) is not END:
                    yield _slim(event)
                if out.error is None:
                    yield Result(operation.pack_result(out.result))
            else:
                yield Result(operation.pack_result(out))
        except KeyError as e:
            yield Failed(describe(e), "refused") if operation.queued else Missing(describe(e))
        except ServiceError as e:  # (the request's to change: the OpenAI API's 400, as `chat.worker.Worker._fail`)
            yield Failed(describe(e), "refused", e.api)
        except (ValueError, FileNotFoundError, OSError) as e:
            yield Failed(describe(e))
        except BaseException:  # the caller went away (its stream was cancelled): the answer stops within a step
            if isinstance(out, Request) and not out.done.is_set():
                self.service.withdraw(out)
            raise
        yield await asyncio.to_thread(self._record, key)

    def _run(self, operation: Operation, s: Session, args: dict) -> Any:
        """The operation run here, on the files that came with it written into the session's folder."""
        return self.service.run(operation.run, s, **operation.unpack(args, s.files))

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

"""What the page and `/v1` ask of a chat service (`ChatService`), and the part of it every service shares.

`chat.service.Service` (the model in this process) and `serve.front.RemoteService` (the model in Ray Serve
replicas) both implement `ChatService` on `SessionService`: sessions and their folders, the limits, starting,
following and stopping answers are the same code for both. The session operations (`chat.operations`: the
conversation's and the banks') are reached through `run`; what the page shows of a session is its
`SessionState`, rendered by `chat.view`.
"""

from __future__ import annotations

import itertools
import queue
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from chat.config import Config, configured_backend
from chat.inputs import Limits, check_message, check_new_tokens
from chat.operations import Past, answer, answer_again
from chat.session import Session
from chat.state import MessageState, SessionState
from chat.users import LOCAL, Users
from chat.view import TurnView
from chat.worker import END, Request, Runner, ServiceError
from decoding.settings import GenerationSettings, RecallSettings

P = ParamSpec("P")  # an operation's arguments after the service and the session
R = TypeVar("R")  # what it returns


class Model(Protocol):
    """The model as the page and `/v1` know it."""

    name: str
    is_vision: bool  # whether it reads images (the page offers its image example only then)


@dataclass
class Turn:
    """An answer as the page follows it: the session when it was asked for, the messages above it, the answer."""

    request: Request
    view: TurnView
    before: SessionState
    shown: tuple[MessageState, ...]


class ChatService(Protocol):
    """Everything the page and `/v1` ask of a chat service."""

    cfg: Config
    users: Users | None  # the people of app.users_file (None: one local user)

    @property
    def lm(self) -> Model | None: ...  # None while the model loads

    # sessions: one a browser tab or API request
    def new_session(self, user: str = LOCAL) -> Session: ...
    def touch(self, s: Session) -> None: ...
    def end_session(self, s: Session | None) -> None: ...

    # answers
    def chat(self, s: Session, text: str, images: Sequence[str], settings: GenerationSettings,
             recall: RecallSettings, recall_first: bool = False, history: Sequence[Past] = ()) -> Turn: ...
    def regenerate(self, s: Session, settings: GenerationSettings, recall: RecallSettings) -> Turn: ...
    def follow(self, turn: Turn) -> AsyncIterator[Turn]: ...
    def stop(self, s: Session) -> list[Request]: ...
    def settle(self, s: Session) -> None: ...

    # the session operations of chat.operations: clear, save and load a conversation, the banks'
    def run(self, op: Callable[Concatenate[Any, Session, P], R], s: Session,
            *args: P.args, **kwargs: P.kwargs) -> R: ...

    # what the page shows
    def state(self, s: Session, details: bool = False) -> SessionState: ...

    # the model and its requests
    def backend(self) -> str: ...
    def health(self) -> dict: ...
    def ready(self) -> Request: ...
    async def wait_for(self, req: Request) -> Any: ...
    async def next_event(self, req: Request, timeout: float | None) -> Any: ...
    def withdraw(self, req: Request) -> None: ...
    def close(self) -> None: ...


class SessionService:
    """The part of a `ChatService` that is the same wherever the model runs. A subclass sets `worker`, runs
    operations (`run`), says what a session is (`state`) and frees what one holds (`_free`)."""

    worker: Runner

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.users = Users(cfg.app.users_file) if cfg.app.users_file else None  # a missing or bad file stops here
        self.limits = Limits(cfg.app.max_message_chars, cfg.app.max_input_tokens, cfg.app.max_new_tokens_cap,
                             cfg.memory.max_memories_per_session)
        self.files = Path(tempfile.mkdtemp(prefix="recall-chat-"))
        self._ids = itertools.count(1)
        self.sessions: dict[int, Session] = {}  # live sessions, freed on page close or after the idle TTL

    def close(self) -> None:
        shutil.rmtree(self.files, ignore_errors=True)

    def run(self, op: Callable[Concatenate[Any, Session, P], R], s: Session, *args: P.args, **kwargs: P.kwargs) -> R:
        raise NotImplementedError

    def state(self, s: Session, details: bool = False) -> SessionState:
        raise NotImplementedError

    def backend(self) -> str:
        """The backend the model runs on: "transformers" or "llamacpp" (the configured one's)."""
        return configured_backend(self.cfg)

    # ----------------------------------------------------------------- sessions

    def new_session(self, user: str = LOCAL) -> Session:
        s = Session(next(self._ids), user)
        self._open(s)
        return s

    def touch(self, s: Session) -> None:
        """The session is in use: it is not idle, and if it was freed it starts again, empty."""
        s.last_used = time.monotonic()
        if s.id not in self.sessions:
            self._open(s)

    def _open(self, s: Session) -> None:
        s.files = self.files / f"session-{s.id}"
        s.files.mkdir(exist_ok=True)
        self.sessions[s.id] = s

    def end_session(self, s: Session | None) -> None:
        """A page closed or a session's time to live ran out: stop its work and free all it holds."""
        if not isinstance(s, Session) or self.sessions.pop(s.id, None) is None:
            return
        self._free(s)
        shutil.rmtree(s.files, ignore_errors=True)

    def _free(self, s: Session) -> None:
        raise NotImplementedError

    # ----------------------------------------------------------------- answers

    def checked(self, text: str, images: Sequence[str], settings: GenerationSettings) -> tuple[str, list[str]]:
        """A new message within the limits: its text stripped and its image paths; `ServiceError` else."""
        check_message(text, list(images or ()), self.limits)
        check_new_tokens(settings.max_new_tokens, self.limits)
        text, images = text.strip(), [str(p) for p in images or ()]
        if not text and not images:
            raise ServiceError("type a message (or attach an image)")
        return text, images

    def chat(self, s: Session, text: str, images: Sequence[str], settings: GenerationSettings,
             recall: RecallSettings, recall_first: bool = False, history: Sequence[Past] = ()) -> Turn:
        """Queue an answer to a new user message (after `history`, the earlier messages its client keeps)."""
        self.touch(s)
        text, images = self.checked(text, images, settings)
        before = self.state(s)
        req = self.run(answer, s, text, images, settings, recall, recall_first, history)
        return Turn(req, TurnView(), before, (*before.messages, MessageState("user", text, tuple(images))))

    def regenerate(self, s: Session, settings: GenerationSettings, recall: RecallSettings) -> Turn:
        """Queue a new answer to the last user message, replacing the last answer."""
        before = self.state(s)
        if not before.messages or before.messages[-1].role != "assistant":
            if s.lock.locked():  # (the answer being written is not in the conversation yet)
                raise ServiceError("an answer is being written: regenerate once it has ended, or Stop it first")
            raise ServiceError("there is no answer to regenerate yet")
        check_new_tokens(settings.max_new_tokens, self.limits)
        return Turn(self.run(answer_again, s, settings, recall), TurnView(), before, before.messages[:-1])

    async def follow(self, turn: Turn) -> AsyncIterator[Turn]:
        """The turn as its events arrive, at most `app.ui_updates_per_second` times a second, then once done.

        When the consumer goes away (the page cancels the event), the request is stopped.
        """
        req, view = turn.request, turn.view
        interval = 1.0 / self.cfg.app.ui_updates_per_second
        last, dirty = 0.0, False
        try:
            while not view.done:
                timeout = max(0.0, last + interval - time.monotonic()) if dirty else None
                event = await self.worker.next_event(req, timeout)
                while event is not None:
                    if event is END:
                        view.done = True
                        break
                    view.apply(event)
                    dirty = True
                    try:
                        event = req.events.get_nowait()
                    except queue.Empty:
                        event = None
                if view.done or time.monotonic() - last >= interval:
                    last, dirty = time.monotonic(), False
                    yield turn
        finally:
            if not view.done:
                self.withdraw(req)

    def stop(self, s: Session) -> list[Request]:
        """Stop this session's answers (never another session's); returns the requests stopped."""
        stopped = [r for r in s.active if not r.done.is_set()]
        for req in stopped:
            self.withdraw(req)
        return stopped

    def settle(self, s: Session) -> None:
        """Stop this session's answers and wait (a minute at most each) until they have ended."""
        for req in self.stop(s):
            req.done.wait(60)

    # ----------------------------------------------------------------- requests

    async def wait_for(self, req: Request) -> Any:
        """Await a request's end: its result, or `ServiceError` with its message."""
        return await self.worker.wait_for(req)

    async def next_event(self, req: Request, timeout: float | None) -> Any:
        """A streamed request's next event, or None after `timeout` seconds without one."""
        return await self.worker.next_event(req, timeout)

    def withdraw(self, req: Request) -> None:
        """Stop `req`: a running one ends within one decoding step, a waiting one leaves the queue now."""
        self.worker.withdraw(req)


"""The chat service behind the UI: sessions, one model worker with a queue, memory bank operations.

One worker thread owns the model. Generation, memory encoding and bank edits are requests on its
queue and run one at a time, so the model never serves two requests at once and a bank is never
edited in the middle of a recall. Every request has its own interrupt event and its own event
queue, which ends with `END`; a waiting request is told how many requests are ahead of it.

Sessions hold one browser tab's state: its `Conversation`, the request it is running, and which
bank it uses: the shared bank (`memory.bank` of the config), the example bank (built once from
`assets/example_memories.txt`, shared), or its own (uploaded, or a copy made on its first edit of
a shared bank: a session's edits never reach other sessions).

Nothing here imports Gradio; `app.py` renders what these functions return.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
import logging
import queue
import re
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import GeneratorType
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from chat.config import Config
from chat.models import EMBEDDED_NAME, LoadedModel, load_model
from chat.session import Conversation, TextOnlyModelError
from chat.textsearch import TextSearch
from chat.vision import IMAGE_PAD, VISION_END, VISION_START, encode_with_images
from decoding.events import DoneEvent, FinishEvent, RecallEvent, TokenEvent
from decoding.settings import GenerationSettings, RecallSettings
from memory import BankError, MemoryVectorDB, encode_inputs, encode_texts

log = logging.getLogger("chat.service")

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EXAMPLE_MEMORIES = ASSETS / "example_memories.txt"
EXAMPLE_IMAGES = (ASSETS / "example_lighthouse.png", ASSETS / "example_cat.png")
BANK_TYPES = (".pt", ".safetensors", ".npy")

END = object()  # the last item of every request's event queue
_WAITERS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="recall-chat-wait")  # threads blocked on queues


# --------------------------------------------------------------------------- requests and the worker


@dataclass(frozen=True)
class Waiting:
    ahead: int  # requests before this one; 0 = it is running


@dataclass(frozen=True)
class Notice:
    text: str


@dataclass(frozen=True)
class Failed:
    message: str


class ServiceError(ValueError):
    """A request that could not be done; the message is meant for the user."""


_ids = itertools.count(1)


@dataclass(eq=False)
class Request:
    """One piece of work for the model worker. `run(interrupt)` returns a value or an event generator."""

    kind: str
    run: Callable[[threading.Event], Any]
    session_id: int | None = None
    label: str = ""
    id: int = field(default_factory=lambda: next(_ids))
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


class Worker:
    """A thread that runs requests one at a time, in order of submission."""

    def __init__(self, name: str = "recall-chat-model"):
        self._pending: deque[Request] = deque()
        self._cond = threading.Condition()
        self.current: Request | None = None
        self.history: deque[Request] = deque(maxlen=256)  # finished requests, newest last
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> Request:
        with self._cond:
            if self._closed:
                raise ServiceError("the server is shutting down")
            self._pending.append(req)
            req.events.put(Waiting(len(self._pending) - 1 + (self.current is not None)))
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
        req.reason = "interrupted"
        self._close(req)

    def _announce(self) -> None:
        running = self.current is not None
        for i, req in enumerate(self._pending):
            req.events.put(Waiting(i + running))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                req = self.current = self._pending.popleft()
                req.events.put(Waiting(0))
                self._announce()
            req.started = time.perf_counter()
            try:
                if req.interrupt.is_set():
                    req.reason = "interrupted"
                else:
                    req.context.run(self._drive, req)
            except Exception as e:  # noqa: BLE001 - reported to the requester
                if not isinstance(e, (ValueError, KeyError, FileNotFoundError)):
                    log.exception("request %d (%s) failed", req.id, req.kind)
                req.error = describe(e)
                req.events.put(Failed(req.error))
            finally:
                with self._cond:
                    self.current = None
                self._close(req)

    @staticmethod
    def _drive(req: Request) -> None:
        out = req.run(req.interrupt)
        if not isinstance(out, GeneratorType):
            req.result = out
            return
        while True:
            try:
                event = next(out)
            except StopIteration as stop:
                req.result = stop.value
                return
            if isinstance(event, TokenEvent):
                req.steps += 1
            elif isinstance(event, FinishEvent):
                req.reason = event.reason
            req.events.put(event)

    def _close(self, req: Request) -> None:
        req.finished = time.perf_counter()
        self.history.append(req)
        req.events.put(END)
        req.done.set()

    def close(self, timeout: float | None = 5.0) -> None:
        with self._cond:
            self._closed = True
            for req in list(self._pending):
                req.stop()
            self._cond.notify_all()
        if self.current is not None:
            self.current.stop()
        self._thread.join(timeout)


async def wait_for(req: Request) -> Any:
    """Await a request's end; its result, or `ServiceError` with its message."""
    await asyncio.get_running_loop().run_in_executor(_WAITERS, req.done.wait)
    if req.error is not None:
        raise ServiceError(req.error)
    return req.result


# --------------------------------------------------------------------------- what the UI shows


def marker(recall: Mapping[str, Any]) -> tuple[str, str]:
    """A `<|memory_pad|>` as a highlight segment: (text, label "memory 0.84")."""
    text = recall.get("text")
    body = f"memory #{recall['memory_index']}" + (f": {text}" if text else "")
    return f"⟨{body}⟩", f"memory {recall['score']:.2f}"


def inline_text(segments: Sequence[tuple[str, str | None]]) -> str:
    """An answer for the chat window, each memory marker short: `⟨memory #3 · 0.84⟩`."""
    short = lambda text, label: f"`{_MARKER_HEAD.match(text)[0]} · {label.split()[1]}⟩`"  # noqa: E731
    return "".join(text if label is None else short(text, label) for text, label in segments)


_MARKER_HEAD = re.compile(r"⟨memory #\d+")


@dataclass
class TurnView:
    """The live state of one answer, built from the request's events (pure)."""

    segments: list[tuple[str, str | None]] = field(default_factory=list)
    recalls: list[dict] = field(default_factory=list)
    ahead: int | None = None
    tokens: int = 0
    reason: str | None = None
    notices: list[str] = field(default_factory=list)
    error: str | None = None
    done: bool = False

    def apply(self, event: Any) -> None:
        if isinstance(event, Waiting):
            self.ahead = event.ahead
        elif isinstance(event, TokenEvent):
            self.tokens += 1
            if event.text:
                if self.segments and self.segments[-1][1] is None:
                    self.segments[-1] = (self.segments[-1][0] + event.text, None)
                else:
                    self.segments.append((event.text, None))
        elif isinstance(event, RecallEvent):
            recall = dataclasses.asdict(event)
            self.recalls.append(recall)
            self.segments.append(marker(recall))
        elif isinstance(event, FinishEvent):
            self.reason = event.reason
        elif isinstance(event, Notice):
            self.notices.append(event.text)
        elif isinstance(event, Failed):
            self.error = event.message

    @property
    def state(self) -> str:
        if self.error:
            state = f"⚠ {self.error}"
        elif self.done:
            state = {"interrupted": f"stopped after {self.tokens} tokens", "length": "done (max new tokens)",
                     None: "stopped before it started"}.get(self.reason, "done")
        elif self.ahead:
            state = f"waiting: {self.ahead} ahead"
        else:
            state = f"generating… {self.tokens} tokens" if self.tokens else "reading the prompt…"
        return " · ".join([state, *self.notices])


def answer_segments(conv: Conversation, i: int) -> list[tuple[str, str | None]]:
    """Stored assistant message `i` as highlight segments, memory markers at their positions."""
    msg = conv.messages[i]
    end = conv.messages[i + 1].start if i + 1 < len(conv.messages) else len(conv.ids)
    decode = lambda a, b: conv.lm.tokenizer.decode(conv.ids[a:b], skip_special_tokens=True)  # noqa: E731
    segments: list[tuple[str, str | None]] = []
    cursor = msg.start
    for recall in sorted(msg.recalls, key=lambda r: r["position"]):
        if (text := decode(cursor, recall["position"])):
            segments.append((text, None))
        segments.append(marker(recall))
        cursor = recall["position"] + 1
    if (text := decode(cursor, end)):
        segments.append((text, None))
    return segments


def user_message(text: str, images: Sequence[str]) -> dict:
    content: list[Any] = [{"path": str(p)} for p in images]
    if text:
        content.append(text)
    return {"role": "user", "content": content}


def chat_messages(conv: Conversation | None, upto: int | None = None) -> list[dict]:
    """The conversation (its first `upto` messages) as chat-window messages."""
    if conv is None:
        return []
    out = []
    for i, msg in enumerate(conv.messages[:upto]):
        if msg.role == "user":
            out.append(user_message(msg.text, msg.images))
        else:
            note = " _(stopped)_" if msg.finish_reason == "interrupted" else ""
            out.append({"role": "assistant", "content": inline_text(answer_segments(conv, i)) + note})
    return out


RECALL_COLUMNS = ["turn", "position", "score", "memory", "text"]


def recall_table(conv: Conversation | None, live: TurnView | None = None) -> pd.DataFrame:
    """Every injection of the conversation (and of the answer being written): one row each."""
    answers = [m.recalls for m in conv.messages if m.role == "assistant"] if conv is not None else []
    if live is not None and not live.done:
        answers.append(live.recalls)
    rows = [(turn, r["position"], round(r["score"], 4), r["memory_index"], r.get("text") or "")
            for turn, recalls in enumerate(answers, 1) for r in recalls]
    return pd.DataFrame(rows, columns=RECALL_COLUMNS)


def parse_ids(text: str) -> list[int]:
    """`"3, 5-7"` -> [3, 5, 6, 7]."""
    ids: list[int] = []
    for part in filter(None, (p.strip() for p in re.split(r"[,\s]+", text or ""))):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ServiceError(f"{part!r} is not a memory id: give ids like 3, 5-7")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo or hi - lo > 100_000:
            raise ServiceError(f"{part!r} is not a valid id range")
        ids += range(lo, hi + 1)
    if not ids:
        raise ServiceError("give the ids of the memories to delete, e.g. 3, 5-7")
    return ids


GENERATION_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
                     "no_repeat_ngram_size", "max_new_tokens", "seed")
RECALL_FIELDS = {"recall_enabled": "enabled", "recall_top_k": "top_k", "recall_top_p": "top_p",
                 "recall_temperature": "temperature", "recall_sampling": "use_sampling"}


def request_settings(cfg: Config, values: Mapping[str, Any]) -> tuple[GenerationSettings, RecallSettings]:
    """The config's settings with the UI's values; the engine's ValueError for an invalid combination."""
    gen = {k: values[k] for k in GENERATION_FIELDS if k in values}
    recall = {name: values[k] for k, name in RECALL_FIELDS.items() if k in values}
    return dataclasses.replace(cfg.generation, **gen), dataclasses.replace(cfg.memory.autoregressive_recall, **recall)


# --------------------------------------------------------------------------- sessions


@dataclass(eq=False)
class Session:
    """One browser tab: its conversation, its running request, its bank choice."""

    id: int
    conv: Conversation | None = None
    bank_use: str = "shared"  # shared | example | own
    own_bank: MemoryVectorDB | None = None
    own_label: str = ""
    active: list[Request] = field(default_factory=list)  # the answers it runs or waits for
    last_speed: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # the conversation; held for a whole turn

    def __deepcopy__(self, memo: dict) -> Session:
        return self  # a live handle: Gradio's State deep-copies initial values, this one must stay itself


@dataclass
class Turn:
    """A chat request as the UI follows it: what was shown before it, and the live answer."""

    request: Request
    view: TurnView
    history: list[dict]
    user: dict | None


# --------------------------------------------------------------------------- the service


class Service:
    """Everything the UI can ask for. One per server; thread-safe."""

    def __init__(self, cfg: Config, lm: LoadedModel | None = None,
                 loader: Callable[[], LoadedModel] | None = None, text_search: TextSearch | None = None):
        self.cfg = cfg
        self._lm = lm
        self._loader = loader or (lambda: load_model(cfg.model.path, adapter=cfg.model.adapter,
                                                     device=cfg.model.device, dtype=cfg.model.dtype))
        self.shared_bank: MemoryVectorDB | None = None
        self.shared_note = ""
        self.example_bank: MemoryVectorDB | None = None
        self.text_search = text_search or TextSearch()
        self.files = Path(tempfile.mkdtemp(prefix="recall-chat-"))
        self._sessions = itertools.count(1)
        self.worker = Worker()
        if lm is not None:
            self._load_shared_bank(lm)

    def close(self) -> None:
        self.worker.close()
        shutil.rmtree(self.files, ignore_errors=True)

    # ----------------------------------------------------------------- the model

    @property
    def lm(self) -> LoadedModel | None:
        """The model, or None while it is not loaded yet."""
        return self._lm

    def _model(self) -> LoadedModel:
        """The model, loaded on first use (on the worker thread only)."""
        if self._lm is None:
            lm = self._loader()
            self._load_shared_bank(lm)
            self._lm = lm
        return self._lm

    def _load_shared_bank(self, lm: LoadedModel) -> None:
        path = self.cfg.memory.bank
        if path is None:
            return
        try:
            self.shared_bank = MemoryVectorDB.load(path, index=self.cfg.memory.index, expected_dim=lm.hidden_size,
                                                   max_bytes=self.cfg.memory.max_upload_mb * 2 ** 20)
            self.shared_note = Path(path).name
        except (BankError, FileNotFoundError) as e:
            self.shared_note = f"not loaded: {describe(e)}"
            log.error("memory.bank %s: %s", path, self.shared_note)

    def ready(self) -> Request:
        """A request that loads the model (when not yet loaded); submit it from a handler to show progress."""
        return self.worker.submit(Request("load", lambda _: self._model().name))

    def _wait_model(self) -> LoadedModel:
        if self._lm is None:
            req = self.ready()
            req.done.wait()
            if req.error:
                raise ServiceError(f"the model could not be loaded: {req.error}")
        return self._lm

    # ----------------------------------------------------------------- sessions

    def new_session(self) -> Session:
        return Session(next(self._sessions))

    def end_session(self, session: Session | None) -> None:
        if isinstance(session, Session):
            self.stop(session)

    def bank(self, s: Session) -> MemoryVectorDB | None:
        return {"shared": self.shared_bank, "example": self.example_bank, "own": s.own_bank}[s.bank_use]

    def bank_label(self, s: Session) -> str:
        if s.bank_use == "own":
            return s.own_label
        if s.bank_use == "example":
            return "the example bank (shared)"
        return f"the shared bank ({self.shared_note})" if self.cfg.memory.bank else "none"

    def _conversation(self, s: Session) -> Conversation:
        if s.conv is None:
            s.conv = Conversation(self._model())
        return s.conv

    # ----------------------------------------------------------------- chatting

    def chat(self, s: Session, text: str, images: Sequence[str], settings: GenerationSettings,
             recall: RecallSettings, recall_first: bool = False) -> Turn:
        """Queue an answer to a new user message."""
        text, images = (text or "").strip(), [str(p) for p in images or ()]
        if not text and not images:
            raise ServiceError("type a message (or attach an image)")
        history = chat_messages(s.conv)

        def run(interrupt: threading.Event) -> Iterator[Any]:
            nonlocal recall_first
            with s.lock:
                conv, bank = self._conversation(s), self.bank(s)
                if recall_first and not (bank is not None and len(bank) and recall.enabled):
                    recall_first = False
                    yield Notice("recall first needs a memory bank and recall enabled; answering without")
                events = conv.stream(text, images, settings, recall, bank, interrupt, recall_first)
                try:
                    first = next(events)
                except TextOnlyModelError as e:
                    if not text:
                        raise ServiceError(f"{e}; there is no text to answer instead") from None
                    yield Notice(f"{e}; answering the text alone")
                    events = conv.stream(text, (), settings, recall, bank, interrupt, recall_first)
                    first = next(events)
                yield from self._answer(s, itertools.chain([first], events))

        return self._start(s, Request("chat", run, s.id, text[:80]), history, user_message(text, images))

    def regenerate(self, s: Session, settings: GenerationSettings, recall: RecallSettings) -> Turn:
        """Queue a new answer to the last user message, replacing the last answer."""
        conv = s.conv
        if conv is None or not conv.messages or conv.messages[-1].role != "assistant":
            raise ServiceError("there is no answer to regenerate yet")
        history = chat_messages(conv, -1)

        def run(interrupt: threading.Event) -> Iterator[Any]:
            with s.lock:
                yield from self._answer(s, conv.regenerate(settings, recall, self.bank(s), interrupt))

        return self._start(s, Request("regenerate", run, s.id, "regenerate"), history, None)

    @staticmethod
    def _answer(s: Session, events: Iterator[Any]) -> Iterator[Any]:
        """Forward a turn's events; note its speed."""
        for event in events:
            if isinstance(event, DoneEvent) and event.result.decode_seconds > 0:
                s.last_speed = event.result.steps / event.result.decode_seconds
            yield event

    def _start(self, s: Session, req: Request, history: list[dict], user: dict | None) -> Turn:
        s.active = [r for r in s.active if not r.done.is_set()] + [self.worker.submit(req)]
        return Turn(req, TurnView(), history, user)

    async def follow(self, turn: Turn) -> AsyncIterator[Turn]:
        """The turn as its events arrive, at most `app.ui_updates_per_second` times a second, then once done.

        When the consumer goes away (the page cancels the event), the request is stopped.
        """
        req, view = turn.request, turn.view
        interval = 1.0 / self.cfg.app.ui_updates_per_second
        loop = asyncio.get_running_loop()
        last, dirty = 0.0, False
        try:
            while not view.done:
                timeout = max(0.0, last + interval - time.monotonic()) if dirty else None
                try:
                    event = await loop.run_in_executor(_WAITERS, req.events.get, True, timeout)
                except queue.Empty:
                    event = None
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
                self.worker.withdraw(req)

    def stop(self, s: Session) -> list[Request]:
        """Stop this session's answers (never another session's); returns the requests stopped."""
        stopped = [r for r in s.active if not r.done.is_set()]
        for req in stopped:
            self.worker.withdraw(req)
        return stopped

    def clear(self, s: Session) -> None:
        self.stop(s)
        with s.lock:
            if s.conv is not None:
                s.conv.clear()

    def save_conversation(self, s: Session) -> Path:
        with s.lock:
            if s.conv is None or not s.conv.messages:
                raise ServiceError("there is no conversation to save yet")
            text = s.conv.to_json()
        path = self.files / f"conversation-{s.id}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(text)
        return path

    def load_conversation(self, s: Session, path: str | Path) -> None:
        lm = self._wait_model()
        self.stop(s)
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ServiceError(f"could not read {Path(path).name}: {e}") from None
        with s.lock:
            conv = s.conv or Conversation(lm)
            try:
                conv.load_json(text)
            except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
                raise ServiceError(f"{Path(path).name} is not a conversation this model can continue: "
                                   f"{describe(e)}") from None
            s.conv = conv

    # ----------------------------------------------------------------- memory banks

    def upload_bank(self, s: Session, path: str | Path) -> MemoryVectorDB:
        """Make an uploaded file this session's bank; on any problem raise and keep the current one."""
        lm = self._wait_model()
        name = Path(path).name
        if Path(path).suffix.lower() not in BANK_TYPES:
            raise ServiceError(f"{name}: expected a memory bank file ending in .pt, .safetensors or .npy")
        try:
            db = MemoryVectorDB.load(path, index=self.cfg.memory.index, expected_dim=lm.hidden_size,
                                     max_bytes=self.cfg.memory.max_upload_mb * 2 ** 20)
        except BankError as e:
            raise ServiceError(f"{e} (the model {lm.name} has hidden size {lm.hidden_size}); "
                               "the current bank is kept") from None
        s.own_bank, s.own_label, s.bank_use = db, f"your upload {name}", "own"
        return db

    def use_bank(self, s: Session, which: str) -> None:
        if which not in ("shared", "example", "own"):
            raise ServiceError(f"bank {which!r}: choose shared, example or own")
        if which == "example" and self.example_bank is None:
            raise ServiceError("the example bank is not built yet: press Build example bank")
        if which == "own" and s.own_bank is None:
            raise ServiceError("this session has no bank of its own: upload one or write memories")
        s.bank_use = which

    def build_example_bank(self, s: Session) -> Request:
        """Queue building the example bank (once per server) and switching this session to it."""
        def run(_: threading.Event) -> int:
            if self.example_bank is None:
                lines = [ln.strip() for ln in EXAMPLE_MEMORIES.read_text().splitlines() if ln.strip()]
                db = MemoryVectorDB(self._model().hidden_size, self.cfg.memory.index)
                db.add(self._encode_texts(lines), lines)
                db.info = {**self.cfg.memory.hidden_state.as_dict(), "source": EXAMPLE_MEMORIES.name}
                self.example_bank = db
            s.bank_use = "example"
            return len(self.example_bank)

        return self.worker.submit(Request("build_example_bank", run, s.id))

    def write_memories(self, s: Session, text: str, images: Sequence[str] = ()) -> Request:
        """Queue encoding typed memories (one a line) and images, and adding them to this session's bank."""
        lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
        images = [str(p) for p in images or ()]
        if not lines and not images:
            raise ServiceError("type the memories to write, one a line (or attach images)")

        def run(_: threading.Event) -> list[int]:
            lm = self._model()
            if images and not lm.is_vision:
                raise ServiceError(f"{lm.name} reads text only: memories from images need a vision-language "
                                   "model (Qwen3-VL); nothing was written")
            parts = [self._encode_texts(lines)] if lines else []
            parts += [self._encode_image(p) for p in tqdm(images, desc="encoding images", unit="image")]
            texts = lines + [f"[image] {Path(p).name}" for p in images]
            return self._writable_bank(s).add(torch.cat(parts), texts)

        return self.worker.submit(Request("write_memories", run, s.id))

    def delete_memories(self, s: Session, ids_text: str) -> Request:
        ids = parse_ids(ids_text)
        if self.bank(s) is None:
            raise ServiceError("there is no bank to delete from")

        def run(_: threading.Event) -> int:
            try:
                return self._writable_bank(s).remove(ids)
            except KeyError as e:  # unknown ids: nothing was removed
                raise ServiceError(e.args[0]) from None

        return self.worker.submit(Request("delete_memories", run, s.id))

    def _writable_bank(self, s: Session) -> MemoryVectorDB:
        """This session's own bank; a shared one is copied first (worker thread only)."""
        if s.bank_use != "own":
            shared = self.bank(s)
            if shared is None:
                s.own_bank, s.own_label = (MemoryVectorDB(self._model().hidden_size, self.cfg.memory.index),
                                           "your own bank (written here)")
            else:
                s.own_bank = shared.copy()
                s.own_label = f"your copy of {self.bank_label(s)}"
            s.bank_use = "own"
        return s.own_bank

    def _encode_texts(self, lines: list[str]) -> torch.Tensor:
        lm = self._model()
        return encode_texts(lm.model, lm.tokenizer, lines, self.cfg.memory.hidden_state, batch_size=8)

    def _encode_image(self, path: str) -> torch.Tensor:
        lm = self._model()
        inputs = encode_with_images(lm.tokenizer, lm.image_processor, VISION_START + IMAGE_PAD + VISION_END, [path])
        return encode_inputs(lm.model, inputs, self.cfg.memory.hidden_state)

    def save_bank(self, s: Session, fmt: str = ".pt") -> Path:
        db = self.bank(s)
        if db is None or len(db) == 0:
            raise ServiceError("there is no bank to download")
        if fmt not in BANK_TYPES:
            raise ServiceError(f"format {fmt!r}: choose one of {', '.join(BANK_TYPES)}")
        path = self.files / f"memory-bank-{s.id}-{len(db)}{fmt}"
        db.save(path)
        return path

    def find_memories(self, s: Session, query: str, top_k: int = 5) -> pd.DataFrame:
        db = self.bank(s)
        if db is None:
            raise ServiceError("there is no bank to search: build the example bank or upload one")
        hits = self.text_search.search(db, query, int(top_k))
        return pd.DataFrame([(h["index"], round(h["score"], 4), h["text"]) for h in hits],
                            columns=["memory", "similarity", "text"])

    def bank_summary(self, s: Session) -> str:
        db = self.bank(s)
        where = self.bank_label(s)
        if db is None:
            return f"**Bank:** {where}. No memories: recall is off. Build the example bank or upload one."
        index = f", {db.index} index" if db.index != "flat" else ""
        return f"**Bank:** {where} · **{len(db)}** memories · dimension **{db.dim}**{index}"

    def bank_sample(self, s: Session, count: int = 8) -> pd.DataFrame:
        db = self.bank(s)
        rows = db.entries(0, count) if db is not None else []
        return pd.DataFrame([(e["index"], e["text"] or "", round(e["norm"], 2)) for e in rows],
                            columns=["memory", "text", "norm"])

    # ----------------------------------------------------------------- the status line

    def status(self, s: Session, state: str = "") -> str:
        lm = self._lm
        model = (f"**{lm.name}** · {lm.device}" if lm is not None
                 else f"**{Path(self.cfg.model.path).name if self.cfg.model.path else EMBEDDED_NAME}** · loading…")
        db = self.bank(s)
        bank = f"bank: {len(db)} memories ({'own' if s.bank_use == 'own' else s.bank_use})" if db else "bank: none"
        speed = f"last answer {s.last_speed:.1f} tokens/s" if s.last_speed else "no answer yet"
        return " · ".join(filter(None, [model, bank, speed, state]))

"""The chat service behind the page: sessions, their banks, and the model's lifecycle.

Sessions (`chat.session.Session`) hold one browser tab's state: its `Conversation`, the requests it
runs, and which bank it uses: the shared bank (`memory.bank` of the config), the example bank (built
once from `assets/example_memories.txt`, shared), or its own (uploaded, or a copy made on its first
edit of a shared bank: a session's edits never reach other sessions). All model work goes through
the one `Worker`. Nothing here imports Gradio; `app.py` renders what `chat.view` makes of it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import queue
import itertools
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from chat.config import Config, load_options
from chat.session import Conversation, Session, text_only_message
from chat.textsearch import TextSearch
from chat.banks import Banks
from chat.inputs import Limits, check_message, check_new_tokens, read_upload_text
from chat.view import TurnView, bank_sample, bank_summary, chat_messages, recall_table, status_line, user_message
from chat.worker import END, Notice, Request, ServiceError, Worker, describe
from decoding import compiled
from decoding.events import DoneEvent
from decoding.mixture import MixtureResult
from decoding.settings import GenerationSettings, RecallSettings
from memory import BankError
from memory.files import atomic_write
from memory.milvus import MilvusBank
from models import EMBEDDED_NAME, LoadedModel, load_model

log = logging.getLogger("chat.service")

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EXAMPLE_IMAGES = (ASSETS / "example_lighthouse.png", ASSETS / "example_cat.png")


NO_MEMORY = ("the model looked for a memory, but there is none to read (no bank, or recall is off): it answered "
             "from what it knows; build the example bank or load one")


# --------------------------------------------------------------------------- sessions


def _return_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them in per-thread arenas otherwise, so a
    server's RSS would never shrink after idle sessions' banks are freed)."""
    libc = ctypes.util.find_library("c")
    if libc:
        try:
            ctypes.CDLL(libc).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


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
        self._loader = loader or (lambda: load_model(cfg.model.path, load_options(cfg)))
        if cfg.memory.store == "milvus":  # refuse to start, naming the URI, when nothing answers there
            MilvusBank.connect(cfg.memory.milvus_uri).close()
        self.files = Path(tempfile.mkdtemp(prefix="recall-chat-"))
        self.limits = Limits(cfg.app.max_message_chars, cfg.app.max_input_tokens, cfg.app.max_new_tokens_cap,
                             cfg.memory.max_memories_per_session)
        self._sessions = itertools.count(1)
        self.sessions: dict[int, Session] = {}  # live sessions, freed on page close or after the idle TTL
        self._closing = threading.Event()
        self._janitor = threading.Thread(target=self._janitor_loop, name="recall-chat-janitor", daemon=True)
        self.worker = Worker()
        self.banks = Banks(cfg, self.worker, self._model, self._wait_model, self.files, text_search)
        if lm is not None:
            try:
                self.banks.load_shared(lm)
            except BaseException:
                self.close()
                raise
        self._janitor.start()

    def close(self) -> None:
        self._closing.set()
        self.worker.close()
        shutil.rmtree(self.files, ignore_errors=True)

    def _janitor_loop(self) -> None:
        ttl = self.cfg.app.session_ttl_s
        while not self._closing.wait(min(5.0, ttl / 2)):
            self.free_idle_sessions(ttl)

    def free_idle_sessions(self, ttl: float) -> int:
        """Free every session idle for more than `ttl` seconds with nothing running; how many."""
        now = time.monotonic()
        idle = [s for s in list(self.sessions.values())
                if now - s.last_used > ttl and not any(not r.done.is_set() for r in s.active)]
        for s in idle:
            log.info("session %d idle for %.0f s: freed", s.id, now - s.last_used)
            self.end_session(s)
        if idle:
            gc.collect()
            _return_freed_memory()
        return len(idle)

    # ----------------------------------------------------------------- the model

    @property
    def lm(self) -> LoadedModel | None:
        """The model, or None while it is not loaded yet."""
        return self._lm

    def _model(self) -> LoadedModel:
        """The model, loaded on first use (on the worker thread only)."""
        if self._lm is None:
            lm = self._loader()
            self.banks.load_shared(lm)
            self._lm = lm
            self._compile(lm)
        return self._lm

    def _compile(self, lm: LoadedModel) -> None:
        """With `model.compile`, compile the decode step of a text model in the background: answers
        decode eagerly until it is ready, and the status line says so meanwhile."""
        if self.cfg.model.compile and not lm.is_vision and lm.backend == "transformers":
            step = compiled.enable(lm.merged())
            threading.Thread(target=step.warm_up, name="recall-chat-compile", daemon=True).start()

    def _compile_state(self) -> str:
        """"compiling the decode step…" while it compiles, "" otherwise (also when compiling failed or is off)."""
        step = compiled.attached(self._lm.model) if self._lm else None
        if step is None or step.ready.is_set() or step.error:
            return ""
        return "compiling the decode step…"

    def ready(self) -> Request:
        """A request that loads the model (when not yet loaded); submit it from a handler to show progress."""
        return self.worker.submit(Request("load", lambda _: self._model().name))

    def start(self) -> None:
        """Load the model and the shared bank now; `ServiceError` with the reason when either cannot be."""
        req = self.ready()
        req.done.wait()
        if req.error:
            raise ServiceError(req.error)

    async def wait_for(self, req: Request) -> Any:
        """Await a request's end: its result, or `ServiceError` with its message."""
        return await self.worker.wait_for(req)

    async def next_event(self, req: Request, timeout: float | None) -> Any:
        """A streamed request's next event, or None after `timeout` seconds without one."""
        return await self.worker.next_event(req, timeout)

    def withdraw(self, req: Request) -> None:
        """Stop `req`: a running one ends within one decoding step, a waiting one leaves the queue now."""
        self.worker.withdraw(req)

    def _wait_model(self) -> LoadedModel:
        if self._lm is None:
            req = self.ready()
            req.done.wait()
            if req.error:
                raise ServiceError(f"the model could not be loaded: {req.error}")
        return self._lm

    # ----------------------------------------------------------------- sessions

    def new_session(self) -> Session:
        s = Session(next(self._sessions))
        s.files = self.files / f"session-{s.id}"
        s.files.mkdir()
        self.sessions[s.id] = s
        return s

    def touch(self, s: Session) -> None:
        """The session is in use: it is not idle, and if it was freed it starts again, empty."""
        s.last_used = time.monotonic()
        if s.id not in self.sessions:
            s.files = self.files / f"session-{s.id}"
            s.files.mkdir(exist_ok=True)
            self.sessions[s.id] = s

    def end_session(self, session: Session | None) -> None:
        """A page closed or a session's time to live ran out: stop its work and free all it holds."""
        if not isinstance(session, Session):
            return
        self.sessions.pop(session.id, None)
        self.settle(session)
        with session.lock:
            session.conv = None  # its KV cache and memory vectors
            session.own_bank, session.bank_use = None, "shared"
            session.active = []
        shutil.rmtree(session.files, ignore_errors=True)

    def conversation(self, s: Session) -> Conversation:
        """The session's conversation (made on first use)."""
        if s.conv is None:
            s.conv = Conversation(self._model())
        s.conv.prefill_chunk = self.cfg.app.prefill_chunk_tokens
        s.conv.batch = self.worker.batch if self.cfg.app.batching else None
        return s.conv

    def add_history(self, s: Session, role: str, text: str, images: Sequence[str] = ()) -> None:
        """An earlier message of a conversation its client keeps (the OpenAI API's `messages`): the system
        prompt, a user message, or an answer given as text."""
        conv = self.conversation(s)
        if role == "system":
            conv.system_prompt = text
        elif role == "user":
            conv.build_inputs(text, images)
        else:
            conv.add_answer_text(text)

    def _fit(self, conv: Conversation, text: str, images: Sequence[str], settings: GenerationSettings,
             recall_first: bool) -> int:
        """Make the conversation fit the limits with this message (drop the oldest turns when configured);
        returns how many turns were dropped, or raises naming the limit and the size."""
        context = self._model().spec.context or 2 ** 31
        budget = min(self.limits.max_input_tokens, context - settings.max_new_tokens)
        dropped = 0
        while (need := conv.length_with(text, images, recall_first)) > budget:
            if self.cfg.app.context_overflow != "drop_oldest" or len(conv.messages) < 2:
                raise ServiceError(
                    f"the conversation would have {need} tokens with this message, over the limit of {budget} "
                    f"(app.max_input_tokens={self.limits.max_input_tokens}, the model's context {context} minus "
                    f"max_new_tokens={settings.max_new_tokens}): clear the conversation or send less")
            conv.drop_oldest_turn()
            dropped += 1
        return dropped

    # ----------------------------------------------------------------- chatting

    def checked(self, text: str, images: Sequence[str], settings: GenerationSettings) -> tuple[str, list[str]]:
        """A new message within the limits: its text stripped and its image paths; `ServiceError` else."""
        check_message(text, list(images or ()), self.limits)
        check_new_tokens(settings.max_new_tokens, self.limits)
        text, images = text.strip(), [str(p) for p in images or ()]
        if not text and not images:
            raise ServiceError("type a message (or attach an image)")
        return text, images

    def chat(self, s: Session, text: str, images: Sequence[str], settings: GenerationSettings,
             recall: RecallSettings, recall_first: bool = False) -> Turn:
        """Queue an answer to a new user message."""
        self.touch(s)
        text, images = self.checked(text, images, settings)
        history = chat_messages(s.conv)

        def run(interrupt: threading.Event) -> Iterator[Any]:
            nonlocal recall_first, images
            with s.lock:
                conv, bank = self.conversation(s), self.banks.of(s)
                if images and not conv.lm.is_vision:
                    message = text_only_message(conv.lm, len(images))
                    if not text:
                        raise ServiceError(f"{message}; there is no text to answer instead")
                    yield Notice(f"{message}; answering the text alone")
                    images = []
                if recall_first and not (bank is not None and len(bank) and recall.enabled):
                    recall_first = False
                    yield Notice("recall first needs a memory bank and recall enabled; answering without")
                if not interrupt.is_set() and (dropped := self._fit(conv, text, images, settings, recall_first)):
                    yield Notice(f"the conversation outgrew its limit: its {dropped} oldest turn(s) were dropped")
                yield from self._answer(s, conv.stream(text, images, settings, recall, bank, interrupt, recall_first))

        req = Request("chat", run, s.id, text[:80])
        req.on_withdraw = lambda: self._record_unanswered(s, req)
        return self._start(s, req, history, user_message(text, images))

    @staticmethod
    def _record_unanswered(s: Session, req: Request) -> None:
        """A chat stopped while it waited: keep the user's message, with an empty stopped answer.
        Its generator (which takes the session's lock) sees the set interrupt before touching the model,
        so this runs off the worker."""
        for _ in req.run(req.interrupt):
            pass

    def regenerate(self, s: Session, settings: GenerationSettings, recall: RecallSettings) -> Turn:
        """Queue a new answer to the last user message, replacing the last answer."""
        conv = s.conv
        if conv is None or not conv.messages or conv.messages[-1].role != "assistant":
            raise ServiceError("there is no answer to regenerate yet")
        check_new_tokens(settings.max_new_tokens, self.limits)
        history = chat_messages(conv, -1)

        def run(interrupt: threading.Event) -> Iterator[Any]:
            with s.lock:
                yield from self._answer(s, conv.regenerate(settings, recall, self.banks.of(s), interrupt))

        return self._start(s, Request("regenerate", run, s.id, "regenerate"), history, None)

    @staticmethod
    def _answer(s: Session, events: Iterator[Any]) -> Iterator[Any]:
        """Forward a turn's events; note its speed, and the picture of how it was decoded (entropy over
        layers, or the mixture's α* per token)."""
        s.last_plot, s.last_note = None, ""  # a failed turn shows nothing of the one before
        for event in events:
            if isinstance(event, DoneEvent):
                result = event.result
                if result.decode_seconds > 0:
                    s.last_speed = len(result.new_tokens[0]) / result.decode_seconds
                if result.missed_recall and result.missed_recall[0]:
                    yield Notice(NO_MEMORY)
                tokens = lambda: [s.conv.lm.tokenizer.decode([t]) for t in result.new_tokens[0].tolist()]  # noqa: E731
                if result.entropy is not None and result.entropy.entropies.shape[1]:
                    s.last_plot = ("entropy", result.entropy.entropies[0].cpu().numpy(),
                                   result.entropy.selected_layer_indices[0].tolist(), tokens(), result.entropy.mode)
                elif isinstance(result, MixtureResult) and result.alphas:
                    s.last_plot = ("mixture", list(result.alphas), tokens())
                    s.last_note = (f"q*: acceptance {result.acceptance_rate:.0%}, {result.tokens_per_round:.2f} "
                                   "tokens per verify" if result.drafted else "q*: direct")
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
                self.worker.withdraw(req)

    def stop(self, s: Session) -> list[Request]:
        """Stop this session's answers (never another session's); returns the requests stopped."""
        stopped = [r for r in s.active if not r.done.is_set()]
        for req in stopped:
            self.worker.withdraw(req)
        return stopped

    def settle(self, s: Session) -> None:
        """Stop this session's answers and wait (a minute at most each) until they have ended."""
        for req in self.stop(s):
            req.done.wait(60)

    def clear(self, s: Session) -> None:
        self.stop(s)
        with s.lock:
            if s.conv is not None:
                s.conv.clear()
            s.last_plot, s.last_note = None, ""

    def save_conversation(self, s: Session) -> Path:
        with s.lock:
            if s.conv is None or not s.conv.messages:
                raise ServiceError("there is no conversation to save yet")
            text = s.conv.to_json()
        path = s.files / f"conversation-{s.id}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        atomic_write(path, lambda fh: fh.write(text.encode()))
        return path

    def load_conversation(self, s: Session, path: str | Path) -> None:
        lm = self._wait_model()
        self.settle(s)
        name = Path(path).name
        try:
            text = read_upload_text(path, self.cfg.memory.max_upload_mb)
        except ValueError as e:
            raise ServiceError(str(e)) from None
        with s.lock:
            conv = s.conv or Conversation(lm)
            try:
                conv.load_json(text, s.files)
            except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
                raise ServiceError(f"{name} is not a conversation this model can continue: {describe(e)}") from None
            s.conv, s.last_plot, s.last_note = conv, None, ""

    # ----------------------------------------------------------------- what the page shows

    def messages(self, s: Session, upto: int | None = None) -> list[dict]:
        """The session's conversation (its first `upto` messages) as chat-window messages."""
        return chat_messages(s.conv, upto)

    def recall_log(self, s: Session, live: TurnView | None = None):
        """Every injection of the session's conversation (and of the answer being written), as a table."""
        return recall_table(s.conv, live)

    def bank_view(self, s: Session) -> tuple[str, Any, str]:
        """The bank the session uses: its summary, a sample of its memories, which one it is."""
        db = self.banks.of(s)
        return bank_summary(db, self.banks.label(s)), bank_sample(db), s.bank_use

    def health(self) -> dict:
        """The model worker (this process's) and the shared bank's store and size."""
        store = self.banks.shared
        size = None
        if store is not None:
            try:
                size = len(store)
            except BankError as e:
                size = f"unreachable: {e}"
        return {"replicas": [{"replica": "in-process", "alive": True, "running": len(self.worker.running),
                              "model": self._lm.name if self._lm else None}],
                "bank": {"store": self.cfg.memory.store, "size": size}}

    # ----------------------------------------------------------------- the status line

    def status(self, s: Session, state: str = "") -> str:
        self.touch(s)  # every handler renders the status line
        lm = self._lm
        if lm is None:
            model = f"**{Path(self.cfg.model.path).name if self.cfg.model.path else EMBEDDED_NAME}** · loading…"
        else:
            model = " · ".join(filter(None, [f"**{lm.name}**", str(lm.device),
                                             "" if lm.recall_trained else "recall untrained: recall first reads memories into your message", self._compile_state()]))
        return status_line(model, self.banks.of(s), s.bank_use, s.last_speed, " · ".join(filter(None, [s.last_note, state])))

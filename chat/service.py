"""The chat service with the model in this process: the model's lifecycle, the banks, the model worker.

Sessions (`chat.session.Session`) hold one browser tab's state: its `Conversation`, the requests it
runs, and which bank it uses (`chat/banks.py`). All model work goes through the one `Worker`. What the
page and `/v1` ask of it is `chat.api.ChatService`; the session operations (`chat/operations.py`) run
here, and `state` is what the page shows of a session. Nothing here imports Gradio.
"""

from __future__ import annotations

import threading
from concurrent import futures
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, Concatenate

from chat.api import P, R, SessionService
from chat.banks import Banks
from chat.config import Config, load_options
from chat.inputs import check_token_ids
from chat.janitor import Janitor
from chat.operations import operation_of
from chat.decision import FORGET, Decision, plain
from chat.changes import Remembered
from chat.people import People
from chat.session import Conversation, Session, text_only_message
from chat.state import SessionState, bank_state, message_states
from chat.textsearch import TextSearch
from chat.warmup import WarmUp
from chat.window import Window
from chat.worker import Notice, Request, ServiceError, Worker
from decoding.events import DoneEvent
from decoding.mixture import MixtureResult
from decoding.settings import GenerationSettings, RecallSettings
from memory import BankError
from memory.milvus import MilvusBank
from memory.personal import Personal
from models import EMBEDDED_NAME, LoadedModel, load_model
from models.modeling import decoder_layers
from models.spec import LAYERS

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EXAMPLE_IMAGES = (ASSETS / "example_lighthouse.png", ASSETS / "example_cat.png")
# `app.history_turns: auto` on the embedded SmolLM2-135M: deeper in one conversation it answers worse (measured by
# bench/user_memory.py's "in one conversation" rows, docs/benchmarks.md)
EMBEDDED_HISTORY_TURNS = 3


def no_memory(bank, recall: RecallSettings, yours_unread: bool = False) -> str:
    """The notice of an answer whose model looked for a memory and read none, with the reason that holds
    (`yours_unread`: the user has memories of their own, and the message does not speak of them)."""
    if not recall.enabled:
        why = "recall is off"
    elif bank is None or not len(bank):
        why = ("there is no bank to read for this message (your own memories are read for one that speaks of you: "
               "\"my ...\", \"I ...\")" if yours_unread else "there is no bank to read")
    else:
        why = f"none is close enough to the question (memory min score {recall.min_score:g})"
    return f"the model looked for a memory, but {why}: it answered from what it knows"


class Service(SessionService):
    """The chat service of one server, the model in this process. Thread-safe."""

    def __init__(self, cfg: Config, lm: LoadedModel | None = None,
                 loader: Callable[[], LoadedModel] | None = None, text_search: TextSearch | None = None):
        self._lm = lm
        self.warm = WarmUp(cfg)  # the decode steps' background compile
        self._loader = loader or (lambda: load_model(cfg.model.path, load_options(cfg)))
        if cfg.memory.store == "milvus":  # refuse to start, naming the URI, when nothing answers there
            MilvusBank.connect(cfg.memory.milvus_uri).close()
        super().__init__(cfg)
        self.janitor = Janitor(self)
        self.worker = Worker(max_running=cfg.app.max_running)
        self._embedder = futures.ThreadPoolExecutor(1, thread_name_prefix="embed")  # `_read_ahead`
        self.banks = Banks(cfg, self.worker, self._model, self.wait_model, self.files, text_search)
        self.people = People(cfg, self.users)
        turns = cfg.app.history_turns
        self.window = Window(cfg.app, self.limits, (EMBEDDED_HISTORY_TURNS if cfg.model.path is None else 0)
                             if turns == "auto" else turns)  # what the model reads of a conversation
        if lm is not None:
            try:
                self.banks.load_shared(lm)
            except BaseException:
                self.close()
                raise
        self.janitor.start()

    def close(self) -> None:
        self.janitor.close()
        self.worker.close()
        self._embedder.shutdown(wait=True)
        self.warm.stop()
        super().close()

    # ----------------------------------------------------------------- the model

    @property
    def lm(self) -> LoadedModel | None:
        """The model, or None while it is not loaded yet."""
        return self._lm

    def _model(self) -> LoadedModel:
        """The model, loaded on first use (on the worker thread only)."""
        if self._lm is None:
            lm = self._loader()
            try:  # (configured token ids the model does not have: every answer would be refused)
                check_token_ids(self.cfg.generation, lm.spec.vocab_size)
            except ValueError as e:
                raise ValueError(f"generation.{e}") from None
            if lm.spec.can(LAYERS):  # (a layer the model does not have: every memory written would be refused)
                count = len(decoder_layers(lm.model)) + 1
                for key, layer in lm.encoder.layers(lm.is_vision):
                    if not -count <= layer < count:
                        raise ValueError(f"{key}: layer {layer} is not one of {lm.name}'s: expected an index in "
                                         f"[-{count}, {count - 1}] (embeddings + {count - 1} layers)")
            self.banks.load_shared(lm)
            self._lm = lm
            self.warm.start(lm)
        return self._lm

    def ready(self) -> Request:
        """A request that loads the model (when not yet loaded); submit it from a handler to show progress."""
        return self.worker.submit(Request("load", lambda _: self._model().name))

    def start(self) -> None:
        """Load the model and the shared bank now; `ServiceError` with the reason when either cannot be."""
        req = self.ready()
        req.done.wait()
        if req.error:
            raise ServiceError(req.error)

    def wait_model(self) -> LoadedModel:
        """The model, loaded first when it is not yet (off the worker thread)."""
        if self._lm is None:
            req = self.ready()
            req.done.wait()
            if req.error:
                raise ServiceError(f"the model could not be loaded: {req.error}")
        return self._lm

    # ----------------------------------------------------------------- sessions

    def run(self, op: Callable[Concatenate[Any, Session, P], R], s: Session, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run a session operation of `chat.operations` here."""
        operation_of(op)  # (only registered operations: the same call runs on a replica)
        self.touch(s)
        return op(self, s, *args, **kwargs)

    def _free(self, s: Session) -> None:
        self.settle(s)
        with s.lock:
            s.conv = None  # its KV cache and memory vectors
            s.own_bank, s.bank_use, s.bank_chosen = None, "shared", s.bank_chosen + 1
            s.active = []

    def conversation(self, s: Session) -> Conversation:
        """The session's conversation (made on first use)."""
        if s.conv is None:
            s.conv = Conversation(self._model())
        s.conv.prefill_chunk = self.cfg.app.prefill_chunk_tokens
        s.conv.batch = self.worker.batch if self.cfg.app.batching else None
        return s.conv

    def add_history(self, s: Session, history: Sequence[tuple[str, str, Sequence[str]]], text: str,
                    settings: GenerationSettings) -> int:
        """The earlier messages of a conversation its client keeps (the OpenAI API's), before its new message
        (`Window.read`): how many of them the model does not read."""
        return self.window.read(self.conversation(s), history, text, settings)

    def _read_ahead(self, conv: Conversation, text: str, images: Sequence[str], settings: GenerationSettings,
                    recall_first: bool, interrupt: threading.Event) -> Iterator[Any]:
        """A message's memory work overlapped with reading its prompt: the key encoder embeds the message (the
        write decision's input and the memory head's query, one batch) on a thread while the prompt is read into
        the KV cache here (`Conversation.read_ahead`); returns when both are done, so the write decision and the
        recall that follow find the embeddings made and the answer prefills one token. Only for a text message to
        the plain loop, without recall first, whose prompt fits the limits; anything else runs in turn."""
        encoder = conv.lm.encoder
        if (encoder.keys is None or images or recall_first or settings.mixture.enabled or interrupt.is_set()
                or conv.length_with(text) > self.window.budget(conv, settings)[0]):
            return
        embedded = self._embedder.submit(encoder.message_query, text)
        try:
            yield from conv.read_ahead(text, interrupt)  # (its chunks' events: the worker serves others between)
        finally:
            futures.wait([embedded])  # (an error there comes again from the write decision or the recall)

    # ----------------------------------------------------------------- answers

    def answer(self, s: Session, text: str, images: Sequence[str], settings: GenerationSettings,
               recall: RecallSettings, recall_first: bool = False, unread: int = 0) -> Request:
        """Queue an answer to a new user message, checked already (`checked`); `unread`: how many earlier messages
        its client sent that the model does not read (`add_history`)."""
        def run(interrupt: threading.Event) -> Iterator[Any]:
            nonlocal recall_first, images
            with s.lock:
                conv = self.conversation(s)
                _check_tokens(conv, settings)
                recent, s.last_change = self.recent(s, conv), None
                if unread:
                    yield Notice(f"the model reads the last {len(conv.messages)} of the {unread + len(conv.messages)} "
                                 f"earlier messages: from a user's message, at most {self.window.turns or 'all'} "
                                 f"turns (app.history_turns) of {self.window.budget(conv, settings)[0]} tokens")
                if s.expired is not None:
                    yield Notice(f"this page was idle for {_span(s.expired)} (app.session_ttl_s: "
                                 f"{self.cfg.app.session_ttl_s} s), so its conversation and its bank were let go: "
                                 "this message starts a new conversation")
                    s.expired = None
                if s.lost:
                    yield Notice("the conversation this page shows is not on the server any more (it restarted): "
                                 "this message starts a new conversation")
                    s.lost = False
                yield from self.window.slide(conv)
                yield from self._read_ahead(conv, text, images, settings, recall_first, interrupt)
                reply = None  # the app's own answer: what a "forget ..." forgot, what a correction corrected (the
                # model, asked, would guess)
                # (a message stopped before here changes no memory: the stop came before its answer began)
                decision = Decision() if interrupt.is_set() else self.people.decide(conv.lm, text)
                try:
                    if changed := self.remember(s, decision, recent=recent):
                        s.last_change = changed if changed.written or changed.forgotten else None
                        yield changed
                        reply = changed.describe() if (decision.forget or decision.correct) and changed.forgotten \
                            else None
                except BankError as e:  # (a memory that cannot be read or written: said, and the answer goes on)
                    yield Notice(f"{e}: this message changed none of your memories")
                except ServiceError as e:  # (a write refused, too long or past the cap: the memories are read as ever)
                    yield Notice(str(e))
                if self.cfg.memory.remember == "off" and FORGET.match(plain(text)):  # (plain: linear in a long one)
                    yield Notice("messages do not change your memories here (memory.remember: off): nothing was "
                                 "forgotten; delete a memory under About you")
                bank = None if reply is not None else (yield from self.recall_bank(s, text))
                if images and not conv.lm.is_vision:
                    message = text_only_message(conv.lm, len(images))
                    if not text:
                        raise ServiceError(f"{message}; there is no text to answer instead",
                                           api=f"messages: expected text with the image(s) ({conv.lm.name} reads "
                                               f"text only), got {len(images)} image(s) and no text")
                    yield Notice(f"{message}; answering the text alone")
                    images = []
                if recall_first and not (reply is None and bank is not None and len(bank) and recall.enabled):
                    if reply is None:
                        yield Notice("recall first needs a memory bank and recall enabled; answering without")
                    recall_first = False
                if not interrupt.is_set() and (dropped := self.window.fit(conv, text, images, settings, recall_first)):
                    yield Notice(f"the conversation outgrew its limit: its {dropped} oldest turn(s) are no longer "
                                 "read (still shown)")
                yield from self._noted(s, conv.say(text, images, reply, settings, interrupt) if reply is not None else
                                       conv.stream(text, images, settings, recall, bank, interrupt, recall_first),
                                       lambda: no_memory(bank, recall, self.people.unread(self._model(), s.user, text)))

        req = Request("chat", run, s.id, text[:80])
        req.on_withdraw = lambda: self._record_unanswered(s, req)
        return self._start(s, req)

    def recall_bank(self, s: Session, text: str) -> Iterator[Notice]:
        """What the memory head searches for a message of this session (the generator's return value):
        `People.reading` of the session's bank."""
        return (yield from self.people.reading(self._model(), s.user, self.banks.of(s), self.banks.label(s), text))

    def personal(self, s: Session) -> Personal:
        """The session's user's own memory."""
        return self.people.of(self.wait_model(), s.user)

    def forget_everything(self, s: Session) -> int:
        """Delete every memory of the session's user and their history, whichever model wrote them."""
        return self.people.forget_all(self.wait_model(), s.user)

    def remember(self, s: Session, decision: Decision, source: str = "chat",
                 recent: Collection[str] = ()) -> Remembered:
        """Carry out a write decision on the session's user's memory (on the worker thread: it encodes); `recent`:
        the memory texts of the last turn, which a correction corrects (`Service.recent`)."""
        return self.people.carry_out(self._model(), s.user, decision, recent, source=source,
                                     conversation=f"session-{s.id}")

    @staticmethod
    def recent(s: Session, conv: Conversation) -> frozenset[str]:
        """The memory texts of the session's last turn: what its message wrote, what its answer recalled."""
        wrote = {e["text"] for e in s.last_change.written} if s.last_change is not None else set()
        last = conv.messages[-1] if conv.messages and conv.messages[-1].role == "assistant" else None
        return frozenset(wrote | ({r.text for r in last.recalls} if last is not None else set()))

    def undo_change(self, s: Session) -> Remembered:
        """Undo the last message's change to the session's user's memory (on the worker thread: it encodes)."""
        if s.last_change is None:
            raise ServiceError("there is no change to your memories to undo")
        lm = self._model()
        undone = self.people.undo(lm, s.user, s.last_change)
        s.last_change = None
        return undone

    @staticmethod
    def _record_unanswered(s: Session, req: Request) -> None:
        """A chat stopped while it waited: keep the user's message, with an empty stopped answer.
        Its generator (which takes the session's lock) sees the set interrupt before touching the model,
        so this runs off the worker."""
        for _ in req.run(req.interrupt):
            pass

    def answer_again(self, s: Session, settings: GenerationSettings, recall: RecallSettings) -> Request:
        """Queue a new answer to the last user message, replacing the last answer."""
        conv = s.conv
        if conv is None or not conv.messages or conv.messages[-1].role != "assistant":
            raise ServiceError("there is no answer to regenerate yet")

        def run(interrupt: threading.Event) -> Iterator[Any]:
            with s.lock:
                _check_tokens(conv, settings)
                question = next((m.text for m in reversed(conv.messages) if m.role == "user"), "")
                if not settings.do_sample and not conv.messages[-1].said:  # (the button looked broken)
                    yield Notice("decoding is greedy (sampling is off under Decoding): the same conversation and "
                                 "settings give the same answer; turn sampling on for another")
                bank = yield from self.recall_bank(s, question)
                yield from self._noted(s, conv.regenerate(settings, recall, bank, interrupt),
                                       lambda: no_memory(bank, recall,
                                                         self.people.unread(self._model(), s.user, question)))

        return self._start(s, Request("regenerate", run, s.id, "regenerate"))

    @staticmethod
    def _noted(s: Session, events: Iterator[Any], missed: Callable[[], str] = str) -> Iterator[Any]:
        """Forward a turn's events; note its speed, and the picture of how it was decoded (entropy over
        layers, or the mixture's α* per token); `missed()` when the model looked for a memory and read none (asked
        then only: it may open the user's memory)."""
        s.last_plot, s.last_note = None, ""  # a failed turn shows nothing of the one before
        for event in events:
            if isinstance(event, DoneEvent):
                result = event.result
                secs = result.decode_seconds  # (none for the app's own answer: no speed of the model's to show)
                s.last_speed = len(result.new_tokens[0]) / secs if secs > 0 else None
                if result.missed_recall and result.missed_recall[0]:
                    yield Notice(missed())
                tokens = lambda: [s.conv.lm.tokenizer.decode([t]) for t in result.new_tokens[0].tolist()]  # noqa: E731
                trace = result.entropy
                if trace is not None and trace.normalised_entropies.shape[1]:
                    decode = s.conv.lm.tokenizer.decode
                    layers = None if trace.per_layer_token_ids is None else [  # (entropy_record_tokens)
                        [decode([t]) for t in step] for step in trace.per_layer_token_ids[0].tolist()]
                    s.last_plot = ("entropy", trace.normalised_entropies[0].cpu().numpy(),
                                   trace.selected_layer_indices[0].tolist(), tokens(), trace.mode, layers)
                elif isinstance(result, MixtureResult) and result.alphas:
                    s.last_plot = ("mixture", list(result.alphas), tokens())
                    s.last_note = (f"q*: acceptance {result.acceptance_rate:.0%}, {result.tokens_per_round:.2f} "
                                   "tokens per verify" if result.drafted else "q*: direct")
            yield event

    def _start(self, s: Session, req: Request) -> Request:
        s.active = [r for r in s.active if not r.done.is_set()] + [self.worker.submit(req)]
        return req

    # ----------------------------------------------------------------- what the page shows

    def state(self, s: Session, details: bool = False) -> SessionState:
        """The session as the page shows it; with `details`, its bank's size a memory and first memories."""
        self.touch(s)
        lm = self._lm
        if lm is None:
            name = Path(self.cfg.model.path).name if self.cfg.model.path else EMBEDDED_NAME
            notes = ("loading…",)
        else:
            name = lm.name
            try:
                mine = len(self.people.of(lm, s.user))
            except (ServiceError, BankError):  # (a store gone: the page goes on rendering)
                mine = 0
            notes = tuple(filter(None, [str(lm.device), "" if lm.recall_trained else "recall untrained: recall first "
                                        "reads memories into your message", self.warm.state(self._lm),
                                        f"your memories: {mine}" if mine else ""]))
        bank = bank_state(self.banks.of(s), s.bank_use, self.banks.label(s), details)
        change = s.last_change.describe() if s.last_change is not None else ""
        return SessionState(message_states(s.conv), bank, name, notes, s.last_speed, s.last_plot, s.last_note,
                            change=change)

    def backend(self) -> str:
        """The loaded model's backend (a service may be given its model: `lm`), else the configured one's."""
        return self._lm.spec.backend if self._lm is not None else super().backend()

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
                              "model": self._lm.name if self._lm else None,
                              "vision": self._lm.is_vision if self._lm else None}],
                "bank": {"store": self.cfg.memory.store, "size": size}}


def _check_tokens(conv: Conversation, settings: GenerationSettings) -> None:
    """The settings' token ids are the model's (`ServiceError`, a refusal, naming the setting, else)."""
    try:
        check_token_ids(settings, conv.lm.spec.vocab_size)
    except ValueError as e:
        raise ServiceError(str(e)) from None


def _span(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} minutes"

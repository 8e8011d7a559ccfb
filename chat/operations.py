"""The session operations, each written once: a plain function `op(service, session, **args)` of the service that
holds the model, registered by `@operation`.

`chat.service.Service` runs an operation in process (`service.run(op, session, ...)`); past one machine,
`serve.front.RemoteService` sends its name and arguments to the session's replica, which runs it from this same
registry (`serve.replica`). Files travel with the call: an argument named in `files` holds a path or a list of
paths, sent as `Upload`s (name and bytes) and written into the session's folder there; with `returns_file`, the
file the operation returns comes back the same way. A `queued` operation returns the model worker's `Request`
(the page follows it); any other returns its value.

Adding an operation is one function here (and, for the page, its button in `page/layout.py`).
"""

from __future__ import annotations

import inspect
import json
import time
import uuid
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from chat import transcript
from chat.banks import Banks
from chat.config import Config
from chat.inputs import not_memory_texts, read_upload_text
from chat.decision import Decision, plain, to_remember
from chat.changes import Imported, Remembered, public
from chat.people import People
from chat.session import Conversation, Session
from chat.worker import Notice, Request, ServiceError, Worker, describe
from decoding.settings import GenerationSettings, RecallSettings
from memory.files import atomic_write
from memory.personal import Personal
from models import LoadedModel

MEMORIES_FORMAT = "recall-chat-memories-1"
MAX_IMPORT = 500  # the most memories one import writes (its write holds the model worker; docs/limits.md)
Past = tuple[str, str, Sequence[bytes]]  # an earlier message its client keeps: role, text, its images' bytes


class ModelSide(Protocol):
    """What operations ask of the service that holds the model (`chat.service.Service`)."""

    cfg: Config
    banks: Banks
    worker: Worker
    people: People

    def wait_model(self) -> LoadedModel: ...
    def answer(self, s: Session, text: str, images: Sequence[str], settings: GenerationSettings,
               recall: RecallSettings, recall_first: bool, unread: int = 0) -> Request: ...
    def answer_again(self, s: Session, settings: GenerationSettings, recall: RecallSettings) -> Request: ...
    def add_history(self, s: Session, history: Sequence[tuple[str, str, Sequence[str]]], text: str,
                    settings: GenerationSettings) -> int: ...
    def stop(self, s: Session) -> list[Request]: ...
    def settle(self, s: Session) -> None: ...
    def remember(self, s: Session, decision: Decision, source: str = "chat") -> Remembered: ...
    def personal(self, s: Session) -> Personal: ...
    def forget_everything(self, s: Session) -> int: ...
    def undo_change(self, s: Session) -> Remembered: ...


@dataclass(frozen=True)
class Upload:
    """A file on its way to or from a replica."""

    name: str
    data: bytes


@dataclass(frozen=True)
class Operation:
    """A registered operation: its function and how its call travels."""

    name: str
    run: Callable[..., Any]
    files: tuple[str, ...] = ()
    returns_file: bool = False
    queued: bool = False

    def arguments(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The call's arguments by name, without the service and the session; a wrong call raises here."""
        bound = inspect.signature(self.run).bind(None, None, *args, **kwargs)
        return dict(list(bound.arguments.items())[2:])

    def pack(self, args: dict[str, Any], max_mb: int) -> dict[str, Any]:
        """`args` as they travel: each file read into an `Upload`, refused over `max_mb` MB."""
        def read(path: str | Path) -> Upload:
            path = Path(path)
            if path.stat().st_size > max_mb * 2 ** 20:
                raise ServiceError(f"{path.name}: expected at most {max_mb} MB")
            return Upload(path.name, path.read_bytes())

        return {k: ([read(p) for p in v] if isinstance(v, (list, tuple)) else read(v)) if k in self.files else v
                for k, v in args.items()}

    def unpack(self, args: dict[str, Any], folder: Path) -> dict[str, Any]:
        """`args` as they arrived, each `Upload` written into `folder` under its own name, as its path."""
        return {k: ([_write(u, folder) for u in v] if isinstance(v, list) else _write(v, folder))
                if k in self.files else v for k, v in args.items()}

    def pack_result(self, value: Any) -> Any:
        return Upload(Path(value).name, Path(value).read_bytes()) if self.returns_file else value

    def unpack_result(self, value: Any, folder: Path) -> Any:
        return Path(_write(value, folder)) if self.returns_file and isinstance(value, Upload) else value


def _write(upload: Upload, folder: Path) -> str:
    """Write a file that came with a call into a folder of its own (it keeps its name); its path."""
    where = Path(folder) / f"upload-{uuid.uuid4().hex[:12]}"
    where.mkdir(parents=True)
    path = where / Path(upload.name).name
    path.write_bytes(upload.data)
    return str(path)


OPERATIONS: dict[str, Operation] = {}


def operation(*, files: Sequence[str] = (), returns_file: bool = False, queued: bool = False):
    """Register a session operation under its function's name (the name that travels to a replica)."""
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if fn.__name__ in OPERATIONS:
            raise ValueError(f"operation {fn.__name__!r} is registered twice")
        OPERATIONS[fn.__name__] = Operation(fn.__name__, fn, tuple(files), returns_file, queued)
        return fn

    return register


def operation_of(fn: Callable[..., Any]) -> Operation:
    """The registered operation of a function; `ValueError` for any other function."""
    op = OPERATIONS.get(getattr(fn, "__name__", ""))
    if op is None or op.run is not fn:
        raise ValueError(f"expected a session operation of chat.operations, got {fn!r}")
    return op


# --------------------------------------------------------------------------- answers


@operation(queued=True, files=("images",))
def answer(svc: ModelSide, s: Session, text: str, images: Sequence[str], settings: GenerationSettings,
           recall: RecallSettings, recall_first: bool = False, history: Sequence[Past] = ()) -> Request:
    """Queue an answer to a new user message (checked: `ChatService.chat`), after the earlier messages of a
    conversation its client keeps (the OpenAI API's)."""
    unread = svc.add_history(s, [(role, past, [_write(Upload(f"api-{uuid.uuid4().hex}.png", data), s.files)
                                               for data in images_data]) for role, past, images_data in history],
                             text, settings) if history else 0
    return svc.answer(s, text, images, settings, recall, recall_first, unread)


@operation(queued=True)
def answer_again(svc: ModelSide, s: Session, settings: GenerationSettings, recall: RecallSettings) -> Request:
    """Queue a new answer to the last user message, in place of the last answer."""
    return svc.answer_again(s, settings, recall)


@operation()
def refresh(svc: ModelSide, s: Session) -> None:
    """Nothing: every call brings the session's state back (the page asks for it when it opens)."""


# --------------------------------------------------------------------------- conversations


@operation()
def clear(svc: ModelSide, s: Session) -> None:
    """Stop the session's answers and forget its conversation."""
    svc.stop(s)
    with s.lock:
        if s.conv is not None:
            s.conv.clear()
        s.last_plot, s.last_note = None, ""


@operation(returns_file=True)
def save_conversation(svc: ModelSide, s: Session) -> Path:
    """The conversation as a file of the session's folder (exact ids, memory vectors, images inline); refused while
    an answer is being written (the turn holds the conversation: a save waited for its end, silently)."""
    if not s.lock.acquire(timeout=1):
        raise ServiceError("an answer is being written: save once it has ended, or Stop it first")
    try:
        if s.conv is None or not s.conv.messages:
            raise ServiceError("there is no conversation to save yet")
        text = transcript.save(s.conv)
    finally:
        s.lock.release()
    path = s.files / f"conversation-{s.id}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    atomic_write(path, lambda fh: fh.write(text.encode()))
    return path


@operation(files=("path",))
def load_conversation(svc: ModelSide, s: Session, path: str | Path) -> None:
    """Continue a saved conversation: it replaces the session's, once every check has passed."""
    lm = svc.wait_model()
    svc.settle(s)
    name = Path(path).name
    try:
        text = read_upload_text(path, svc.cfg.memory.max_upload_mb)
    except ValueError as e:
        raise ServiceError(str(e)) from None
    with s.lock:
        conv = s.conv or Conversation(lm)
        try:
            transcript.load(conv, text, s.files)
        except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
            raise ServiceError(f"{name} is not a conversation this model can continue: {describe(e)}") from None
        s.conv, s.last_plot, s.last_note = conv, None, ""


# --------------------------------------------------------------------------- banks


@operation(queued=True)
def build_example_bank(svc: ModelSide, s: Session) -> Request:
    """Queue building the example bank (once a server) and switching the session to it."""
    return svc.banks.build_example(s)


@operation(queued=True, files=("images",))
def write_memories(svc: ModelSide, s: Session, text: str, images: Sequence[str] = ()) -> Request:
    """Queue writing memories, one a line, and images, into the session's bank (a shared one is copied first)."""
    return svc.banks.write(s, text, images)


@operation(queued=True)
def delete_memories(svc: ModelSide, s: Session, ids: str) -> Request:
    """Queue deleting memories by id ("3, 5-7") from the session's bank (a shared one is copied first)."""
    return svc.banks.delete(s, ids)


@operation(files=("path",))
def upload_bank(svc: ModelSide, s: Session, path: str | Path) -> str:
    """Make a bank file the session's own bank; what the page says of it (its size, and a warning when the model
    may recall the wrong memories from it)."""
    return svc.banks.upload(s, path)


@operation()
def use_bank(svc: ModelSide, s: Session, which: str) -> None:
    """Read the shared, the example or the session's own bank."""
    svc.banks.use(s, which)


@operation()
def find_memories(svc: ModelSide, s: Session, query: str, top_k: int = 5) -> list[dict[str, Any]]:
    """The memories whose texts read closest to `query`, best first."""
    return svc.banks.find(s, query, int(top_k))


@operation(returns_file=True)
def download_bank(svc: ModelSide, s: Session, fmt: str = ".pt") -> Path:
    """The session's bank as a file of its folder (.pt, .safetensors or .npy)."""
    return svc.banks.save(s, fmt)


# --------------------------------------------------------------------------- the user's own memory


@operation()
def my_memories(svc: ModelSide, s: Session) -> list[dict[str, Any]]:
    """The session's user's memories, newest first ({"id", "text", "created_at", "source", "conversation"})."""
    return [public(e) for e in svc.personal(s).entries()]


@operation()
def my_memory_history(svc: ModelSide, s: Session) -> list[dict[str, Any]]:
    """The memories of the session's user that newer ones superseded, with when and by which."""
    return svc.personal(s).history


@operation(queued=True)
def remember(svc: ModelSide, s: Session, text: str, source: str = "api") -> Request:
    """Queue writing a memory of the session's user, as a "remember that ..." in the chat writes it
    (`chat.decision.to_remember`: a question, a request, a "forget ..." or a single word is refused by name, as the chat
    does not write them either)."""
    text = plain(text or "").strip()
    if not text:
        raise ServiceError("text: expected what to remember, got nothing")
    if len(text) > svc.cfg.app.max_message_chars:
        raise ServiceError(f"text: expected at most {svc.cfg.app.max_message_chars} characters, got {len(text)}")
    try:
        memory = to_remember(text)
    except ValueError as e:
        raise ServiceError(f"text: {e}") from None
    return svc.worker.submit(Request("remember", lambda _: svc.remember(s, Decision((memory,)), source), s.id))


@operation(queued=True)
def undo_memory_change(svc: ModelSide, s: Session) -> Request:
    """Queue undoing the last message's change to the user's memory (what it wrote goes, what it replaced or forgot
    comes back); `ServiceError` when there is none."""
    if s.last_change is None:
        raise ServiceError("there is no change to your memories to undo")
    return svc.worker.submit(Request("undo_memory_change", lambda _: svc.undo_change(s), s.id))


@operation()
def forget_memories(svc: ModelSide, s: Session, ids: Sequence[str]) -> list[dict[str, Any]]:
    """Delete memories of the session's user by id; `KeyError` naming an id that is not theirs (nothing deleted)."""
    if not ids:  # (the page's Delete with an empty box said "Forgot:" and nothing)
        raise ServiceError("expected the id(s) of the memories to forget (the list shows each one's), got none")
    return [public(e) for e in svc.personal(s).remove(list(ids))]


@operation()
def forget_all_memories(svc: ModelSide, s: Session) -> int:
    """Delete every memory of the session's user, and their history (every model's); how many there were."""
    return svc.forget_everything(s)


@operation(queued=True)
def edit_memory(svc: ModelSide, s: Session, memory_id: str, text: str) -> Request:
    """Queue replacing one of the user's memories by a new text (undoable; a failed write changes nothing: the old
    memory is put back as it was)."""
    mine = svc.personal(s)
    if mine.find(memory_id) is None:
        raise ServiceError(f"memory {memory_id!r}: no such memory of yours")
    text = plain(text or "").strip()
    if not text:
        raise ServiceError("text: expected the memory's new text, got nothing")
    if len(text) > svc.cfg.app.max_message_chars:
        raise ServiceError(f"text: expected at most {svc.cfg.app.max_message_chars} characters, got {len(text)}")
    try:
        memory = to_remember(text)  # (as the Remember box takes it: an edit into a question is refused)
    except ValueError as e:
        raise ServiceError(f"text: {e}") from None

    def run(_) -> Remembered:
        old = mine.remove([memory_id])  # first: the new text may read as a duplicate of the one it replaces
        s.last_change = Remembered(forgotten=tuple(old))
        try:
            done = svc.remember(s, Decision((memory,)), "edit")
        except BaseException:
            svc.undo_change(s)  # a failed write changes nothing: the old memory comes back as it was
            raise
        s.last_change = Remembered(forgotten=tuple(old)) + done
        return s.last_change

    return svc.worker.submit(Request("edit_memory", run, s.id))


@operation(returns_file=True)
def export_memories(svc: ModelSide, s: Session) -> Path:
    """The user's memories and their history as a JSON file of the session's folder."""
    mine = svc.personal(s)
    data = {"format": MEMORIES_FORMAT, "memories": [public(e) for e in mine.entries()], "history": mine.history}
    path = s.files / f"memories-{s.user}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    atomic_write(path, lambda fh: fh.write(json.dumps(data, indent=1).encode()))
    return path


@operation(queued=True, files=("path",))
def import_memories(svc: ModelSide, s: Session, path: str | Path) -> Request:
    """Queue writing every memory of an exported file (or a JSON list of texts) into the user's memory; each is
    judged as "remember that ..." judges it (duplicates skipped, a newer value supersedes), all written at once or
    none. At most `MAX_IMPORT` memories, each within `app.max_message_chars` and `memory.max_slots`, encoded a batch
    a worker round (every other answer goes on meanwhile); the result is `chat.changes.Imported`."""
    name = Path(path).name
    try:
        data = json.loads(read_upload_text(path, svc.cfg.memory.max_upload_mb))
    except ValueError as e:
        raise ServiceError(f"{name}: expected a JSON file of memories ({describe(e)})") from None
    except RecursionError:
        raise ServiceError(f"{name}: expected a JSON list of memories, got nesting too deep; nothing was written") \
            from None
    items = data.get("memories") if isinstance(data, dict) else data
    texts = [m.get("text") if isinstance(m, dict) else m for m in items] if isinstance(items, list) else None
    if (got := not_memory_texts(data, items, texts)) is not None:
        raise ServiceError(f"{name}: expected {{\"memories\": [{{\"text\": ...}}, ...]}} (an export) or a list of "
                           f"texts, got {got}; nothing was written")
    if len(texts) > MAX_IMPORT:
        raise ServiceError(f"{name}: expected at most {MAX_IMPORT} memories in one import, got {len(texts)}: split "
                           "the file; nothing was written")
    cap = svc.cfg.app.max_message_chars
    if long := [i for i, t in enumerate(texts) if len(t.strip()) > cap]:
        raise ServiceError(f"{name}: memory {long[0] + 1} has {len(texts[long[0]].strip())} characters, over "
                           f"app.max_message_chars={cap}: split it into shorter memories; nothing was written")
    memories = []
    for i, t in enumerate(texts):  # each as "remember" takes it: a question or a "forget ..." refuses the file
        try:
            memories.append(to_remember(t))
        except ValueError as e:
            raise ServiceError(f"{name}: memory {i + 1}: {e}") from None
    texts = memories

    def run(_) -> Generator[Notice, None, Imported]:
        lm = svc.wait_model()
        svc.people.check_room(lm, s.user, len(texts))  # (before the encoding: it may take seconds)
        encoded = yield from svc.people.encoding(lm, texts)  # (a batch a round: every other answer goes on meanwhile)
        return svc.people.write_many(lm, s.user, texts, encoded, source="import", conversation=f"session-{s.id}")

    return svc.worker.submit(Request("import_memories", run, s.id))

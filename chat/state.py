"""A session as plain data: what the page shows of it, made where the session lives, rendered by `chat.view`.

`Service.state` makes a `SessionState` from a live session; a model replica makes it the same way and sends it in
the session's record, so the page renders the same data with the same functions wherever the model runs. Nothing
here is rendered: no markdown, no tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from chat.session import Conversation
from decoding.events import RecallEvent
from memory import BankError

Piece = Union[str, RecallEvent]  # a stored answer, piece by piece: text, and each memory where it was injected


@dataclass(frozen=True)
class MessageState:
    """A message of the conversation: the user's text and image paths, or an answer in pieces and how it ended."""

    role: str  # "user" | "assistant"
    text: str
    images: tuple[str, ...] = ()
    pieces: tuple[Piece, ...] = ()
    finish_reason: str | None = None

    @property
    def recalls(self) -> list[RecallEvent]:
        return [p for p in self.pieces if isinstance(p, RecallEvent)]


@dataclass(frozen=True)
class BankState:
    """The bank a session reads: which one, its size (None: no bank) or why it could not be read, what its
    memories are, and, when asked for, their size and the first of them."""

    use: str  # shared | example | own
    label: str
    size: int | None = None
    error: str = ""  # the store could not be read (a shared store that went away)
    index: str = "flat"
    dim: int = 0  # of the keys
    keyed: bool = False  # values found by a text embedding (else one hidden-state vector a memory)
    token_values: bool = False
    value_dim: int | None = None
    values: str = "values"  # the value kind's name
    keys: str = "a text encoder"  # the key encoder's name
    bytes_per_memory: float | None = None  # None: not asked for
    entries: tuple[tuple[int, str, int, float], ...] = ()  # the first memories: id, text, slots, key norm


@dataclass(frozen=True, eq=False)
class SessionState:
    """One session as the page shows it. `bank` None: not read yet (a front door before the session's first call)."""

    messages: tuple[MessageState, ...] = ()
    bank: BankState | None = None
    model: str = ""  # its name
    model_notes: tuple[str, ...] = ()  # its device, "loading…", what it cannot do, a step still compiling
    speed: float | None = None  # of the last answer, tokens a second
    plot: tuple | None = None  # how the last answer was decoded: ("entropy" | "mixture", data...), see chat.view
    note: str = ""  # the same in words (the mixture's acceptance rate)
    where: str = ""  # where the model runs, past one machine ("2 replicas")
    change: str = ""  # the last message's change to the user's memory, in words (undoable), or ""


def message_states(conv: Conversation | None) -> tuple[MessageState, ...]:
    """The conversation's messages as data: the turns the model no longer reads (`Conversation.earlier`) first."""
    if conv is None:
        return ()
    live = [(m, () if m.role == "user" else conv.pieces(i)) for i, m in enumerate(conv.messages)]
    return tuple(MessageState(m.role, m.text, tuple(m.images), pieces, m.finish_reason)
                 for m, pieces in [*conv.earlier, *live])


def bank_state(db: Any, use: str, label: str, details: bool = False, count: int = 8) -> BankState:
    """What `db` (a `MemoryVectorDB`, a `MilvusBank` or None) is; with `details`, also its bytes a memory and its
    first `count` memories (a shared store is asked for them: only when they are shown)."""
    if db is None:
        return BankState(use, label)
    kind = dict(index=db.index, dim=db.dim, keyed=db.has_values, token_values=db.token_values,
                value_dim=db.value_dim, values=db.info.get("values", "values"),
                keys=db.info.get("keys", "a text encoder"))
    try:
        size = len(db)
        per = db.bytes_per_memory() if details else None
        rows = db.entries(0, count) if details else []
    except BankError as e:  # a shared store that went away
        return BankState(use, label, error=str(e), **kind)
    entries = tuple((e["index"], e["text"] or "", e["slots"], round(e["norm"], 2)) for e in rows)
    return BankState(use, label, size, bytes_per_memory=per, entries=entries, **kind)

"""One validation layer for everything that comes from outside: messages, settings, conversation files.

Declarative where it can be (pydantic models for the file formats), then the checks that need the
model (vocabulary, context, hidden size). Every refusal is a `ValueError` whose message names the
field, what was expected and what came; nothing is changed before everything has passed.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Literal

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

FORMAT = "recall-chat/conversation-2"
MAX_FILE_MESSAGES = 2_000
MAX_IMAGE_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class Limits:
    """What one request and one session may use (`app.*` and `memory.*` in the configuration)."""

    max_message_chars: int
    max_input_tokens: int
    max_new_tokens_cap: int
    max_memories_per_session: int


class ImageRefused(ValueError):
    """A message's image that cannot be read, or one too many (the page then takes the images out of the message)."""


def check_message(text: str, images: list[str], limits: Limits) -> None:
    if not isinstance(text, str):
        raise ValueError(f"message text: expected a string, got {type(text).__name__}")
    if len(text) > limits.max_message_chars:
        raise ValueError(f"message: expected at most {limits.max_message_chars} characters, got {len(text)}")
    if len(images) > 8:
        raise ImageRefused(f"message: expected at most 8 images, got {len(images)}")
    for path in images:  # (as the API checks its images: readable, of a sane size, whatever the model reads)
        try:
            check_image(Path(path).read_bytes(), Path(path).name)
        except OSError as e:
            raise ImageRefused(f"{Path(path).name}: expected an image file, got one that cannot be read "
                               f"({e.strerror})") from None
        except ValueError as e:
            raise ImageRefused(str(e)) from None


def check_new_tokens(max_new_tokens: int, limits: Limits) -> None:
    if max_new_tokens > limits.max_new_tokens_cap:
        raise ValueError(f"max_new_tokens: expected at most {limits.max_new_tokens_cap} "
                         f"(app.max_new_tokens_cap), got {max_new_tokens}")


def check_token_ids(settings, vocab: int) -> None:
    """Every token id the settings name (`GenerationSettings.token_ids`) is one of the model's `vocab` tokens."""
    for name, ids in settings.token_ids().items():
        if bad := [t for t in ids if t >= vocab]:
            raise ValueError(f"{name}: expected token ids below {vocab} (the model's vocabulary), got {bad[0]}")


def read_upload_text(path: str | Path, max_mb: int) -> str:
    """An uploaded text file (a conversation): refused over `max_mb` MB or unreadable, naming the file."""
    name = Path(path).name
    try:
        if Path(path).stat().st_size > max_mb * 2 ** 20:
            raise ValueError(f"{name}: expected at most {max_mb} MB")
        return Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"could not read {name}: {e}") from None


# --------------------------------------------------------------------------- conversation files

Text = Annotated[str, Field(max_length=100_000)]


class RecallRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    row: int = Field(0, ge=0, le=0)
    position: int = Field(ge=0)
    score: float = Field(ge=-1.001, le=1.001)
    memory_index: int = Field(ge=0, lt=2 ** 62)
    text: Text | None = None
    length: int = Field(1, ge=1, le=100_000)  # value slots (files written before key/value memories have none: 1)
    source: Text | None = None  # the bank it came from, when several were searched as one


class MessageRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["user", "assistant"]
    text: Text
    images: list[str] = Field(default_factory=list, max_length=8)  # base64 PNG/JPEG bytes
    recalls: list[RecallRecord] = Field(default_factory=list, max_length=10_000)
    finish_reason: Literal["stop", "length", "interrupted", "tool_call"] | None = None
    start: int = Field(ge=0)
    said: bool = False  # the app's own answer to a command, not the model's


class EarlierRecord(BaseModel):
    """A turn's message the model no longer read (the conversation outgrew its window): shown, not read."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["user", "assistant"]
    text: Text
    images: list[str] = Field(default_factory=list, max_length=8)  # base64 PNG/JPEG bytes
    finish_reason: Literal["stop", "length", "interrupted", "tool_call"] | None = None


class ConversationFile(BaseModel):
    """A saved conversation: exact token ids, injected memory vectors, images inline (never paths)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: Literal["recall-chat/conversation-2"]
    model: Text
    system_prompt: Text | None = None
    messages: list[MessageRecord] = Field(max_length=MAX_FILE_MESSAGES)
    ids: list[int]
    memory: dict[str, str] = Field(default_factory=dict)  # position -> base64 float32 little-endian vector
    earlier: list[EarlierRecord] = Field(default_factory=list, max_length=MAX_FILE_MESSAGES)  # before `messages`

    @field_validator("ids")
    @classmethod
    def _ids(cls, ids: list[int]) -> list[int]:
        if ids and min(ids) < 0:
            raise ValueError(f"token ids must be >= 0, got {min(ids)}")
        return ids


def describe(error: ValidationError, whole: str = "the file") -> str:
    """The first problem of a pydantic error as one line: field (`whole` for the whole input), what was expected,
    what came."""
    e = error.errors()[0]
    where = ".".join(str(p) for p in e["loc"]) or whole
    got = repr(e.get("input"))[:80]
    return f"{where}: {e['msg']} (got {got})"


def encode_vector(v: torch.Tensor) -> str:
    return base64.b64encode(v.detach().float().cpu().numpy().astype("<f4").tobytes()).decode()


def decode_vector(text: str, hidden: int, where: str) -> torch.Tensor:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: expected base64 of {hidden} float32 values, got invalid base64") from None
    if len(raw) != 4 * hidden:
        raise ValueError(f"{where}: expected {hidden} float32 values ({4 * hidden} bytes), got {len(raw)} bytes")
    vec = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not np.isfinite(vec).all():
        raise ValueError(f"{where}: expected finite values, got NaN or inf")
    return torch.from_numpy(vec.copy())


def encode_image(path: str) -> str:
    with open(path, "rb") as fh:
        return base64.b64encode(fh.read()).decode()


def decode_image(text: str, where: str) -> bytes:
    """Image bytes from base64, checked to be an image PIL can read, of a sane size."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: expected a base64 PNG or JPEG image, got invalid base64") from None
    return check_image(raw, where)


def check_image(raw: bytes, where: str) -> bytes:
    """`raw`, checked to be an image PIL can read, of a sane size; `ValueError` naming what came otherwise."""
    kind = "image"
    try:
        with Image.open(io.BytesIO(raw)) as im:
            if im.width * im.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"{where}: expected at most {MAX_IMAGE_PIXELS} pixels, got {im.width}x{im.height}")
            kind = f"{im.format} image"
            im.verify()
    except UnidentifiedImageError:  # (its message names PIL's buffer object, nothing of the data)
        raise ValueError(f"{where}: expected a PNG or JPEG image, got {len(raw)} bytes that are not a readable image "
                         f"(starting {raw[:8]!r})") from None
    except Image.DecompressionBombError as e:
        raise ValueError(f"{where}: expected at most {MAX_IMAGE_PIXELS} pixels, got more ({e})") from None
    except (OSError, SyntaxError) as e:  # (a truncated file; verify's broken PNG is a SyntaxError)
        raise ValueError(f"{where}: expected a PNG or JPEG image, got a damaged {kind} ({e})") from None
    return raw


def check_conversation(data: ConversationFile, *, vocab: int, context: int | None, memory_pad: int,
                       hidden: int, decode: Callable[[list[int]], str]) -> dict[int, torch.Tensor]:
    """The checks that need the model: ids in its vocabulary and context, messages in order and inside
    the ids, each user message's text in what its ids decode to (`decode`: the model's tokenizer), recalls and
    memory vectors exactly at `<|memory_pad|>` positions. Returns the vectors."""
    ids, n = data.ids, len(data.ids)
    if context is not None and n >= context:
        raise ValueError(f"ids: expected fewer than {context} tokens (the model's context), got {n}")
    if ids and max(ids) >= vocab:
        raise ValueError(f"ids: expected token ids below the vocabulary size {vocab}, got {max(ids)}")
    starts = [m.start for m in data.messages]
    if any(b <= a for a, b in zip(starts, starts[1:])) or (starts and starts[-1] >= max(n, 1)):
        raise ValueError(f"messages: expected start positions increasing and below {n}, got {starts[:10]}")
    roles = [m.role for m in data.messages]
    if roles != ["user", "assistant"] * (len(roles) // 2) + ["user"] * (len(roles) % 2):
        raise ValueError(f"messages: expected roles alternating user, assistant, ..., got {roles[:10]}")
    for i, m in enumerate(data.messages):  # (the model reads the ids, the page shows the text: the same message)
        held = decode(ids[m.start:starts[i + 1] if i + 1 < len(starts) else n])
        if m.role == "user" and " ".join(m.text.split()) not in " ".join(held.split()):
            raise ValueError(f"messages.{i}.text: expected the text its ids hold, got {_short(m.text)} where the ids "
                             f"hold {_short(held, tail=True)} (an edited file, or one saved with another tokenizer: "
                             f"the file says {data.model!r})")
    if data.system_prompt and data.messages:  # (read with the first message)
        held = decode(ids[:starts[1] if len(starts) > 1 else n])
        if " ".join(data.system_prompt.split()) not in " ".join(held.split()):
            raise ValueError(f"system_prompt: expected the system prompt its ids hold, got "
                             f"{_short(data.system_prompt)} (an edited file: a conversation's system prompt is read "
                             "once, in its first message)")
    pads = {i for i, t in enumerate(ids) if t == memory_pad}
    memory = {}
    for key, text in data.memory.items():
        if not key.isascii() or not key.isdigit() or int(key) not in pads:
            raise ValueError(f"memory[{key!r}]: expected a position holding <|memory_pad|>, got {key!r}")
        memory[int(key)] = decode_vector(text, hidden, f"memory[{key}]")
    if set(memory) != pads:
        missing = sorted(pads - set(memory))[:5]
        raise ValueError(f"memory: expected a vector for every <|memory_pad|> position, missing {missing}")
    for i, m in enumerate(data.messages):
        end = starts[i + 1] if i + 1 < len(starts) else n
        begin = starts[i - 1] if i else m.start  # a memory read at the end of the user's message belongs to the answer
        for r in m.recalls:
            slots = range(r.position, r.position + r.length)
            if not (m.role == "assistant" and begin <= r.position and slots[-1] < end and all(p in pads for p in slots)):
                raise ValueError(f"messages.{i}.recalls: expected {r.length} <|memory_pad|> position(s) from "
                                 f"{r.position} inside the turn ({begin}..{end - 1})")
        if not all(math.isfinite(r.score) for r in m.recalls):
            raise ValueError(f"messages.{i}.recalls: expected finite scores")
    return memory


def _short(text: str, width: int = 60, tail: bool = False) -> str:
    if len(text) <= width:
        return repr(text)
    return repr("..." + text[3 - width:]) if tail else repr(text[:width - 3] + "...")


_BLANK = {"Cc", "Cf", "Zs", "Zl", "Zp"}  # characters that show nothing: controls, zero-width, spaces, separators


def memory_lines(text: str) -> list[tuple[int, str]]:
    """A bank's memories typed or read one a line: (the line's number from 1, its text stripped). Lines end at a
    new line only (\\n, \\r\\n, \\r: a form feed or U+2028 inside a line stays in it); a line that shows nothing
    (blank, zero-width or control characters only) is no memory."""
    lines = re.split(r"\r\n|\r|\n", text)
    return [(n, line.strip()) for n, line in enumerate(lines, 1)
            if any(unicodedata.category(ch) not in _BLANK for ch in line)]


def no_questions(numbered: list[tuple[int, str]], source: str) -> None:
    """A bank's memories are the facts questions are answered from: a ValueError naming the lines that are
    questions (ending in "?"), which a search for the same question finds first and reads instead of the fact."""
    asked = [(n, t) for n, t in numbered if t.rstrip().endswith("?")]
    if asked:
        t = asked[0][1]
        lines = ", ".join(str(k) for k, _ in asked[:5]) + (" and more" if len(asked) > 5 else "")
        raise ValueError(f"{source} line{'s' if len(asked) > 1 else ''} {lines}: expected statements (a bank holds "
                         f"the facts a question is answered from), got {len(asked)} question(s), first "
                         f"{t[:60]!r}; nothing was written")


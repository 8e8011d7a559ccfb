"""A conversation as a file and back: the format (pydantic, declarative), the checks that need the model (its
vocabulary, context, hidden size, tokenizer), `save` and `load`. The file is self-contained: the exact token ids,
the memory vectors injected at `<|memory_pad|>` positions, images inline (never paths). Every refusal is a
`ValueError` naming the field, what was expected and what came; `load` changes nothing before all has passed."""

from __future__ import annotations

import base64
import binascii
import difflib
import json
import math
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Callable, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from chat.inputs import check_image, describe
from decoding.events import RecallEvent

if TYPE_CHECKING:
    from chat.session import Conversation

FORMAT = "recall-chat/conversation-3"  # (-2: the same without `earlier.pieces`, read as well)
MAX_FILE_MESSAGES = 2_000

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
    pieces: list[Text | RecallRecord] = Field(default_factory=list, max_length=10_000)  # an answer: text and recalls


class ConversationFile(BaseModel):
    """A saved conversation: exact token ids, injected memory vectors, images inline (never paths)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: Literal["recall-chat/conversation-2", "recall-chat/conversation-3"]
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


def check_conversation(data: ConversationFile, *, vocab: int, context: int | None, memory_pad: int,
                       hidden: int, decode: Callable[..., str]) -> dict[int, torch.Tensor]:
    """The checks that need the model: ids in its vocabulary and context, messages in order and inside the ids,
    ending with an answer, each user message's text in what its ids decode to and each answer's text what they
    decode to (`decode(ids, skip_special_tokens)`: the model's tokenizer's), recalls and memory vectors exactly at
    `<|memory_pad|>` positions, each of those in a recall. Returns the vectors. (`load` then holds the ids to what
    the messages make: `Conversation.rebuild`.)"""
    ids, n = data.ids, len(data.ids)
    if context is not None and n >= context:
        raise ValueError(f"ids: expected fewer than {context} tokens (the model's context), got {n}")
    if ids and max(ids) >= vocab:
        raise ValueError(f"ids: expected token ids below the vocabulary size {vocab}, got {max(ids)}")
    starts = [m.start for m in data.messages]
    if any(b <= a for a, b in zip(starts, starts[1:])) or (starts and starts[-1] >= max(n, 1)):
        raise ValueError(f"messages: expected start positions increasing and below {n}, got {starts[:10]}")
    roles = [m.role for m in data.messages]
    if roles != ["user", "assistant"] * (len(roles) // 2):  # (a saved turn is whole: its answer stored, or neither)
        raise ValueError(f"messages: expected roles alternating user, assistant, ..., ending with an answer, got "
                         f"{roles[:10] if len(roles) <= 10 else ['...', *roles[-10:]]}")
    for i, m in enumerate(data.messages):  # (the model reads the ids, the page shows the text: the same message)
        segment = ids[m.start:starts[i + 1] if i + 1 < len(starts) else n]
        held = decode(segment, skip_special_tokens=m.role == "assistant")
        if m.role == "user" and " ".join(m.text.split()) not in " ".join(held.split()) or (
                m.role == "assistant" and m.text.split() != held.split()):
            got, holds = _around_difference(m.text, held)
            raise ValueError(f"messages.{i}.text: expected the text its ids hold, got {got} where the ids hold "
                             f"{holds} (an edited file, or one saved with another tokenizer: the file says "
                             f"{data.model!r})")
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
    recalled = {p for m in data.messages for r in m.recalls for p in range(r.position, r.position + r.length)}
    if unseen := sorted(pads - recalled):  # (an injection the recall log would never show)
        raise ValueError(f"memory: expected every <|memory_pad|> position in a recall of an answer, got "
                         f"{len(unseen)} in none: {unseen[:5]}")
    for i, m in enumerate(data.messages):
        end = starts[i + 1] if i + 1 < len(starts) else n
        begin = starts[i - 1] if i else m.start  # a memory read at the end of the user's message belongs to the answer
        for r in m.recalls:
            slots = range(r.position, r.position + r.length)
            inside = begin <= r.position and slots[-1] < end and all(p in pads for p in slots)
            if not (m.role == "assistant" and inside):
                raise ValueError(f"messages.{i}.recalls: expected {r.length} <|memory_pad|> position(s) from "
                                 f"{r.position} inside the turn ({begin}..{end - 1})")
        if not all(math.isfinite(r.score) for r in m.recalls):
            raise ValueError(f"messages.{i}.recalls: expected finite scores")
    return memory


def _around_difference(text: str, held: str, width: int = 60) -> tuple[str, str]:
    """A message's text and the text its ids hold, each shown whole up to `width` characters, else around where they
    first differ past the role's header and the end of the turn that the ids hold around a user's text (a probe's
    file differed at its start, and the message was cut at its end, the ids' text at its start)."""
    if len(text) <= width:
        return repr(text), _short(held, width, tail=True)
    ops = difflib.SequenceMatcher(None, text, held, autojunk=False).get_opcodes()
    at = next(((i1, j1) for tag, i1, _, j1, _ in ops
               if tag != "equal" and not (tag == "insert" and i1 in (0, len(text)))), (0, 0))
    def window(t: str, k: int) -> str:
        k = max(0, k - width // 3)
        return repr(("..." if k else "") + t[k:k + width] + ("..." if k + width < len(t) else ""))
    return window(text, at[0]), window(held, at[1])


def _short(text: str, width: int = 60, tail: bool = False) -> str:
    if len(text) <= width:
        return repr(text)
    return repr("..." + text[3 - width:]) if tail else repr(text[:width - 3] + "...")


def save(conv: Conversation) -> str:
    """The conversation as a self-contained file: exact ids, memory vectors, images inline."""
    messages = [{**asdict(m), "images": [encode_image(p) for p in m.images]} for m in conv.messages]
    shown = lambda pieces: [p if isinstance(p, str) else asdict(p) for p in pieces]  # noqa: E731
    earlier = [{"role": m.role, "text": m.text, "images": [encode_image(p) for p in m.images],
                "finish_reason": m.finish_reason, **({"pieces": shown(pieces)} if m.role == "assistant" else {})}
               for m, pieces in conv.earlier]
    return json.dumps({"format": FORMAT, "model": conv.lm.name, "system_prompt": conv.system_prompt,
                       "messages": messages, "ids": conv.ids,
                       "memory": {str(p): encode_vector(v) for p, v in sorted(conv.memory.items())},
                       **({"earlier": earlier} if earlier else {})})


def load(conv: Conversation, text: str, image_dir: Path) -> None:
    """Replace `conv` by a saved conversation, after every check has passed (else nothing changes): the file's ids
    must be those its messages make (`Conversation.rebuild`), so the model reads nothing the page does not show.

    Images come from the file itself and are written into `image_dir`; no path in a file is opened.
    """
    from chat.session import Conversation, Message, TextOnlyModelError

    try:
        data = ConversationFile.model_validate_json(text)
    except ValidationError as e:
        raise ValueError(describe(e)) from None
    lm = conv.lm
    tok = lm.tokenizer
    memory = check_conversation(data, vocab=len(tok), context=lm.spec.context, memory_pad=lm.tokens.memory_pad,
                                hidden=lm.hidden_size, decode=tok.decode)
    images = [[decode_image(b, f"messages.{i}.images.{k}") for k, b in enumerate(m.images)]
              for i, m in enumerate(data.messages)]
    earlier_images = [[decode_image(b, f"earlier.{i}.images.{k}") for k, b in enumerate(m.images)]
                      for i, m in enumerate(data.earlier)]
    if (any(images) or any(earlier_images)) and not lm.is_vision:
        raise TextOnlyModelError(f"the conversation has images but {lm.name} reads text only")

    def written(raws: list[bytes]) -> list[str]:
        paths = [Path(image_dir) / f"image-{uuid.uuid4().hex}.png" for _ in raws]
        for path, raw in zip(paths, raws):
            path.write_bytes(raw)
        return [str(p) for p in paths]

    messages = [Message(m.role, m.text, written(raws), [RecallEvent(**r.model_dump()) for r in m.recalls],
                        m.finish_reason, m.start, m.said) for m, raws in zip(data.messages, images)]
    made = Conversation(lm, data.system_prompt)
    try:  # (the images are read from files: an image's tokens are the image processor's)
        made.rebuild(messages, list(data.ids), memory)
        if made.ids != data.ids:
            at = next((p for p, (a, b) in enumerate(zip(made.ids, data.ids)) if a != b),
                      min(len(made.ids), len(data.ids)))
            i = max((k for k, m in enumerate(messages) if m.start <= at), default=0)
            raise ValueError(f"ids: expected the tokens the messages make with the chat template, got other tokens "
                             f"from position {at} (in messages.{i}: {_short(tok.decode(data.ids[at:at + 12]))}): an "
                             f"edited file, or one saved with another tokenizer or template (the file says "
                             f"{data.model!r})")
    except Exception:
        for path in (p for m in messages for p in m.images):
            Path(path).unlink(missing_ok=True)
        raise
    earlier = [(Message(m.role, m.text, written(raws), [], m.finish_reason), _pieces(m))  # (shown, never read)
               for m, raws in zip(data.earlier, earlier_images)]
    conv.clear()
    conv.system_prompt = data.system_prompt
    conv.messages, conv.ids, conv.memory, conv.pixels = made.messages, made.ids, made.memory, made.pixels
    conv.earlier = earlier


def _pieces(m: EarlierRecord) -> tuple[str | RecallEvent, ...]:
    """An earlier answer as the page shows it: its text with each recall where it was (a file of format -2 has the
    text alone)."""
    if m.role != "assistant":
        return ()
    if m.pieces:
        return tuple(p if isinstance(p, str) else RecallEvent(**p.model_dump()) for p in m.pieces)
    return (m.text,) if m.text else ()

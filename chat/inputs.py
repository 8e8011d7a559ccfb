"""One validation layer for what comes from outside: messages, settings, uploads, images (a conversation file's
format and checks are `chat.transcript`'s). Every refusal is a `ValueError` whose message names the field, what was
expected and what came; nothing is changed before everything has passed."""

from __future__ import annotations

import io
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError
from pydantic import ValidationError

from memory.validate import shown

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


def not_memory_texts(data: Any, items: Any, texts: list | None) -> str | None:
    """What an import file holds instead of memories (one message for every shape said "got something else"), or
    None when it holds texts."""
    if texts is None:
        shape = type(items).__name__ if items is not None else "nothing"
        return f"memories as {shape}" if isinstance(data, dict) else f"a JSON {type(data).__name__}"
    if not texts:
        return "no memories"
    bad = next((i for i, t in enumerate(texts) if not (isinstance(t, str) and t.strip())), None)
    return None if bad is None else f"memory {bad + 1} as {shown(json.dumps(items[bad]), 40)}"


# --------------------------------------------------------------------------- schemas and images

def describe(error: ValidationError, whole: str = "the file") -> str:
    """The deepest problem of a pydantic error as one line: field (`whole` for the whole input), what was expected,
    what came. Of a value that may take several shapes ("a string, or a list of parts"), the shape that got
    furthest is the one told, by the field's own path: `messages.0.content.1.image_url.url`, not the branch
    names pydantic puts in it (`content.str`, `list[tagged-union[...]]` and a part's tag)."""
    e = deepest(error)
    where = ".".join(str(p) for p in _path(e["loc"])) or whole
    message = e["msg"].removeprefix("Value error, ")  # (a validator's own message says what came)
    return f"{where}: {message}" + ("" if "got " in message else f" (got {repr(e.get('input'))[:80]})")


def deepest(error: ValidationError) -> dict:
    """The first of a pydantic error's deepest problems (the one `describe` tells)."""
    return max(error.errors(), key=lambda e: len(e["loc"]))  # (`max` keeps the first of equals)


_SHAPES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _path(loc: tuple) -> list:
    """A pydantic error's location without its union branches' names: a branch of a union (`str`, `list[...]`) and,
    after an item of a tagged union, its tag."""
    out, skip = [], False
    for i, p in enumerate(loc):
        if skip:
            skip = False
            continue
        if isinstance(p, str) and (p in _SHAPES or "[" in p):
            continue
        out.append(p)
        if isinstance(p, int) and i > 0 and isinstance(loc[i - 1], str) and "tagged-union[" in loc[i - 1]:
            skip = True  # (the tag after an item's index: "image_url" in ...content.1.image_url.image_url.url)
    return out


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


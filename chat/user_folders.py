"""The folders of users' memory files (`memory.user_dir`, `memory.store: faiss`): made private and checked at start
(`prepare`), each one its user's (`owned`), filled from an earlier model's file the first time a model opens it
(`carry_over`), and emptied (`forget_files`). `chat.people.People` opens the memories in them."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from chat.config import ConfigError
from memory import BankError, MemoryVectorDB
from memory.files import atomic_write, read_bank
from memory.personal import PersonalMemory
from models import LoadedModel

log = logging.getLogger(__name__)
PRIVATE = 0o700  # the mode of memory.user_dir and of each user's folder in it
OWNER = "owner.json"  # in a user's folder: when the user it belongs to was added (`owned`)
CARRIED = ".carried.json"  # in a user's folder: {memory file: the earlier model's file it was filled from}


def prepare(folder: Path) -> None:
    """Users' memory files need a folder this process can write (one that was a file, or read-only, started the
    app, then failed every answer with a 500): checked at start, which it stops (`ConfigError`, naming the folder).
    It and each user's folder in it are made 0700: a person's memories are no other account's (folders an older
    server made were 0755)."""
    try:
        folder.mkdir(mode=PRIVATE, parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ConfigError(f"memory.user_dir {str(folder)!r}: expected a folder this server can write users' "
                          f"memories in, got {'a file' if folder.is_file() else e.strerror or e}") from None
    for one in (folder, *(p for p in folder.iterdir() if p.is_dir())):
        with suppress(OSError):
            os.chmod(one, PRIVATE)


def _owner(path: Path) -> float | None:
    """The time the owner of a user's folder was added, as its owner file says; `BankError` naming the file when it
    cannot be read."""
    try:
        created = json.loads(path.read_text()).get("created")
    except (ValueError, AttributeError, OSError) as e:
        raise BankError(f"{path}: expected a JSON object {{\"created\": <time>}}, got one that cannot be read "
                        f"({getattr(e, 'strerror', None) or e})") from None
    return created


def owned(folder: Path, user: str, created: float | None) -> None:
    """The folder of `user`'s memories (in `folder`) is theirs: one an earlier user of the name left (removed, and
    the name added again: perhaps another person, who read them) is moved aside (`NAME+removed-<time>-<n>`), kept
    for the operator, and this user starts with none. A folder with no owner yet (written before owners were kept)
    is this user's. `created`: when the users file added them (None: a server without one)."""
    mine = folder / user
    owner = mine / OWNER
    if created is None:
        return
    if mine.exists() and not mine.is_dir():
        raise BankError(f"{mine}: expected the folder of {user!r}'s memories, got a file")
    if owner.is_file() and _owner(owner) != created:
        stamp = time.strftime("%Y%m%d-%H%M%S")  # ("+": no user's name has one, so none reads these)
        aside = next(p for n in range(1000) if not (p := mine.with_name(f"{user}+removed-{stamp}-{n}")).exists())
        mine.rename(aside)
        log.warning("the memories of an earlier user %r (removed; the name was added again) moved to %s", user, aside)
    if not owner.is_file():
        mine.mkdir(mode=PRIVATE, parents=True, exist_ok=True)
        atomic_write(owner, lambda fh: fh.write(json.dumps({"created": created}).encode()))


def carry_over(memory: PersonalMemory, lm: LoadedModel, new_bank: Callable[[], MemoryVectorDB]) -> None:
    """A model with no file of a user yet (a new model, or a retrained adapter: another encoder) starts from the
    newest file an earlier model wrote there: its memories re-encoded from their texts by this model (`lm`, into
    `new_bank()`), with their ids, times and sources, and its history. Once a file (`CARRIED`), so memories deleted
    later stay deleted; the earlier file stays as it was, for its model."""
    folder, name = memory.path.parent, memory.path.name
    done = json.loads((folder / CARRIED).read_text()) if (folder / CARRIED).is_file() else {}
    earlier = [p for p in folder.glob("*.safetensors") if p.name != name]
    if memory.path.exists() or name in done or not earlier:
        return
    source = max(earlier, key=lambda p: p.stat().st_mtime_ns)
    try:
        data = read_bank(source)
    except BankError as e:  # (an unreadable earlier file: this model starts empty, the file stays as it is)
        log.warning("memories of %s not carried over: %s", folder.name, e)
        return
    kept = [(t, m) for t, m in zip(data.texts or [], data.metadata or [None] * len(data.vectors)) if t]
    if kept:
        texts = [t for t, _ in kept]
        keys, values = lm.encoder.encode(lm.model, lm.tokenizer, texts, batch_size=16, progress=False)
        bank = new_bank()
        bank.add(keys, texts, [m or {} for _, m in kept], None if values is None else list(values))
        bank.info = dict(bank.info, history=list(data.info.get("history", [])), carried_from=source.name)
        if memory.adopt(bank):
            log.info("%d memories of %s carried over from %s", len(kept), folder.name, source.name)
    atomic_write(folder / CARRIED, lambda fh: fh.write(json.dumps({**done, name: source.name}).encode()))


def damaged(path: Path) -> bool:
    """Whether the memory file at `path` is there and cannot be read as a bank."""
    try:
        read_bank(path)
    except FileNotFoundError:
        return False
    except BankError:
        return path.is_file()
    return False


def forget_files(mine: Path) -> None:
    """Delete every model's memory file in a user's folder `mine` (what a later model would carry over) and the
    record of what was carried over."""
    for other in mine.glob("*.safetensors"):
        other.unlink(missing_ok=True)
    (mine / CARRIED).unlink(missing_ok=True)

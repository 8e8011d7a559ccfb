"""One person's memories, kept: `Personal`, what every store of them offers (a bank file of their own here,
`PersonalMemory`; a Milvus collection of everyone's in `memory.personal_milvus`), with the rules both follow
(`judge`, `new_entry`, `retired`, `chosen`); and the union of banks the memory head searches (the person's and
the shared one).

A change (`add`, `remove`, `clear`) is made on a copy, written to the file (`memory.files.atomic_write`: a
temporary, fsync, rename) and only then published, so a crash or `kill -9` at any point leaves the file, and
the memories in use, as they were before or as they are after. Each memory has a stable id (`m-` and 12 hex
digits, in its metadata, kept across restarts) and the time it was written. A memory that supersedes another
(a newer value of the same thing: `judge`) moves the older one to the bank's history (`info["history"]`: its text, when
it was written and when it was superseded, by which id); the history is kept, never recalled. A deleted memory
takes the older values it superseded with it (`superseded_by`); deleting a person's last memory deletes the file,
history included.
"""

from __future__ import annotations

import dataclasses
import difflib
import fcntl
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from memory.bank import MemoryVectorDB
from memory.shape import BankShape, Memory
from memory.validate import BankError, shown


MAX_HISTORY = 10_000  # superseded values a person's file keeps, the newest (its texts live in the 100 MB header)
CLOSEST = 8  # how many of the memories nearest a new one's key it is judged against (`judge`)


def normalise_text(text: str) -> str:
    """A memory's text as compared for exact duplicates: lower case, words only."""
    return " ".join(re.findall(r"\w+", text.lower()))


# words whose presence or absence does not change what a memory says ("The user has got two cats." is "The user has
# two cats."), compared only between keys at `Similar.duplicate` or closer
FILLER = frozenset({"a", "an", "the", "got", "really", "very", "just", "also", "actually"})


@dataclasses.dataclass(frozen=True)
class Similar:
    """How close a new memory's key must be to an old one's (cosine) to be the same memory, or the same thing."""

    duplicate: float = 0.97  # as close as this and the same words (but for `FILLER`): not added twice
    supersede: float = 0.80  # the newer replaces the older (when not a duplicate)

    def __post_init__(self):
        if not -1 <= self.supersede < self.duplicate <= 1:
            raise ValueError(f"expected -1 <= supersede < duplicate <= 1, got supersede={self.supersede}, "
                             f"duplicate={self.duplicate}")


def _content(words: str) -> list[str]:
    return [w for w in words.split() if w not in FILLER]


def twin(closest: Sequence[dict], text: str, similar: Similar) -> dict | None:
    """The kept memory (of a bank's `search`: {"score", "index", "text", "metadata"}) that a memory of `text` would
    repeat, or None: one of the same words (case and punctuation aside), or one whose key is at `similar.duplicate`
    or closer and whose words differ only in `FILLER`. A near-identical key with other words is not a repeat: the
    key encoder puts "The user's bank PIN is 1111." and "... 2222." at 0.99, "... dog is called Rex." and "... Max."
    at 0.98, so a changed number or name is a newer value (`judge`), never dropped as a duplicate."""
    words = normalise_text(text)
    for f in closest:
        kept = normalise_text(f.get("text") or "")
        if kept == words or (f["score"] >= similar.duplicate and (
                _content(kept) == _content(words) if f.get("text") else True)):
            return f
    return None


def _value_kind(word: str) -> str:
    return "number" if any(c.isdigit() for c in word) else "name" if word[:1].isupper() else "word"


_OWNS = re.compile(r"\bha(?:s|ve|d) (?:a|an|another) ([\w-]+)")  # "has a horse", "have a meeting"
_CLAUSE = frozenset("who which that whose is was are were aged and but".split())  # after the thing: of it, not it


def _one_of_several(old: str, words: list[str], changed: int) -> bool:
    """Whether the first word a newer text changes (`changed`, of `old`'s `words`, fillers out) names or places a
    thing the user has "a" of ("The user has a horse called Toby." / "... Pickles.", "... a meeting on Monday at 9." /
    "... on Friday at 3.": one of several, both may be true), not a word of a clause about it ("The user has a son
    who is 5 years old." / "... 6 ...": the son's age, a newer value)."""
    owns = _OWNS.search(old)
    if owns is None or owns[1] not in words[:changed]:
        return False
    thing = len(words[:changed]) - 1 - words[:changed][::-1].index(owns[1])
    return not _CLAUSE & set(words[thing + 1:changed])


def newer_value(old: str | None, new: str) -> bool:
    """Whether `new` says what `old` says but for its value: the words that differ (fillers aside, `FILLER`) are, in
    each place they differ, numbers or names on both sides ("... PIN is 1111." / "... 2222.", "... is called Lena." /
    "... Lina.", "... at 12 Elm Street." / "... 48 Oak Road."), or one other word swapped for one as the last word
    ("... colour is blue." / "... green.", "... works as a baker." / "... a nurse."); never a thing of the user's
    ("The user's sister ..." / "... brother ...": another thing), nor a word put in or left out. So "The user's sister
    lives in Oslo." is not a newer value of "The user's sister is called Lena." (keys 0.89 apart: it superseded it),
    nor "The user works in Porto." of "The user lives in Porto." (0.94)."""
    if not old:
        return False
    a = [w for w in re.findall(r"\w+", old) if w.lower() not in FILLER]
    b = [w for w in re.findall(r"\w+", new) if w.lower() not in FILLER]
    la, lb = [w.lower() for w in a], [w.lower() for w in b]
    changed = [op for op in difflib.SequenceMatcher(None, la, lb, autojunk=False).get_opcodes() if op[0] != "equal"]
    if changed and _one_of_several(old.lower(), la, changed[0][1]):
        return False
    for tag, i1, i2, j1, j2 in changed:
        if tag != "replace" or (i1 > 0 and la[i1 - 1] == "s"):  # (a word put in or left out; "the user's X")
            return False
        was, now = {_value_kind(w) for w in a[i1:i2]}, {_value_kind(w) for w in b[j1:j2]}
        if "word" not in was and was == now:  # numbers, names, or both in the same way (an address)
            continue
        if not (len(changed) == 1 and i2 - i1 == j2 - j1 == 1 and i2 == len(la) and j2 == len(lb)
                and was == now == {"word"}):
            return False
    return True


def judge(closest: Sequence[dict], text: str, similar: Similar) -> list[dict] | None:
    """What a new memory of `text` is to the kept ones closest to its key (a bank's `search`: {"score", "index",
    "text", "metadata"}, at most `CLOSEST`): None when it is one of them again (`twin`), else those it supersedes:
    keys at `similar.supersede` or closer that say the same thing with another value (`newer_value`). The key alone
    superseded another fact about the same person or pet ("The user's sister lives in Oslo." the sister's name, keys
    0.89 apart); the newer value wins at read time anyway (`Newest`), so a memory is kept whenever in doubt (measured
    by bench/memory_commands.py: docs/benchmarks.md, "The write decision")."""
    if twin(closest, text, similar) is not None:
        return None
    return [f for f in closest if f["score"] >= similar.supersede and newer_value(f.get("text"), text)]


def as_entry(found: dict) -> dict:
    """A memory of `search` ({"text", "metadata", ...}) as its entry: {"text", "id", "created_at", ...}."""
    return {"text": found.get("text"), **(found.get("metadata") or {})}


def chosen(entries: Iterable[dict], memory_ids: Sequence[str]) -> list[dict]:
    """The entries of `memory_ids`, in that order; `KeyError` naming the first id that is not among them."""
    by_id = {e.get("id"): e for e in entries}
    if missing := [i for i in memory_ids if i not in by_id]:
        raise KeyError(f"memory {shown(str(missing[0]))!r}: no such memory of yours")
    return [by_id[i] for i in memory_ids]


def superseded_by(history: Iterable[dict], ids: Iterable[str]) -> set[str]:
    """The ids of the history's entries that memories `ids` superseded, and those these superseded, on back: the
    older values of what a person deletes, which go with it."""
    history, chain, frontier = list(history), set(), set(ids)
    while frontier:
        frontier = {h["id"] for h in history if h.get("superseded_by") in frontier and h.get("id")} - chain
        chain |= frontier
    return chain


def new_entry(**meta: Any) -> dict:
    """A new memory's metadata: a stable id (`m-` and 12 hex digits) and the time it is written, with `meta`."""
    return {"id": f"m-{secrets.token_hex(6)}", "created_at": time.time(), **meta}


def retired(superseded: Iterable[dict], by: dict) -> list[dict]:
    """Superseded memories ({"text", "id", "created_at", ...}) as the history keeps them: when, and by which."""
    now = time.time()
    return [dict(old, superseded_at=now, superseded_by=by["id"]) for old in superseded]


def as_restored(entry: dict) -> dict:
    """A memory's metadata as it was before it was superseded or forgotten (for `restore`)."""
    return {k: v for k, v in entry.items() if k not in ("index", "text", "superseded_at", "superseded_by")}


def _put_back(bank: MemoryVectorDB, history: list[dict], key: torch.Tensor, value: Any, entry: dict) -> list[dict]:
    """Add `entry` (a superseded or forgotten memory) to `bank` as it was; the history without it."""
    meta = as_restored(entry)
    bank.add(key, [entry["text"]], [meta], None if value is None else [value])
    return [h for h in history if h.get("id") != meta.get("id")]


def newest_first(entries: Iterable[dict]) -> list[dict]:
    """Entries ({"index", "created_at", ...}) newest first (the later written first among those of one time)."""
    return sorted(entries, key=lambda e: (-e.get("created_at", 0.0), -e["index"]))


@dataclasses.dataclass(frozen=True)
class Undone:
    """What an undo did (`Personal.undo`): the memories it `removed`, those it `restored`, and the kept memories that
    say what a memory to restore said (`twin`: the same fact came back meanwhile, so it was not put back twice)."""

    removed: tuple[dict, ...] = ()
    restored: tuple[dict, ...] = ()
    kept: tuple[dict, ...] = ()


class Personal(Protocol):
    """One person's memories, whichever store keeps them. `entries` are {"index" (the id of the memory in `bank`),
    "id", "text", "created_at", "source", "conversation"}, newest first; `bank` is what the memory head searches
    (None while there is nothing to search); `add` gives (the new entry, or None for a duplicate of one kept; the
    entries it superseded, now in `history`); `remove` raises `KeyError` naming an id that is not theirs; `undo` takes
    back a change (what it wrote goes, what it superseded or forgot comes back)."""

    @property
    def bank(self) -> BankShape | None: ...
    @property
    def history(self) -> list[dict]: ...
    def __len__(self) -> int: ...
    def entries(self) -> list[dict]: ...
    def add(self, key: torch.Tensor, value: Any, text: str, *, similar: Similar = Similar(),
            make_bank: Callable[[], MemoryVectorDB] | None = None, **meta: Any) -> tuple[dict | None, list[dict]]: ...
    def restore(self, key: torch.Tensor, value: Any, entry: dict, *,
                make_bank: Callable[[], MemoryVectorDB] | None = None) -> dict | None: ...
    def remove(self, memory_ids: Sequence[str]) -> list[dict]: ...
    def clear(self) -> int: ...

    def find(self, memory_id: str) -> dict | None:
        return next((e for e in self.entries() if e.get("id") == memory_id), None)

    def add_many(self, items: Sequence[tuple[torch.Tensor, Any, str, dict]], *, similar: Similar = Similar(),
                 make_bank: Callable[[], MemoryVectorDB] | None = None) -> list[tuple[dict | None, list[dict]]]:
        """`add` of each (key [1, D], value, text, meta) in turn, each judged against those before it; what `add`
        gives for each. Here one by one (a store without transactions); `PersonalMemory` writes them all at once."""
        return [self.add(key, value, text, similar=similar, make_bank=make_bank, **meta)
                for key, value, text, meta in items]

    def undo(self, remove: Sequence[str], restore: Sequence[tuple[torch.Tensor, Any, dict]], *,
             similar: Similar = Similar(), make_bank: Callable[[], MemoryVectorDB] | None = None) -> Undone:
        """Take back a change: delete the memories of ids `remove` (those still here) and put back each (key [1, D],
        value, entry) of `restore` as it was (`restore`), unless a memory of its id is here already or one that says
        the same (`twin`, not counting those removed) came back meanwhile. Here one change after another, the
        restores first (a store without transactions: a failure part way leaves a memory twice, never none);
        `PersonalMemory` makes it one write, all or nothing."""
        live = {e.get("id") for e in self.entries()}
        gone = [i for i in dict.fromkeys(remove) if i in live]
        restored, kept = [], []
        for key, value, entry in restore:
            if entry.get("id") in live:
                continue
            bank = self.bank
            found = [] if bank is None else [f for f in bank.search(key[0], CLOSEST)
                                             if (f.get("metadata") or {}).get("id") not in gone]
            if (same := twin(found, entry["text"], similar)) is not None:
                kept.append(as_entry(same))
                continue
            back = self.restore(key, value, entry, make_bank=make_bank)
            if back is not None:
                restored.append(back)
                live.add(back.get("id"))
        gone = [i for i in gone if self.find(i) is not None]  # (one deleted meanwhile stays deleted)
        return Undone(tuple(self.remove(gone)), tuple(restored), tuple(kept))


class PersonalMemory(Personal):
    """A person's memories in one bank file (checked on every read as any bank file: `MemoryVectorDB.load`'s
    `checks`). Thread- and process-safe: a change holds a lock on the file (replicas on one machine share it) and
    starts from the file as it is; `bank` is re-read when another process has changed the file."""

    def __init__(self, path: str | Path, **checks: Any):
        self.path = Path(path)
        self._checks = checks
        self._bank: MemoryVectorDB | None = None  # None until the first memory (its layout is the encoder's)
        self._stamp: tuple | None = None
        self._lock = threading.Lock()
        self._refresh()

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        except OSError as e:  # (its folder became a file, or unreadable: said, as a damaged file is)
            raise BankError(f"{self.path}: cannot be read ({e.strerror or e})") from None
        if stamp != self._stamp:
            self._bank = None if stamp is None else MemoryVectorDB.load(self.path, **self._checks)
            self._stamp = stamp

    @property
    def bank(self) -> MemoryVectorDB | None:
        self._refresh()
        return self._bank

    @contextmanager
    def _writing(self) -> Iterator[MemoryVectorDB | None]:
        """The bank as the file holds it now, under this process's and the file's lock."""
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # (a person's: no other account's)
            lock = open(self.path.with_name(f".{self.path.name}.lock"), "a")
        except OSError as e:  # (a folder that cannot be written: said, and nothing is written)
            raise BankError(f"{self.path.parent}: cannot be written ({e.strerror or e})") from None
        with self._lock, lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._refresh()
            yield self._bank

    def __len__(self) -> int:
        bank = self.bank
        return 0 if bank is None else len(bank)

    @property
    def history(self) -> list[dict]:
        return [] if self.bank is None else list(self.bank.info.get("history", []))

    def entries(self) -> list[dict]:
        """Every memory, newest first: {"id", "text", "created_at", "source", "conversation"}."""
        bank = self.bank
        if bank is None:
            return []
        return newest_first({"index": r["index"], "text": r["text"], **(r["metadata"] or {})}
                            for r in bank.entries(0, len(bank)))

    # ------------------------------------------------------------------ changes

    def _publish(self, bank: MemoryVectorDB) -> None:
        if not len(bank):  # no memory left: no file (its history goes with it: the person asked them all gone)
            with suppress(FileNotFoundError):
                os.unlink(self.path)
            self._bank, self._stamp = None, None
            return
        try:
            bank.save(self.path)  # atomic: the old file or the new one, never half of one
        except OSError as e:  # (a file made immutable, a full disk: said, and the bank is as it was)
            raise BankError(f"{self.path}: cannot be written ({e.strerror or e}); nothing was changed") from None
        st = os.stat(self.path)
        self._bank, self._stamp = bank, (st.st_mtime_ns, st.st_size, st.st_ino)

    def add(self, key: torch.Tensor, value: Any, text: str, *, similar: Similar = Similar(),
            make_bank: Callable[[], MemoryVectorDB] | None = None, **meta: Any) -> tuple[dict | None, list[dict]]:
        """Write one memory (key [1, D], its value as `MemoryVectorDB.add` takes it, or None for a bank whose values
        are its keys; `make_bank` makes the first bank); (the new entry, or None for a duplicate of one kept; the
        entries it superseded)."""
        return self.add_many([(key, value, text, meta)], similar=similar, make_bank=make_bank)[0]

    def add_many(self, items: Sequence[tuple[torch.Tensor, Any, str, dict]], *, similar: Similar = Similar(),
                 make_bank: Callable[[], MemoryVectorDB] | None = None) -> list[tuple[dict | None, list[dict]]]:
        """Write several memories (key [1, D], value, text, meta) as `add` writes each, judged in order (a later one
        may supersede an earlier one of the same call), on one copy written to the file once: all of them or, on any
        failure, none (one copy and one file write, where `add` in a loop copied and wrote the whole bank each time)."""
        with self._writing() as now:
            bank = self._copy(now, make_bank)
            done, history = [], list(bank.info.get("history", []))
            for key, value, text, meta in items:
                old = judge(bank.search(key[0], CLOSEST), text, similar)
                if old is None:
                    done.append((None, []))
                    continue
                entry = new_entry(**meta)
                bank.add(key, [text], [entry], None if value is None else [value])
                superseded = [as_entry(f) for f in old]
                if old:
                    history += retired(superseded, entry)
                    bank.remove([f["index"] for f in old])
                done.append((dict(entry, text=text), superseded))
            if any(entry is not None for entry, _ in done):
                bank.info = dict(bank.info, history=history[-MAX_HISTORY:])
                self._publish(bank)
            return done

    def restore(self, key: torch.Tensor, value: Any, entry: dict, *,
                make_bank: Callable[[], MemoryVectorDB] | None = None) -> dict | None:
        """Put a memory back as it was (its id, time and source): the undo of a forget or of a supersede. It leaves
        the history; None when a memory of that id is here already."""
        with self._writing() as now:
            if any(e.get("id") == entry.get("id") for e in self.entries()):
                return None
            bank = self._copy(now, make_bank)
            history = _put_back(bank, list(bank.info.get("history", [])), key, value, entry)
            bank.info = dict(bank.info, history=history)
            self._publish(bank)
            return dict(as_restored(entry), text=entry["text"])

    def undo(self, remove: Sequence[str], restore: Sequence[tuple[torch.Tensor, Any, dict]], *,
             similar: Similar = Similar(), make_bank: Callable[[], MemoryVectorDB] | None = None) -> Undone:
        """`Personal.undo` on one copy written to the file once: every part of it, or (any failure) nothing. (Ids are
        a memory's `id`, never its place: a bank's ids have holes once any memory was deleted.)"""
        with self._writing() as now:
            entries = self.entries()
            by_id = {e.get("id"): e for e in entries}
            gone = [by_id[i] for i in dict.fromkeys(remove) if i in by_id]
            if now is None and not restore:
                return Undone()
            bank = self._copy(now, make_bank)
            if gone:
                bank.remove([e["index"] for e in gone])
            live = set(by_id) - {e.get("id") for e in gone}
            history, restored, kept = list(bank.info.get("history", [])), [], []
            for key, value, entry in restore:
                if entry.get("id") in live:
                    continue
                if (same := twin(bank.search(key[0], CLOSEST), entry["text"], similar)) is not None:
                    kept.append(as_entry(same))
                    continue
                history = _put_back(bank, history, key, value, entry)
                live.add(entry.get("id"))
                restored.append(dict(as_restored(entry), text=entry["text"]))
            if gone or restored:
                bank.info = dict(bank.info, history=history)
                self._publish(bank)
            return Undone(tuple(gone), tuple(restored), tuple(kept))

    def _copy(self, now: MemoryVectorDB | None, make_bank: Callable[[], MemoryVectorDB] | None) -> MemoryVectorDB:
        if now is None and make_bank is None:
            raise ValueError(f"{self.path}: expected make_bank to make the first bank, got None")
        return now.copy() if now is not None else make_bank()

    def remove(self, memory_ids: Sequence[str]) -> list[dict]:
        """Delete memories by id, and the older values they superseded (`superseded_by`: not kept in the history, the
        person asked them gone); the deleted entries. An id that is not here raises `KeyError` naming it, and
        nothing is deleted."""
        with self._writing() as now:
            gone = chosen(self.entries(), memory_ids)
            if gone:
                bank = now.copy()
                bank.remove([e["index"] for e in gone])
                history = bank.info.get("history", [])
                older = superseded_by(history, [e["id"] for e in gone])
                bank.info = dict(bank.info, history=[h for h in history if h.get("id") not in older])
                self._publish(bank)
            return gone

    def adopt(self, bank: MemoryVectorDB) -> bool:
        """Write `bank` (memories carried over from another model's file, re-encoded) as this person's file when
        there is none yet; whether it was written (False when another process wrote one first)."""
        with self._writing() as now:
            if now is not None:
                return False
            self._publish(bank)
            return True

    def clear(self) -> int:
        """Delete every memory and the history; how many memories there were."""
        with self._writing() as now:
            if now is None:
                return 0
            self._publish(MemoryVectorDB(now.dim))
            return len(now)


class View:
    """A bank seen through another `topk`: everything else is the wrapped bank's."""

    bank: Any

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bank, name)

    def __len__(self) -> int:
        return len(self.bank)


class Newest(View):
    """A person's memories as the memory head reads them: of the memories as close to the message as the best one
    (within `margin` of its score) and about the same thing (keys at least `same` similar to the best one's), only
    the newest is read. A told change ("We've just moved to Brackholm.") thus outranks the older memory ("The user
    lives in Porto.") at read time even when it is worded unlike it, which the write-time supersede (keys >=
    `Similar.supersede`) misses. `bench/update_rule.py` (held-out people): the new value is read for 0.65 of the
    update's questions (0.38 by similarity alone), the other questions' memories 0.980 (0.982). Everything but
    `topk` is the wrapped bank's."""

    def __init__(self, bank: Any, margin: float = 0.10, same: float = 0.45):
        self.bank, self.margin, self.same = bank, margin, same

    def topk(self, query: Any, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        found = self.bank.search(query, len(self.bank) if k is None else k + CLOSEST)  # (near ties past the k-th)
        if len(found) > 1:
            best = torch.nn.functional.normalize(found[0]["embedding"], dim=-1)
            near = [f for f in found if f["score"] >= found[0]["score"] - self.margin and (
                f is found[0] or float(torch.nn.functional.normalize(f["embedding"], dim=-1) @ best) >= self.same)]
            newest = max(near, key=lambda f: (f.get("metadata") or {}).get("created_at", 0.0))
            found = [f for f in found if f is newest or all(f is not n for n in near)][:k]
        return (torch.tensor([f["score"] for f in found], dtype=torch.float32),
                torch.tensor([f["index"] for f in found], dtype=torch.int64))


class Joined(BankShape):
    """Several banks of one layout searched as one by the memory head (one key encoder: their scores compare):
    ids are `id * parts + part`; each memory knows the label of the bank it came from (`source`)."""

    def __init__(self, parts: Sequence[tuple[str, Any]]):
        self.parts = [(label, bank) for label, bank in parts if bank is not None and len(bank)]
        if not self.parts:
            raise ValueError("expected at least one bank with memories to join, got none")
        first = self.parts[0][1]
        shape = lambda b: (b.dim, b.value_dim, b.token_values)  # noqa: E731
        layout = lambda b: f"{b.dim}-d keys, " + ("token values" if b.token_values else  # noqa: E731
                                                  f"{b.value_dim}-d values" if b.has_values else "no values (key = value)")
        for label, bank in self.parts[1:]:
            if shape(bank) != shape(first):
                raise ValueError(f"{label}: expected a bank of the same layout as {self.parts[0][0]} "
                                 f"({layout(first)}), got {layout(bank)}")
        self._dim, self._kind = first.dim, "joined"
        self._value_dim, self._tokens = first._value_dim, first.token_values
        self.info = first.info

    def __len__(self) -> int:
        return sum(len(bank) for _, bank in self.parts)

    def topk(self, query: Any, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.parts)
        found = [(bank.topk(query, k), p) for p, (_, bank) in enumerate(self.parts)]
        scores = torch.cat([s for (s, _), _ in found]) if found else torch.empty(0)
        ids = torch.cat([i * n + p for (_, i), p in found]) if found else torch.empty(0, dtype=torch.int64)
        order = torch.from_numpy(np.argsort(-scores.numpy(), kind="stable"))[:k]
        return scores[order], ids[order]

    def memory(self, i: int, score: float) -> Memory:
        """Memory `i` of `topk`, with its id in its own bank and that bank's label."""
        label, bank = self.parts[i % len(self.parts)]
        return dataclasses.replace(bank.memory(i // len(self.parts), score), source=label)

    def vector(self, i: int) -> torch.Tensor:
        """The key of memory `i` of `topk`."""
        return self.parts[i % len(self.parts)][1].vector(i // len(self.parts))

    def text(self, i: int) -> str | None:
        """The text of memory `i` of `topk`."""
        return self.parts[i % len(self.parts)][1].text(i // len(self.parts))

    def source(self, i: int) -> tuple[str, int]:
        """(the label of memory `i`'s bank, its id there)."""
        return self.parts[i % len(self.parts)][0], i // len(self.parts)


class Only(View):
    """A bank whose memory head sees only some of its memories (the chat's fit check): `found`, the (scores, ids)
    chosen among the `depth` best of the query, searched again at each read. Should the bank have changed so that
    none of them is among those any more, the memories as chosen are read. Everything but `topk` is the wrapped
    bank's."""

    def __init__(self, bank: Any, found: tuple[torch.Tensor, torch.Tensor], depth: int):
        self.bank, self.found, self.depth = bank, found, depth

    def topk(self, query: Any, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        scores, ids = self.bank.topk(query, self.depth)
        keep = torch.isin(ids, self.found[1])
        scores, ids = (scores[keep], ids[keep]) if keep.any() else self.found
        return scores[:k], ids[:k]

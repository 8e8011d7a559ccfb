"""Every person's memories in one Milvus collection (`memory.store: milvus`), each person's their own.

The collection (`StoreLayout(people=True)`, opened by `open_people`) is laid out as any `MilvusBank`, with two more
fields: `user`, the partition key (Milvus keeps each user's rows in the partition their name hashes to), and
`live` (False: a superseded memory, kept in history with when and by which, never recalled). A person's
`MilvusPersonal` reads and writes through views of the bank (`MilvusBank.scoped`) whose filter,
`user == "<name>" and live == true`, goes to Milvus with every search, count and read: another user's memory is
never a candidate, so nothing is filtered after a search. Names are checked against `USER` (no character a filter
reads as syntax) before they reach a filter.

The rules of what is a duplicate, what supersedes what and how the history keeps it are those of every personal
store (`memory.personal`). A change holds the person's lock in this process; Milvus has no transactions, so a
memory that supersedes another is written first and the older one is moved to history after it (a crash between
the two leaves both recalled, never neither). Replicas are processes, each with its own lock: two writes of one
person's newer values at once both succeed, and both may stay recalled until the person's next change of that fact
(the newest is the one read: `memory.personal.Newest`).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memory.bank import MemoryVectorDB
from memory.milvus import MilvusBank, StoreError, StoreLayout
from memory.personal import (
    CLOSEST, Personal, Similar, as_entry, as_restored, chosen, judge, new_entry, newest_first, retired, superseded_by,
)

USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")  # a user's name as a filter may quote it


def user_filter(user: str, live: bool | None = True) -> str:
    """The Milvus filter of `user`'s memories: recalled ones (`live`), history (not `live`) or all (None)."""
    if not isinstance(user, str) or not USER.fullmatch(user):
        raise ValueError(f"user: expected a name of letters, digits and _ . @ - (at most 64), got {user!r}")
    where = f'user == "{user}"'
    return where if live is None else f"{where} and live == {str(live).lower()}"


def open_people(uri: str, name: str, layout: StoreLayout, **how: Any) -> MilvusBank:
    """The collection `name` of every person's memories at `uri`, made for `layout` when there is none (`how`: as
    `MilvusBank.open` takes it). Refused, naming it, when `name` is a collection of another kind."""
    store = MilvusBank.open(uri, name, create=dataclasses.replace(layout, people=True), **how)
    fields = {f["name"] for f in store._call("describe", store._client.describe_collection, name)["fields"]}
    if not {"user", "live"} <= fields:
        raise StoreError(f"memory store {name!r} at {uri}: expected a collection of people's memories (fields user "
                         "and live), got a bank without them")
    return store


def _entries(view: MilvusBank) -> list[dict]:
    return [{"index": r["index"], "text": r["text"], **(r["metadata"] or {})} for r in view.entries(0, len(view))]


class MilvusPersonal(Personal):
    """One person's memories in a collection of everyone's (`open_people`). Thread-safe; replicas share it."""

    def __init__(self, store: MilvusBank, user: str):
        self.user = user
        self._live = store.scoped(user_filter(user), user=user, live=True)  # what is recalled, and where writes go
        self._past = store.scoped(user_filter(user, live=False))
        self._all = store.scoped(user_filter(user, live=None))
        self._lock = threading.Lock()

    @property
    def bank(self) -> MilvusBank:
        """What the memory head searches: this person's recalled memories (`topk`, `memory`, `values`)."""
        return self._live

    def __len__(self) -> int:
        return len(self._live)

    @property
    def history(self) -> list[dict]:
        """The superseded memories, oldest change first: {"text", "id", "created_at", ..., "superseded_at",
        "superseded_by"}."""
        rows = [{k: v for k, v in e.items() if k != "index"} for e in _entries(self._past)]
        return sorted(rows, key=lambda e: e.get("superseded_at", 0.0))

    def entries(self) -> list[dict]:
        return newest_first(_entries(self._live))

    def add(self, key: torch.Tensor, value: Any, text: str, *, similar: Similar = Similar(),
            make_bank: Callable[[], MemoryVectorDB] | None = None, **meta: Any) -> tuple[dict | None, list[dict]]:
        """Write one memory (key [1, D], its value as `MilvusBank.add` takes it, or None when a value is its key;
        `make_bank` is not needed: the collection is laid out already)."""
        with self._lock:
            old = judge(self._live.search(key[0], CLOSEST), text, similar)
            if old is None:
                return None, []
            entry = new_entry(**meta)
            self._live.add(key, [text], [entry], None if value is None else [value])
            superseded = [as_entry(f) for f in old]
            past = [{k: v for k, v in h.items() if k != "text"} for h in retired(superseded, entry)]  # (its own field)
            done = self._live.update([{"id": f["index"], "live": False, "metadata": h} for f, h in zip(old, past)],
                                     missing_ok=True)  # (one another replica retired meanwhile is history already)
            ours = {r["id"] for r in done}
            return dict(entry, text=text), [e for f, e in zip(old, superseded) if f["index"] in ours]

    def restore(self, key: torch.Tensor, value: Any, entry: dict, *,
                make_bank: Callable[[], MemoryVectorDB] | None = None) -> dict | None:
        """Put a memory back as it was (its id, time and source): a superseded one is recalled again, a forgotten
        one written anew. None when a memory of that id is here already."""
        meta = as_restored(entry)
        with self._lock:
            if any(e.get("id") == meta.get("id") for e in self.entries()):
                return None
            past = next((e for e in _entries(self._past) if e.get("id") == meta.get("id")), None)
            if past is not None:
                self._all.update([{"id": past["index"], "live": True, "metadata": meta}])
            else:
                self._live.add(key, [entry["text"]], [meta], None if value is None else [value])
            return dict(meta, text=entry["text"])

    def remove(self, memory_ids: Sequence[str]) -> list[dict]:
        """Delete memories by id, and the older values they superseded (`superseded_by`: not kept in the history, the
        person asked them gone); the deleted entries. An id that is not theirs raises `KeyError` naming it, and
        nothing is deleted."""
        with self._lock:
            gone = chosen(self.entries(), memory_ids)
            if gone:
                past = _entries(self._past)
                older = superseded_by(past, [e["id"] for e in gone])
                self._live.remove([e["index"] for e in gone])
                if older:
                    self._past.remove([h["index"] for h in past if h.get("id") in older])
            return gone

    def clear(self) -> int:
        """Delete every memory of this person and their history; how many memories there were."""
        with self._lock:
            n, every = len(self._live), [e["index"] for e in _entries(self._all)]
            if every:
                self._all.remove(every)
            return n

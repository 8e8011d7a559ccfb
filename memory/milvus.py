"""`MilvusBank`: a memory bank kept in a Milvus collection, shared by every process that opens the same URI.

It offers what the loop and the chat banks ask of `MemoryVectorDB` (`topk`, `memory`, `values`, `vector`,
`text`, `metadata`, `entries`, `search`, `add`, `remove`, `__len__`, `dim`, `value_dim`, `has_values`,
`info`, `bytes_per_memory`, `save`), so decoding needs no change.

Layout, all through `pymilvus.MilvusClient` (a local path runs milvus-lite in this process; an
`http://host:19530` URI talks to a Milvus server):

- collection `<name>`: one row a memory. `id` (Milvus' auto id: the memory's id), `key` FLOAT_VECTOR [D]
  as added (searched by COSINE; `memory.index` picks FLAT, HNSW or IVF_FLAT), `text`, `metadata` (JSON),
  `slots` (how many value vectors), `grp` (where its values are).
- collection `<name>_values` (banks with value vectors): one row a value slot. `grp`, `slot`, `value`
  FLOAT_VECTOR [Dv]. Values are stored as float32 (milvus-lite has no float16 vector type) and read
  back at the bank's `value_dtype`, so a float16 bank returns exactly the numbers it was given.
  A bank of token values keeps a memory's token ids in its own row instead (`tokens`, an INT64 array of
  at most 4096), so it has no second collection.
- bank-level `info` (the encoder stamp, value kind, dtype) is a collection property.
- every user's own memories (`StoreLayout(people=True)`, `memory.personal_milvus`): two more fields, `user` (the
  partition key) and `live` (False: history, never recalled), read through views (`scoped`) that filter in Milvus.

A memory's values are written before its key, under a random group id, so any memory a search finds
is whole; `remove` deletes keys before values. Reads are strongly consistent (the collections'
default), so a memory written through one process is found by the next search in any other.
Every failure of the store raises `StoreError` naming the URI.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from memory.bank import MemoryVectorDB
from memory.shape import BankShape, Memory, pack_values
from memory.validate import VALUE_DTYPES, BankCheck, BankError, as_query, check_labels, prepare_vectors

INFO = "recall_chat.info"
MAX_TOPK = 16384  # Milvus' largest search limit: "all memories" of a bigger bank means its best 16384
MAX_TOKENS = 4096  # Milvus' largest array: the most token ids a memory of a bank of token values holds
_INDEX = {"flat": ("FLAT", {}, {}), "hnsw": ("HNSW", {"M": 32, "efConstruction": 200}, {"ef": None}),
          "ivf": ("IVF_FLAT", {"nlist": 128}, {"nprobe": 16})}
_PAGE = 1000  # rows a query reads at once
_LOCAL_GRPC = {"grpc.keepalive_time_ms": 2 ** 31 - 1, "grpc.keepalive_permit_without_calls": 0}  # (see `connect`)
_LOCAL_START_S = 60.0  # how long a Milvus Lite file's server may take to answer (pymilvus waits 10 s for any server)


class StoreError(BankError):
    """The memory store could not be reached or refused a request; the message names its URI."""


@dataclass(frozen=True)
class StoreLayout:
    """The bank `MilvusBank.open` creates when its collection does not exist: keys of dimension `dim`, and values
    of their own (`value_dim`, stored float32 and read back at `value_dtype`, or `token_values`) or none (a
    memory's value is its key); `info` is stamped on it (the encoder that writes it)."""

    dim: int
    value_dim: int | None = None
    value_dtype: str = "float32"
    token_values: bool = False
    info: dict = field(default_factory=dict)
    people: bool = False  # every user's memories: `user` (the partition key) and `live` fields


def _group() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 2  # below 2**62: a valid INT64


class MilvusBank(BankShape):
    """A bank of memories in Milvus. Thread-safe (the client is); several processes may share it."""

    def __init__(self, client: Any, uri: str, name: str, *, dim: int, value_dim: int | None, value_dtype: str,
                 index: str, info: dict, hnsw_ef_search: int = 64, token_values: bool = False):
        self._client, self.uri, self.name = client, uri, name
        self._dim, self._value_dim, self._kind, self._tokens = dim, value_dim, index, token_values
        self._value_dtype = VALUE_DTYPES[value_dtype]
        _, _, search = _INDEX[index]
        self._params = {"metric_type": "COSINE", "params": {k: v or hnsw_ef_search for k, v in search.items()}}
        self.info = info
        self._where, self._fields = "", {}  # a view's filter and the fields of the rows it writes (`scoped`)

    def scoped(self, where: str, **fields: Any) -> "MilvusBank":
        """A view of the memories `where` selects (a Milvus filter expression): every search, count and read of it
        passes `where` to Milvus, and every memory it adds carries `fields`. It shares this bank's client."""
        view = copy.copy(self)
        view._where, view._fields = where, dict(fields)
        return view

    def _filter(self, expr: str = "") -> str:
        """`expr` and this view's filter, as one Milvus filter expression (empty: every row)."""
        return " and ".join(f"({e})" for e in (expr, self._where) if e)

    # ----------------------------------------------------------------------- opening, size

    @classmethod
    def connect(cls, uri: str) -> Any:
        """A client for `uri`; `StoreError` naming it when nothing answers there."""
        try:
            from pymilvus import MilvusClient
        except ImportError:
            raise StoreError(f"memory.milvus_uri={uri!r} needs pymilvus and milvus-lite: "
                             'pip install -e ".[scale]"') from None
        caught = _Caught()  # (Milvus Lite logs a failed start with its traceback, and pymilvus says "Open local
        lite = logging.getLogger("milvus_lite.server_manager")  # milvus failed": the cause is said here, once)
        lite.addFilter(caught)
        # a local file's server runs in this process: on a busy machine it answers after pymilvus's 10 s, and it
        # answers pymilvus's keepalive pings of an idle client (every 10 s) with "GOAWAY too_many_pings", after
        # which a replica's next write failed once ("unreachable") though the server ran: no pings to it
        local = {"timeout": _LOCAL_START_S, "grpc_options": _LOCAL_GRPC} if uri.endswith(".db") else {}
        try:
            return MilvusClient(uri, **local)
        except Exception as e:  # noqa: BLE001 - pymilvus raises several kinds; all mean the same here
            why = caught.cause or _message(e)
            raise StoreError(f"the memory store at memory.milvus_uri={uri!r} is unreachable: {why}") from None
        finally:
            lite.removeFilter(caught)

    @classmethod
    def open(cls, uri: str, name: str = "memories", *, create: StoreLayout | None = None, index: str = "flat",
             hnsw_ef_search: int = 64, check: BankCheck = BankCheck(), client: Any = None) -> "MilvusBank":
        """The collection `name` at `uri`: opened when it exists (and checked as a bank file is: the encoder
        stamp, the dimension of keys and of what is injected; see `BankCheck`), created as `create` lays it
        out otherwise (None: refused, a collection is expected)."""
        client = client or cls.connect(uri)
        where = f"{name!r} at {uri}"
        try:
            if not client.has_collection(name):
                if create is None:
                    raise StoreError(f"memory store {where}: expected a collection, found none "
                                     "(load a bank file into it: python -m chat.bankcli load bank.pt URI)")
                cls._create(client, name, create, index)
            described = client.describe_collection(name)
            stored = json.loads(described.get("properties", {}).get(INFO, "{}"))
            key_dim = int(_field(described, "key")["params"]["dim"])
            token_values = any(f["name"] == "tokens" for f in described["fields"])
            value_dim = None
            if client.has_collection(f"{name}_values"):
                value_dim = int(_field(client.describe_collection(f"{name}_values"), "value")["params"]["dim"])
            client.load_collection(name)
            if value_dim is not None:
                client.load_collection(f"{name}_values")
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001
            raise StoreError(f"memory store {where}: {_message(e)}") from None
        written_by = stored.get("encoder")
        if check.refuses(written_by):
            raise BankError(f"memory store {where}: expected memories written by this model's encoder "
                            f"{check.encoder!r}, got a collection written by {written_by!r}")
        injected = value_dim if value_dim is not None else key_dim
        if check.dim is not None and not token_values and injected != check.dim:
            raise BankError(f"memory store {where}: expected vectors of dimension {check.dim} (the model's hidden "
                            f"size), got dimension {injected}")
        if check.key_dim is not None and (value_dim is not None or token_values) and key_dim != check.key_dim:
            raise BankError(f"memory store {where}: expected keys of dimension {check.key_dim}, got {key_dim}")
        dtype = stored.pop("value_dtype", "float32")
        return cls(client, uri, name, dim=key_dim, value_dim=value_dim, value_dtype=dtype, index=stored.pop(
            "index", index), info=stored, hnsw_ef_search=hnsw_ef_search, token_values=token_values)

    @staticmethod
    def _create(client: Any, name: str, layout: StoreLayout, index: str) -> None:
        from pymilvus import DataType

        dim, value_dim, token_values = layout.dim, layout.value_dim, layout.token_values
        info = dict(layout.info or {}, value_dtype=layout.value_dtype)
        kind, build, _ = _INDEX[index]
        schema = client.create_schema(auto_id=True)
        schema.add_field("id", DataType.INT64, is_primary=True)
        schema.add_field("key", DataType.FLOAT_VECTOR, dim=dim)
        schema.add_field("text", DataType.VARCHAR, max_length=65535, nullable=True)
        schema.add_field("metadata", DataType.JSON, nullable=True)
        schema.add_field("slots", DataType.INT32)
        schema.add_field("grp", DataType.INT64)
        if token_values:
            schema.add_field("tokens", DataType.ARRAY, element_type=DataType.INT64, max_capacity=MAX_TOKENS)
        if layout.people:
            schema.add_field("user", DataType.VARCHAR, max_length=64, is_partition_key=True)
            schema.add_field("live", DataType.BOOL)
        params = client.prepare_index_params()
        params.add_index("key", index_type=kind, metric_type="COSINE", params=build)
        if value_dim is not None:  # the values first: a key never exists without them
            values = client.create_schema(auto_id=True)
            values.add_field("id", DataType.INT64, is_primary=True)
            values.add_field("grp", DataType.INT64)
            values.add_field("slot", DataType.INT32)
            values.add_field("value", DataType.FLOAT_VECTOR, dim=value_dim)
            value_index = client.prepare_index_params()
            value_index.add_index("value", index_type="FLAT", metric_type="L2")
            client.create_collection(f"{name}_values", schema=values, index_params=value_index)
        client.create_collection(name, schema=schema, index_params=params)
        client.alter_collection_properties(name, properties={INFO: json.dumps(dict(info, index=index))})

    def _call(self, what: str, fn, *args, **kwargs) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the store's errors, whatever their class, are named the same
            raise StoreError(f"the memory store at memory.milvus_uri={self.uri!r} failed to {what}: "
                             f"{_message(e)}") from None

    def __len__(self) -> int:
        rows = self._call("count memories", self._client.query, self.name, filter=self._filter(),
                          output_fields=["count(*)"])
        return int(rows[0]["count(*)"])

    def bytes_per_memory(self) -> float:
        """Bytes a memory holds in the store: its key, and its values as stored (float32 vectors, or int64 token
        ids; their number averaged over up to 1000 memories)."""
        if not self.has_values:
            return 4 * self._dim
        rows = self._call("read memories", self._client.query, self.name, filter=self._filter("id >= 0"),
                          limit=_PAGE, output_fields=["slots"])
        per_slot = 8 if self._tokens else 4 * self._value_dim
        return 4 * self._dim + (per_slot * sum(r["slots"] for r in rows) / len(rows) if rows else 0)

    def __repr__(self) -> str:
        values = "token values" if self._tokens else f"value_dim={self._value_dim}"
        return f"MilvusBank({self.name!r} at {self.uri}, dim={self._dim}, {values})"

    # ----------------------------------------------------------------------- writing

    def add(self, vectors: Any, texts: Sequence[str | None] | None = None,
            metadata: Sequence[dict | None] | None = None, values: Sequence[Any] | None = None) -> list[int]:
        """Add keys [N, D] with optional texts, metadata and (in a bank with values) each memory's values
        ([k_i, Dv], or [k_i] token ids); return their ids. Checked as `MemoryVectorDB.add` checks them."""
        raw, _ = prepare_vectors(vectors, expected_dim=self._dim, source="add")
        texts, metadata = check_labels(texts, metadata, len(raw), "add")
        if values is None and self.has_values:
            raise BankError("add: expected values for every memory (this bank stores values beside its keys)")
        groups, slots, tokens = [_group() for _ in raw], [1] * len(raw), [None] * len(raw)
        if values is not None and self._tokens:
            flat, offsets = pack_values(self, values, len(raw))
            slots = np.diff(offsets).tolist()
            if max(slots) > MAX_TOKENS:
                raise BankError(f"add: expected at most {MAX_TOKENS} token ids a memory in a Milvus bank, got "
                                f"{max(slots)}")
            tokens = [flat[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
        elif values is not None:
            flat, offsets = pack_values(self, values, len(raw))
            flat = flat.astype(self._value_dtype).astype(np.float32)  # what a file bank of this dtype would hold
            slots = np.diff(offsets).tolist()
            rows = [{"grp": g, "slot": s, "value": flat[a + s]}
                    for g, a, k in zip(groups, offsets[:-1], slots) for s in range(k)]
            for start in range(0, len(rows), _PAGE):
                self._call("write values", self._client.insert, f"{self.name}_values", rows[start:start + _PAGE])
        rows = [{"key": raw[i], "text": (texts or [None] * len(raw))[i],
                 "metadata": (metadata or [None] * len(raw))[i], "slots": slots[i], "grp": groups[i],
                 **({"tokens": tokens[i]} if self._tokens else {}), **self._fields} for i in range(len(raw))]
        ids: list[int] = []
        for start in range(0, len(rows), _PAGE):
            ids += self._call("write memories", self._client.insert, self.name, rows[start:start + _PAGE])["ids"]
        return [int(i) for i in ids]

    def remove(self, ids: Iterable[int]) -> int:
        """Remove memories by id; return how many are left. Unknown ids raise `KeyError` and remove nothing."""
        wanted = sorted({int(i) for i in ids})
        if wanted:
            found = self._rows(wanted, ["grp"])
            missing = [i for i in wanted if i not in found]
            if missing:
                more = " ..." if len(missing) > 5 else ""
                raise KeyError(f"memory ids {missing[:5]}{more} are not in the bank")
            self._call("remove memories", self._client.delete, self.name, ids=wanted)
            if self.has_values and not self._tokens:
                groups = ", ".join(str(found[i]["grp"]) for i in wanted)
                self._call("remove values", self._client.delete, f"{self.name}_values", filter=f"grp in [{groups}]")
        return len(self)

    def update(self, rows: Sequence[dict], missing_ok: bool = False) -> list[dict]:
        """Set fields of memories of this view in place (each row: its "id" and the fields to set, not its key or
        values); the rows set. `KeyError` naming an id that is not here, and nothing is changed; with `missing_ok`,
        those are left out (another process took them out of this view meanwhile)."""
        here = set(self._rows([r["id"] for r in rows], ["id"])) if rows else set()
        if (missing := sorted({int(r["id"]) for r in rows} - here)) and not missing_ok:
            raise KeyError(f"memory ids {missing[:5]} are not in the bank")
        rows = [r for r in rows if int(r["id"]) in here]
        if rows:
            self._call("update memories", self._client.upsert, self.name, list(rows), partial_update=True)
        return rows

    # ----------------------------------------------------------------------- reading

    def _rows(self, ids: Sequence[int], fields: list[str]) -> dict[int, dict]:
        where = self._filter(f"id in [{', '.join(str(int(i)) for i in ids)}]")
        rows = self._call("read memories", self._client.query, self.name, filter=where, output_fields=fields)
        return {int(r["id"]): r for r in rows}

    def _row(self, i: int, fields: list[str]) -> dict:
        row = self._rows([int(i)], fields).get(int(i))
        if row is None:
            raise KeyError(f"memory id {int(i)} is not in the bank")
        return row

    def topk(self, query: Any, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The memory head's search: (cosine scores float32 [k], ids int64 [k]), best first (k=None: all, at
        most 16384)."""
        if k is not None and k < 0:
            raise ValueError(f"k must be >= 0 or None, got {k}")
        q = as_query(query, self._dim)
        limit = min(k if k is not None else MAX_TOPK, MAX_TOPK)
        hits = self._call("search", self._client.search, self.name, [q], limit=limit, anns_field="key",
                          filter=self._filter(), search_params=self._params)[0] if limit else []
        scores = torch.tensor([h["distance"] for h in hits], dtype=torch.float32)
        return scores, torch.tensor([int(h["id"]) for h in hits], dtype=torch.int64)

    def search(self, query_vector: Any, top_k: int, debug: bool = False) -> list[dict[str, Any]]:
        """Best `top_k` memories as dicts: {"embedding", "score", "index"} plus "text" / "metadata" when set."""
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        scores, ids = self.topk(query_vector, top_k)
        rows = self._rows(ids.tolist(), ["key", "text", "metadata"]) if len(ids) else {}
        out = []
        for score, i in zip(scores.tolist(), ids.tolist()):
            if (row := rows.get(i)) is None:  # (out of this view since the search: another process changed it)
                continue
            entry = {"embedding": torch.tensor(row["key"], dtype=torch.float32), "score": score, "index": i}
            entry.update({f: row[f] for f in ("text", "metadata") if row.get(f) is not None})
            out.append(entry)
        return out

    def vector(self, i: int) -> torch.Tensor:
        return torch.tensor(self._row(i, ["key"])["key"], dtype=torch.float32)

    def values(self, i: int) -> torch.Tensor:
        """The value vectors [k, Dv] float32 of id `i`, in slot order ([1, D] = its key when a value is its key), or
        its token ids int64 [k]."""
        if not self.has_values:
            return self.vector(i)[None]
        if self._tokens:
            return torch.tensor(self._row(i, ["tokens"])["tokens"], dtype=torch.int64)
        row = self._row(i, ["grp", "slots"])
        slots = self._call("read values", self._client.query, f"{self.name}_values", filter=f"grp == {row['grp']}",
                           output_fields=["slot", "value"], limit=int(row["slots"]))
        slots.sort(key=lambda r: r["slot"])
        return torch.tensor(np.asarray([r["value"] for r in slots], np.float32))

    def memory(self, i: int, score: float) -> Memory:
        return Memory(int(i), float(score), self.values(i), self.text(i))

    def text(self, i: int) -> str | None:
        return self._row(i, ["text"]).get("text")

    def metadata(self, i: int) -> dict | None:
        return self._row(i, ["metadata"]).get("metadata")

    def entries(self, start: int = 0, count: int = 5) -> list[dict[str, Any]]:
        """A sample for display, in id order: [{"index", "text", "metadata", "norm", "slots"}]."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got start={start}, count={count}")
        out: list[dict[str, Any]] = []
        while len(out) < count:
            size = min(_PAGE, count - len(out))
            rows = self._call("read memories", self._client.query, self.name, filter=self._filter("id >= 0"),
                              offset=start + len(out), limit=size, output_fields=["key", "text", "metadata", "slots"])
            out += [{"index": int(r["id"]), "text": r.get("text"), "metadata": r.get("metadata"),
                     "norm": float(np.linalg.norm(np.asarray(r["key"], np.float64))), "slots": int(r["slots"])}
                    for r in sorted(rows, key=lambda r: r["id"])]
            if len(rows) < size:
                break
        return out

    # ----------------------------------------------------------------------- files

    def to_bank(self) -> MemoryVectorDB:
        """Every memory as an in-memory `MemoryVectorDB` (ids renumbered 0..N-1 in id order), info included."""
        dtype = np.dtype(self._value_dtype).name
        db = MemoryVectorDB(self._dim, value_dim=self._value_dim, value_dtype=dtype, token_values=self._tokens)
        n = len(self)
        for start in range(0, n, _PAGE):
            rows = self._call("read memories", self._client.query, self.name, filter=self._filter("id >= 0"),
                              offset=start, limit=_PAGE, output_fields=["key", "text", "metadata"])
            rows.sort(key=lambda r: r["id"])
            values = [self.values(r["id"]).numpy() for r in rows] if self.has_values else None
            db.add(np.asarray([r["key"] for r in rows], np.float32), [r.get("text") for r in rows],
                   [r.get("metadata") for r in rows], values)
        db.info = dict(self.info)
        return db

    def save(self, path: str | os.PathLike) -> None:
        """Write every memory to a bank file (the format follows the extension)."""
        self.to_bank().save(path)

    def close(self) -> None:
        self._call("close", self._client.close)


def _field(described: dict, name: str) -> dict:
    return next(f for f in described["fields"] if f["name"] == name)


class _Caught(logging.Filter):
    """Keeps what a logged failure says (the message of its exception: "another process holds the lock on
    'memories.db'") and drops the record."""

    cause: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.exc_info and record.exc_info[1] is not None:
            self.cause = _message(record.exc_info[1])
            return False
        return True


def _message(e: Exception) -> str:
    """pymilvus' message without its class wrapper."""
    return str(getattr(e, "message", None) or e).strip() or type(e).__name__


def load_into(db: MemoryVectorDB, uri: str, name: str, *, index: str = "flat", client: Any = None) -> MilvusBank:
    """Copy a bank (read from a file) into a new collection `name` at `uri`; refuses an existing collection. All of
    it or none: the copy is made as `<name>_loading` and renamed `name` once whole (a load killed part way had left
    a collection of its first pages that looked whole, and refused the next load); what a killed load left is
    dropped by the next."""
    client = client or MilvusBank.connect(uri)
    if client.has_collection(name):
        raise StoreError(f"memory store {name!r} at {uri} already has a collection of that name: "
                         "choose another name, or drop it first")
    if client.has_collection(f"{name}_values"):  # (not dropped: it may be a bank of that name)
        raise StoreError(f"memory store {name!r} at {uri}: a collection {name}_values is there already (a load "
                         "killed while renaming, or a bank of that name): choose another name, or drop it first")
    loading = f"{name}_loading"
    for leftover in (loading, f"{loading}_values"):  # (what a killed load left)
        if client.has_collection(leftover):
            client.drop_collection(leftover)
    snap = db._snap
    values_dtype = "float32" if snap.values is None or db.token_values else np.dtype(snap.values.dtype).name
    layout = StoreLayout(db.dim, db.value_dim if db.has_values else None, values_dtype, db.token_values, db.info)
    store = MilvusBank.open(uri, loading, create=layout, index=index, client=client)
    for start in range(0, len(db), _PAGE):
        ids = snap.ids[start:start + _PAGE].tolist()
        store.add(snap.raw[start:start + _PAGE], snap.texts[start:start + len(ids)],
                  snap.metadata[start:start + len(ids)], [db.values(i) for i in ids] if db.has_values else None)
    if client.has_collection(f"{loading}_values"):
        client.rename_collection(f"{loading}_values", f"{name}_values")
    client.rename_collection(loading, name)
    return MilvusBank.open(uri, name, index=index, client=client)

"""`MemoryVectorDB`: memories searched by cosine similarity of their keys, with their value vectors and texts.

What a memory is (a key, and a value of k >= 1 vectors or token ids) and what every bank says about its
vectors are `memory/shape.py`'s; this module keeps them in process memory and reads and writes bank files.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from memory.ann import INDEXES, AnnConfig, AnnIndex
from memory.device import DeviceKeys
from memory.files import BankData, read_bank, write_bank
from memory.shape import BankShape, Memory, pack_values
from memory.validate import (TOKEN_DTYPE, VALUE_DTYPES, BankCheck, BankError, as_query, check_labels, normalise,
                             prepare_values, prepare_vectors)

log = logging.getLogger("memory.bank")


@dataclass(frozen=True)
class _Snapshot:
    """One published state. Arrays are views of buffers that later writers only append past `n`."""

    n: int
    ids: np.ndarray  # [n] int64, ascending stable ids
    raw: np.ndarray  # [n, D] float32, as added
    normed: np.ndarray  # [n, D] float32, unit rows
    texts: list  # [>= n] str | None; shared with later snapshots, read below n only
    metadata: list  # [>= n] dict | None; same
    ann: AnnIndex | None  # labels are row numbers of this generation
    values: np.ndarray | None = None  # [S, Dv] (or token ids [S]) all memories' value slots, flat (None: value = key)
    offsets: np.ndarray | None = None  # [n + 1] int64: row r's slots are values[offsets[r]:offsets[r + 1]]


def exact_topk(normed: np.ndarray, query: np.ndarray, k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(scores [k], rows [k]) best first: cosine of a unit query [D] against unit rows [N, D]."""
    # (torch, not numpy: numpy's OpenBLAS threads keep spinning after a call and slow the model's next
    # forward down to half speed, llama.cpp's threads most; bench/recall_quality.py's recall cost)
    scores = (torch.from_numpy(normed) @ torch.from_numpy(query)).numpy()  # [N]
    if k is None or k >= len(scores):
        order = np.argsort(-scores, kind="stable")
    else:
        part = np.argpartition(-scores, k - 1)[:k]
        order = part[np.argsort(-scores[part], kind="stable")]
    return scores[order], order


class MemoryVectorDB(BankShape):
    """A bank of memories searched by the cosine similarity of their keys, exactly or through FAISS HNSW/IVF.

    Keys are kept twice: raw float32 as added (returned as `embedding`) and L2-normalised (scored).
    Exact search is one BLAS matrix-vector product (faster here than `faiss.IndexFlatIP` for one
    query, and no third copy); `topk` and `search` go through the approximate index when one is
    configured and k is below the bank size. With `value_dim` every memory also has values: k >= 1
    vectors of that dimension (float32 or float16, `value_dtype`), stored flat with offsets; without,
    a memory's value is its key.

    Ids: `add` gives every vector a stable id (0, 1, 2, ... in order of adding), never reused;
    `remove` leaves the other ids unchanged. A bank that never had a removal has id == row.
    `save` writes rows in id order, so `load` renumbers them 0..N-1.

    Threads: one writer at a time (a lock) and any number of readers. Each write builds a new
    immutable snapshot and publishes it by one reference swap; readers work on the snapshot they
    picked up, so they never see a half-added state and exact reads never wait. Appends write
    past the end of the shared buffers (amortised O(K)); `remove` compacts into new buffers and
    rebuilds the approximate index (O(N)). The FAISS HNSW/IVF index is mutated in place by `add`
    and guarded by a readers-writer lock.
    """

    def __init__(self, dim: int, index: str = "flat", *, value_dim: int | None = None, value_dtype: str = "float32",
                 token_values: bool = False, hnsw_m: int = 32, hnsw_ef_search: int = 64, ivf_nlist: int | None = None,
                 ivf_nprobe: int | None = None) -> None:
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive integer, got {dim!r}")
        if index not in INDEXES:
            raise ValueError(f"index must be one of {INDEXES}, got {index!r}")
        if value_dim is not None and (not isinstance(value_dim, int) or value_dim < 1):
            raise ValueError(f"value_dim must be a positive integer or None, got {value_dim!r}")
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {sorted(VALUE_DTYPES)}, got {value_dtype!r}")
        if token_values and value_dim is not None:
            raise ValueError(f"a bank of token values stores ids, not vectors: got value_dim={value_dim}")
        self._dim, self._kind, self._value_dim, self._tokens = dim, index, value_dim, token_values
        self._value_dtype = TOKEN_DTYPE if token_values else VALUE_DTYPES[value_dtype]
        self._val_buf = np.empty((0, *self._slot_shape), self._value_dtype) if self.has_values else None
        self._off_buf = np.zeros(1, np.int64) if self.has_values else None
        self._ann_config = None if index == "flat" else AnnConfig(index, hnsw_m, hnsw_ef_search, ivf_nlist, ivf_nprobe)
        self._lock = threading.Lock()
        self._next_id = 0
        empty = np.empty((0, dim), np.float32)
        self._raw_buf, self._normed_buf, self._ids_buf = empty, empty, np.empty(0, np.int64)
        self._snap = _Snapshot(0, self._ids_buf, empty, empty, [], [], None, self._val_buf, self._off_buf)
        self.info: dict[str, Any] = {}  # bank-level JSON-compatible notes (e.g. how it was built), saved with it
        self._on_device: dict[str, DeviceKeys] = {}  # device -> the keys of one state there (exact device search)

    # ----------------------------------------------------------------------- properties

    def __len__(self) -> int:
        return self._snap.n

    @property
    def _slot_shape(self) -> tuple[int, ...]:
        return () if self._tokens else (self._value_dim,)

    def bytes_per_memory(self) -> float:
        """Memory held per memory: its key twice (raw and normalised, float32) and its values."""
        snap = self._snap
        values = 0 if snap.values is None or not snap.n else snap.values[:snap.offsets[snap.n]].nbytes / snap.n
        return 2 * 4 * self._dim + values

    def __repr__(self) -> str:
        values = ", token values" if self._tokens else f", value_dim={self._value_dim}" if self._value_dim is not None else ""
        return f"MemoryVectorDB(dim={self._dim}{values}, index={self._kind!r}, size={len(self)})"

    # ----------------------------------------------------------------------- writing

    def add(self, vectors: Any, texts: Sequence[str | None] | None = None,
            metadata: Sequence[dict | None] | None = None, values: Sequence[Any] | None = None) -> list[int]:
        """Add keys [N, D] (tensor or array, any float dtype) with optional texts/metadata and, in a bank
        with values, each memory's values ([k_i, Dv] each, or [k_i] token ids in a bank of token values);
        return their ids.

        Raises `BankError` for a wrong dimension, NaN/inf or all-zero rows (naming them), labels or
        values whose count is not N, or values given to (or missing from) a bank of the other kind.
        """
        raw, norms = prepare_vectors(vectors, expected_dim=self._dim, source="add")
        if values is None and self.has_values:
            raise BankError("add: expected values for every memory (this bank stores values beside its keys)")
        packed = None if values is None else pack_values(self, values, len(raw))
        return self._append(raw, norms, texts, metadata, "add", packed)

    def _append(self, raw: np.ndarray, norms: np.ndarray, texts, metadata, source: str,
                values: tuple[np.ndarray, np.ndarray] | None = None) -> list[int]:
        texts, metadata = check_labels(texts, metadata, len(raw), source)
        normed = normalise(raw, norms)
        with self._lock:
            snap, k = self._snap, len(raw)
            n, end = snap.n, snap.n + len(raw)
            if values is not None:
                self._append_values(snap, *values)
            ids = np.arange(self._next_id, self._next_id + k, dtype=np.int64)
            if n == 0 and end > len(self._raw_buf):  # first rows: adopt our fresh copies as the buffers
                self._raw_buf, self._normed_buf, self._ids_buf = raw, normed, ids.copy()
            else:
                if end > len(self._raw_buf):  # grow: copy into new buffers, old snapshots keep the old ones
                    cap = max(end, 2 * len(self._raw_buf))
                    for name in ("_raw_buf", "_normed_buf", "_ids_buf"):
                        old = getattr(self, name)
                        new = np.empty((cap, *old.shape[1:]), old.dtype)
                        new[:n] = old[:n]
                        setattr(self, name, new)
                self._raw_buf[n:end], self._normed_buf[n:end], self._ids_buf[n:end] = raw, normed, ids
            ann = snap.ann
            if self._ann_config is not None:
                ann = ann or AnnIndex(self._ann_config, self._dim)
                ann.add(normed)
            del snap.texts[n:], snap.metadata[n:]  # drop leftovers of a failed add
            snap.texts.extend(texts or [None] * k)
            snap.metadata.extend(metadata or [None] * k)
            self._next_id += k
            self._snap = _Snapshot(end, self._ids_buf[:end], self._raw_buf[:end], self._normed_buf[:end],
                                   snap.texts, snap.metadata, ann, *self._value_views(end))
            return ids.tolist()

    def _append_values(self, snap: _Snapshot, values: np.ndarray, offsets: np.ndarray) -> None:
        """Write new memories' values past the end of the value buffers (growing them by copying, as keys)."""
        n, start = snap.n, int(snap.offsets[snap.n])
        end, last = start + len(values), n + len(offsets) - 1
        if end > len(self._val_buf):
            grown = np.empty((max(end, 2 * len(self._val_buf)), *self._slot_shape), self._value_dtype)
            grown[:start] = self._val_buf[:start]
            self._val_buf = grown
        if last + 1 > len(self._off_buf):
            grown = np.empty(max(last + 1, 2 * len(self._off_buf)), np.int64)
            grown[:n + 1] = self._off_buf[:n + 1]
            self._off_buf = grown
        self._val_buf[start:end] = values
        self._off_buf[n + 1:last + 1] = start + offsets[1:]

    def _value_views(self, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        if not self.has_values:
            return None, None
        return self._val_buf[:self._off_buf[n]], self._off_buf[:n + 1]

    def remove(self, ids: Iterable[int]) -> int:
        """Remove entries by id; return the number of entries left.

        Other ids stay as they were (ids are stable, rows are compacted). Unknown ids raise
        `KeyError` and remove nothing. With HNSW/IVF the approximate index is rebuilt (IVF retrained).
        """
        wanted = np.unique(np.fromiter((int(i) for i in ids), dtype=np.int64))
        with self._lock:
            snap = self._snap
            if not len(wanted):
                return snap.n
            rows = np.searchsorted(snap.ids, wanted)
            found = rows < snap.n
            found[found] = snap.ids[rows[found]] == wanted[found]
            if not found.all():
                missing = wanted[~found]
                more = " ..." if len(missing) > 5 else ""
                raise KeyError(f"memory ids {missing[:5].tolist()}{more} are not in the bank")
            keep = np.ones(snap.n, bool)
            keep[rows] = False
            self._raw_buf, self._normed_buf, self._ids_buf = snap.raw[keep], snap.normed[keep], snap.ids[keep]
            texts = [t for t, k in zip(snap.texts[:snap.n], keep) if k]
            metadata = [m for m, k in zip(snap.metadata[:snap.n], keep) if k]
            ann = None
            if self._ann_config is not None and len(self._ids_buf):
                ann = AnnIndex(self._ann_config, self._dim)
                ann.add(self._normed_buf)
            if self.has_values:  # the kept memories' slots, compact
                spans = [snap.values[a:b] for a, b, k in zip(snap.offsets[:-1], snap.offsets[1:], keep) if k]
                self._val_buf = np.concatenate(spans) if spans else np.empty((0, *self._slot_shape), self._value_dtype)
                self._off_buf = np.concatenate([[0], np.cumsum([len(v) for v in spans], dtype=np.int64)])
            self._snap = _Snapshot(len(self._ids_buf), self._ids_buf, self._raw_buf, self._normed_buf,
                                   texts, metadata, ann, *self._value_views(len(self._ids_buf)))
            return self._snap.n

    def copy(self) -> "MemoryVectorDB":
        """An independent bank with the same entries and ids, texts, metadata, info and index kind."""
        snap = self._snap
        db = type(self)(self._dim, self._kind, value_dim=self._value_dim, token_values=self._tokens,
                        value_dtype="float32" if self._tokens else np.dtype(self._value_dtype).name)
        db._ann_config = self._ann_config
        if snap.n:
            raw, norms = prepare_vectors(snap.raw, expected_dim=self._dim, source="copy")
            values = None if snap.values is None else (snap.values.copy(), snap.offsets.copy())
            db._append(raw.copy(), norms, snap.texts[:snap.n],
                       [None if m is None else dict(m) for m in snap.metadata[:snap.n]], "copy", values)
            db._ids_buf[:snap.n] = snap.ids  # keep the stable ids (the snapshot views this buffer)
        db._next_id = self._next_id
        db.info = dict(self.info)
        return db

    # ----------------------------------------------------------------------- reading

    def topk(self, query: Any, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The memory head's search: (scores float32 [k], ids int64 [k]) on the CPU, best first. Through the
        approximate index (HNSW/IVF) when the bank has one and 0 < k < len: its k candidates are then the only ones
        returned. Otherwise exact cosine over all entries (one BLAS matrix-vector product; for a query on an
        accelerator, one product there with the keys copied to it once per bank state, `device_keys`). query: tensor
        (any dtype/device) or array, [D] or [1, D]; k=None (or k >= len) means all, exactly."""
        snap = self._snap
        if k is not None and k < 0:
            raise ValueError(f"k must be >= 0 or None, got {k}")
        approximate = snap.ann is not None and k is not None and 0 < k < snap.n
        if isinstance(query, torch.Tensor) and query.device.type != "cpu" and not approximate and snap.n:
            return self.device_keys(query.device).search(query, k)  # the query stays on its device
        q = as_query(query, self._dim)
        if approximate:
            scores, rows = snap.ann.search(q, k, snap.n)
        else:
            scores, rows = exact_topk(snap.normed, q, k)
        return torch.from_numpy(np.ascontiguousarray(scores, np.float32)), torch.from_numpy(snap.ids[rows])

    def device_keys(self, device: torch.device | str) -> DeviceKeys:
        """The current state's unit keys on `device`, copied there once per state (`memory/device.py`)."""
        snap, key = self._snap, str(torch.device(device))
        if (held := self._on_device.get(key)) is None or held.state is not snap:
            held = DeviceKeys.of(snap, snap.normed, snap.ids, torch.device(device))
            self._on_device = {**self._on_device, key: held}  # one reference swap, as the snapshots
        return held

    def search(self, query_vector: Any, top_k: int, debug: bool = False) -> list[dict[str, Any]]:
        """Best `top_k` entries (clamped to the bank size), best first, as dicts.

        Each: {"embedding": raw float32 tensor [D], "score": cosine, "index": id} plus "text" and
        "metadata" when the entry has them. Approximate when an HNSW/IVF index is configured and
        top_k < len. With debug=True, logs the query and every candidate on logger "memory.bank".
        """
        snap = self._snap
        q = as_query(query_vector, self._dim)
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        k = min(top_k, snap.n)
        approximate = snap.ann is not None and k < snap.n
        if k == 0:
            scores, rows = np.empty(0, np.float32), np.empty(0, np.int64)
        elif approximate:
            scores, rows = snap.ann.search(q, k, snap.n)
        else:
            scores, rows = exact_topk(snap.normed, q, k)
        results = [self._entry(snap, int(r), float(s)) for s, r in zip(scores, rows)]
        if debug:
            shape = tuple(query_vector.shape) if hasattr(query_vector, "shape") else (len(q),)
            log.info("[memory search] query shape %s, top_k=%d, %s over %d entries: %d candidates",
                     shape, top_k, f"{self._kind} (approximate)" if approximate else "exact", snap.n, len(results))
            for rank, r in enumerate(results, 1):
                log.info("  [%d] score=%.4f index=%d%s", rank, r["score"], r["index"],
                         f" text={r['text'][:60]!r}" if "text" in r else "")
        return results

    def _entry(self, snap: _Snapshot, row: int, score: float) -> dict[str, Any]:
        out = {"embedding": torch.from_numpy(snap.raw[row].copy()), "score": score, "index": int(snap.ids[row])}
        if snap.texts[row] is not None:
            out["text"] = snap.texts[row]
        if snap.metadata[row] is not None:
            out["metadata"] = dict(snap.metadata[row])
        return out

    def _row(self, snap: _Snapshot, i: int) -> int:
        i = int(i)  # also a 0-d tensor from `topk`
        row = int(np.searchsorted(snap.ids, i))
        if row >= snap.n or snap.ids[row] != i:
            raise KeyError(f"memory id {i} is not in the bank ({snap.n} entries)")
        return row

    def vector(self, i: int) -> torch.Tensor:
        """The raw float32 key [D] of id `i` (a copy)."""
        snap = self._snap
        return torch.from_numpy(snap.raw[self._row(snap, i)].copy())

    def values(self, i: int) -> torch.Tensor:
        """The value vectors [k, Dv] float32 of id `i`, in slot order (a copy; [1, D] = its key when a value is
        its key), or its token ids int64 [k] in a bank of token values."""
        snap = self._snap
        row = self._row(snap, i)
        if snap.values is None:
            return torch.from_numpy(snap.raw[row:row + 1].copy())
        span = snap.values[snap.offsets[row]:snap.offsets[row + 1]]
        return torch.from_numpy(span.astype(np.int64 if self._tokens else np.float32))

    def memory(self, i: int, score: float) -> Memory:
        """Memory `i` as the loop injects it, with the similarity it was chosen at."""
        return Memory(int(i), float(score), self.values(i), self.text(i))

    def text(self, i: int) -> str | None:
        snap = self._snap
        return snap.texts[self._row(snap, i)]

    def texts(self) -> list[str | None]:
        """Every memory's text (None: it has none), in row order (a copy)."""
        snap = self._snap
        return snap.texts[:snap.n]

    def metadata(self, i: int) -> dict | None:
        snap = self._snap
        m = snap.metadata[self._row(snap, i)]
        return None if m is None else dict(m)

    def entries(self, start: int = 0, count: int = 5) -> list[dict[str, Any]]:
        """A sample for display, by row position: [{"index": id, "text", "metadata", "norm"}]."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got start={start}, count={count}")
        snap = self._snap
        rows = range(start, min(start + count, snap.n))
        return [{"index": int(snap.ids[r]), "text": snap.texts[r],
                 "metadata": None if snap.metadata[r] is None else dict(snap.metadata[r]),
                 "norm": float(np.linalg.norm(snap.raw[r])),
                 "slots": 1 if snap.offsets is None else int(snap.offsets[r + 1] - snap.offsets[r])} for r in rows]

    # ----------------------------------------------------------------------- files

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically; the format follows the extension (.pt, .safetensors, .npy = vectors only)."""
        snap = self._snap
        texts, metadata = snap.texts[:snap.n], snap.metadata[:snap.n]
        write_bank(path, BankData(snap.raw, texts if any(t is not None for t in texts) else None,
                                  metadata if any(m is not None for m in metadata) else None, dict(self.info),
                                  snap.values, snap.offsets))

    @classmethod
    def load(cls, path: str | os.PathLike, *, check: BankCheck = BankCheck(), index: str = "flat",
             max_slots: int | None = None, max_bytes: int | None = None, vocab_size: int | None = None,
             **index_options: Any) -> "MemoryVectorDB":
        """Read a bank file (see `memory.files`); every problem raises `BankError` naming the file.

        `check`: what the model expects of the bank (its encoder, the dimensions of its keys and of what is
        injected; see `BankCheck`). `max_slots`: the most value slots one memory may have. `vocab_size`: token
        ids of a bank of token values must be below it. `max_bytes`: the largest file read.
        """
        data = read_bank(path, max_bytes=max_bytes)
        source = os.path.basename(path)
        written_by = data.info.get("encoder")
        if check.refuses(written_by):
            raise BankError(f"{source}: expected memories written by this model's encoder {check.encoder!r}, "
                            f"got a bank written by {written_by!r}; rebuild it from its texts with this model "
                            "(python -m chat.bankcli build memories.txt bank.pt, or write them in the Memory tab)")
        has_values = data.values is not None
        raw, norms = prepare_vectors(data.vectors, expected_dim=check.key_dim if has_values else check.dim,
                                     source=source)
        values = None
        if has_values:
            values = prepare_values(data.values, data.offsets, len(raw), expected_dim=check.dim,
                                    max_slots=max_slots, vocab_size=vocab_size, source=source)
        elif max_slots is not None and max_slots < 1:
            raise BankError(f"{source}: expected at most {max_slots} value slots per memory, got 1")
        tokens = has_values and values[0].ndim == 1
        db = cls(raw.shape[1], index, value_dim=values[0].shape[1] if has_values and not tokens else None,
                 value_dtype=values[0].dtype.name if has_values and not tokens else "float32", token_values=tokens,
                 **index_options)
        db._append(raw, norms, data.texts, data.metadata, source, values)
        db.info = dict(data.info)
        return db

"""Approximate FAISS indexes (HNSW, IVF) over unit vectors, guarded by a readers-writer lock."""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from memory.validate import BankError

INDEXES = ("flat", "hnsw", "ivf")


class RWLock:
    """Many readers or one writer; a waiting writer holds back new readers, so it cannot starve."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._waiting = 0

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing and not self._waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._writing and not self._readers)
            self._waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


@dataclass(frozen=True)
class AnnConfig:
    """Settings of the approximate index; `None` means chosen from the bank size."""

    kind: str = "hnsw"
    hnsw_m: int = 32
    hnsw_ef_search: int = 64
    ivf_nlist: int | None = None
    ivf_nprobe: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("hnsw", "ivf"):
            raise ValueError(f"approximate index must be 'hnsw' or 'ivf', got {self.kind!r}")
        for key in ("hnsw_m", "hnsw_ef_search", "ivf_nlist", "ivf_nprobe"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{key} must be a positive integer, got {value!r}")


def auto_nlist(n: int) -> int:
    """About sqrt(N) lists, each with at least the 39 training points FAISS asks for."""
    return max(1, min(round(math.sqrt(n)), n // 39))


class AnnIndex:
    """A FAISS inner-product index whose labels are row numbers of the bank it was built for.

    `add` mutates the index under the write lock; `search` runs under the read lock, so any number
    of searches run together but never during an add. IVF trains on the first batch it is given.
    """

    def __init__(self, config: AnnConfig, dim: int) -> None:
        self.config, self.dim = config, dim
        self.lock = RWLock()
        self.index: faiss.Index | None = None
        self._params: faiss.SearchParameters | None = None

    def _build(self, train: np.ndarray) -> faiss.Index:
        import faiss  # here, not at the top: exact search (and a machine without faiss) never needs it

        c = self.config
        if c.kind == "hnsw":
            self._params = faiss.SearchParametersHNSW(efSearch=c.hnsw_ef_search)
            return faiss.IndexHNSWFlat(self.dim, c.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        nlist = c.ivf_nlist or auto_nlist(len(train))
        if nlist > len(train):
            raise BankError(f"ivf_nlist={nlist} needs at least {nlist} vectors to train on, got {len(train)}")
        quantizer = faiss.IndexFlatIP(self.dim)
        index = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = 1234
        index.train(train)
        self._quantizer = quantizer  # the IVF index points to it: keep it alive
        self._params = faiss.SearchParametersIVF(nprobe=c.ivf_nprobe or max(1, min(nlist, round(math.sqrt(nlist)))))
        return index

    @property
    def ntotal(self) -> int:
        return 0 if self.index is None else self.index.ntotal

    def add(self, normed: np.ndarray) -> None:
        """Append unit vectors [K, D]; their labels continue from `ntotal`."""
        with self.lock.write():
            if self.index is None:
                self.index = self._build(normed)
            self.index.add(normed)

    def search(self, query: np.ndarray, k: int, visible: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores [<=k], rows [<=k]) best first for a unit query [D]; rows >= `visible` are dropped."""
        import faiss

        with self.lock.read():
            params = self._params
            if isinstance(params, faiss.SearchParametersHNSW) and params.efSearch < k:
                params = faiss.SearchParametersHNSW(efSearch=k)
            scores, rows = self.index.search(query[None], k, params=params)  # [1, k]
        keep = (rows[0] >= 0) & (rows[0] < visible)
        return scores[0][keep], rows[0][keep]

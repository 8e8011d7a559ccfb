"""Exact search with the bank's keys resident on an accelerator: the query never leaves the device.

`MemoryVectorDB.topk` takes this path for a query that lives on a device other than the CPU and a search
that is exact (no approximate index, or k = all): scores = unit keys [N, D] @ unit query [D] on the device,
the best k by `torch.topk`, and only those k scores and ids come back to the host (the memory's slots are
needed there anyway). The keys are copied to the device once per published bank state (`_Snapshot`): a
bank that changes is copied again at its next device search.

On CUDA the search is a dozen and a half kernels (the norm, the product, torch.topk's radix select, the gather) and
two copies back, each a launch on the host while the device waits: from a state's second search with one k, the
whole search is one captured CUDA graph (`_Head`) that ends with the copy of the k scores and ids into pinned host
memory, so a search is one replay and one wait.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

log = logging.getLogger("memory.device")


@dataclass(frozen=True)
class DeviceKeys:
    """One bank state's unit keys [N, D] float32 and stable ids [N] on a device."""

    state: object  # the bank snapshot they were copied from (compared by identity)
    keys: torch.Tensor  # [N, D] float32, unit rows
    ids: torch.Tensor  # [N] int64
    _heads: dict = field(default_factory=dict, repr=False, compare=False)  # k -> searches so far, then its _Head
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def of(cls, state, normed: np.ndarray, ids: np.ndarray, device: torch.device) -> "DeviceKeys":
        return cls(state, torch.from_numpy(np.ascontiguousarray(normed)).to(device),
                   torch.from_numpy(np.ascontiguousarray(ids)).to(device))

    def topk(self, query: torch.Tensor, k: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cosine scores [k] float32, ids [k] int64) best first, on the device, of a query [D] or [1, D] there."""
        q = query.detach().reshape(-1).to(self.keys.device, torch.float32)  # [D]
        if q.shape[0] != self.keys.shape[1]:
            raise ValueError(f"query: expected shape [{self.keys.shape[1]}] or [1, {self.keys.shape[1]}], "
                             f"got {tuple(query.shape)}")
        scores = self.keys @ (q / q.norm())  # [N]
        n = scores.shape[0]
        top, rows = torch.topk(scores, n if k is None else min(k, n), sorted=True)  # [k]
        return top, self.ids[rows]

    def search(self, query: torch.Tensor, k: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`topk` read back to the host: (scores [k] float32, ids [k] int64) on the CPU; on CUDA from a state's
        second search with this k, one replay of its captured graph (`_Head`)."""
        if self.keys.device.type != "cuda":
            scores, ids = self.topk(query, k)
            return scores.cpu(), ids.cpu()
        k = self.keys.shape[0] if k is None else min(k, self.keys.shape[0])
        with self._lock:  # (a head's buffers are one search's at a time)
            head = self._heads.get(k, 0)  # searches so far, its _Head, or None: the capture failed
            if isinstance(head, int):  # (a state searched once is not worth a capture)
                head = self._heads[k] = _Head.capture(self, k) if head else 1
            if isinstance(head, _Head):
                return head(query)
            scores, ids = self.topk(query, k)
            return scores.cpu(), ids.cpu()


class _Head:
    """One state's search for one k as a captured CUDA graph: the query copied into `query` (cast to float32) before
    the replay; the replay normalises it, scores every key, takes the top k and copies scores and ids into pinned
    host memory; the host waits for that copy alone."""

    def __init__(self, keys: DeviceKeys, k: int):
        device = keys.keys.device
        self.keys, self.k = keys, k
        self.query = torch.zeros(keys.keys.shape[1], dtype=torch.float32, device=device)
        self.scores = torch.empty(k, dtype=torch.float32, pin_memory=True)
        self.ids = torch.empty(k, dtype=torch.int64, pin_memory=True)
        self.done = torch.cuda.Event()
        side = torch.cuda.Stream(device)  # (a capture's first run of each kernel, off the default stream)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._body()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):  # (the chat's loop may run meanwhile)
            self._body()

    @classmethod
    def capture(cls, keys: DeviceKeys, k: int) -> "_Head | None":
        """The captured head, or None (the search then stays eager) when the capture fails (logged)."""
        try:
            return cls(keys, k)
        except Exception as e:  # noqa: BLE001 - the eager search is the same search
            log.warning("capturing the memory head's search failed (%s: %s); it runs eagerly", type(e).__name__, e)
            return None

    def _body(self) -> None:
        scores, ids = self.keys.topk(self.query, self.k)
        self.scores.copy_(scores, non_blocking=True)
        self.ids.copy_(ids, non_blocking=True)

    def __call__(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = query.detach().reshape(-1)
        if q.shape[0] != self.query.shape[0]:
            raise ValueError(f"query: expected shape [{self.query.shape[0]}] or [1, {self.query.shape[0]}], "
                             f"got {tuple(query.shape)}")
        self.query.copy_(q)
        self.graph.replay()
        self.done.record()
        self.done.synchronize()
        return self.scores.clone(), self.ids.clone()

"""Exact search with the bank's keys resident on an accelerator: the query never leaves the device.

`MemoryVectorDB.topk` takes this path for a query that lives on a device other than the CPU and a search
that is exact (no approximate index, or k = all): scores = unit keys [N, D] @ unit query [D] on the device,
the best k by `torch.topk`, and only those k scores and ids come back to the host (the memory's slots are
needed there anyway). The keys are copied to the device once per published bank state (`_Snapshot`): a
bank that changes is copied again at its next device search.

On CUDA the search is about 30 kernels (the norm, the product, torch.topk's radix select, the gather) and two copies
back, each a launch on the host while the device waits: from a state's `CAPTURE_AFTER`-th search with one k, the
whole search is one captured CUDA graph (`_Head`) that ends with the copy of the k scores and ids into pinned host
memory, so a search is one replay and one wait (GPU run 5: 0.47 -> 0.29 ms at 100k memories, 0.13 ms of kernels).
A greedy head with no memory processor asks for k = 1 (`decoding.memory.MemorySelector.scores`): one reduction over
the scores in place of torch.topk's radix select (run 5: 47 µs of those 0.13 ms; not yet measured since).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

log = logging.getLogger("memory.device")


CAPTURE_AFTER = 4  # searches of one state with one k before its search is captured (a capture costs milliseconds)


def _topk(keys: torch.Tensor, ids: torch.Tensor, query: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cosine scores [k] float32, ids [k] int64) best first, on the keys' device: unit keys [N, D], a query [D] or
    [1, D] there."""
    q = query.detach().reshape(-1).to(keys.device, torch.float32)  # [D]
    if q.shape[0] != keys.shape[1]:
        raise ValueError(f"query: expected shape [{keys.shape[1]}] or [1, {keys.shape[1]}], got {tuple(query.shape)}")
    scores = keys @ (q / q.norm())  # [N]
    if k == 1:  # (a greedy memory head's search: one reduction, not torch.topk's radix select)
        top, rows = scores.max(0, keepdim=True)
    else:
        top, rows = torch.topk(scores, k, sorted=True)  # [k]
    return top, ids[rows]


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
        n = self.keys.shape[0]
        return _topk(self.keys, self.ids, query, n if k is None else min(k, n))

    def search(self, query: torch.Tensor, k: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`topk` read back to the host: (scores [k] float32, ids [k] int64) on the CPU; on CUDA, from a state's
        `CAPTURE_AFTER`-th search with this k, one replay of its captured graph (`_Head`)."""
        if self.keys.device.type != "cuda":
            scores, ids = self.topk(query, k)
            return scores.cpu(), ids.cpu()
        k = self.keys.shape[0] if k is None else min(k, self.keys.shape[0])
        with self._lock:  # (a head's buffers are one search's at a time)
            head = self._heads.get(k, 0)  # searches so far, its _Head, or None: the capture failed
            if isinstance(head, int):  # (a state searched a few times is not worth a capture)
                head = self._heads[k] = _Head.capture(self.keys, self.ids, k) if head + 1 >= CAPTURE_AFTER \
                    else head + 1
            if isinstance(head, _Head):
                return head(query)
            scores, ids = self.topk(query, k)
            return scores.cpu(), ids.cpu()


class _Head:
    """One state's search for one k as a captured CUDA graph: the query copied into `query` (cast to float32) before
    the replay; the replay normalises it, scores every key, takes the top k and copies scores and ids into pinned
    host memory; the host waits for that copy alone. It holds the state's tensors, not the state (no cycle: the keys
    go with the state). Captured on a stream of its own on the keys' device with the raw capture calls
    (`torch.cuda.graph` would capture on the process's one capture stream, which a graph step's warm-up may be
    capturing on in another thread, and synchronises the whole device first)."""

    def __init__(self, keys: torch.Tensor, ids: torch.Tensor, k: int):
        self.device = keys.device
        self.keys, self.ids, self.k = keys, ids, k
        self.query = torch.zeros(keys.shape[1], dtype=torch.float32, device=self.device)
        self.scores = torch.empty(k, dtype=torch.float32, pin_memory=True)
        self.rows = torch.empty(k, dtype=torch.int64, pin_memory=True)
        with torch.cuda.device(self.device):
            self.done = torch.cuda.Event()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):  # (the thread's stream is restored whatever fails below)
                self._body()  # (each kernel's first run, as a capture wants)
                self.graph.capture_begin(capture_error_mode="thread_local")  # (the chat's loop may run meanwhile)
                try:
                    self._body()
                except BaseException:
                    with contextlib.suppress(Exception):  # (the body's error is the one to tell)
                        self.graph.capture_end()
                    raise
                self.graph.capture_end()
            torch.cuda.current_stream().wait_stream(side)

    @classmethod
    def capture(cls, keys: torch.Tensor, ids: torch.Tensor, k: int) -> "_Head | None":
        """The captured head, or None (the search then stays eager) when the capture fails (logged)."""
        try:
            return cls(keys, ids, k)
        except Exception as e:  # noqa: BLE001 - the eager search is the same search
            log.warning("capturing the memory head's search failed (%s: %s); it runs eagerly", type(e).__name__, e)
            return None

    def _body(self) -> None:
        scores, ids = _topk(self.keys, self.ids, self.query, self.k)
        self.scores.copy_(scores, non_blocking=True)
        self.rows.copy_(ids, non_blocking=True)

    def __call__(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = query.detach().reshape(-1)
        if q.shape[0] != self.query.shape[0]:
            raise ValueError(f"query: expected shape [{self.query.shape[0]}] or [1, {self.query.shape[0]}], "
                             f"got {tuple(query.shape)}")
        with torch.cuda.device(self.device):
            self.query.copy_(q)
            self.graph.replay()
            self.done.record()
        self.done.synchronize()
        return self.scores.clone(), self.rows.clone()

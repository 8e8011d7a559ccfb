"""Exact search with the bank's keys resident on an accelerator: the query never leaves the device.

`MemoryVectorDB.topk` takes this path for a query that lives on a device other than the CPU and a search
that is exact (no approximate index, or k = all): scores = unit keys [N, D] @ unit query [D] on the device,
the best k by `torch.topk`, and only those k scores and ids come back to the host (the memory's slots are
needed there anyway). The keys are copied to the device once per published bank state (`_Snapshot`): a
bank that changes is copied again at its next device search.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DeviceKeys:
    """One bank state's unit keys [N, D] float32 and stable ids [N] on a device."""

    state: object  # the bank snapshot they were copied from (compared by identity)
    keys: torch.Tensor  # [N, D] float32, unit rows
    ids: torch.Tensor  # [N] int64

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

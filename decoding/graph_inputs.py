"""The input buffers of one width of the graph step (`decoding/graph.py`): device tensors written in place
between replays (the step marks them as static addresses for torch.compile, or not: `GraphStep._mark_state`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Inputs:
    """One graph's input buffers (device tensors, written in place between replays)."""

    ids: torch.Tensor  # [B, W] int64
    vector: torch.Tensor  # [B, W, H] model dtype: what a flagged position gets instead of its token's embedding
    flag: torch.Tensor  # [B, W] bool
    position: torch.Tensor  # [B, W] int64
    last: torch.Tensor  # [B] int64: the column whose state and logits come out
    n: torch.Tensor  # [B] int64: each row's real columns (the rest is padding: after them, or before them for rows)

    @classmethod
    def zeros(cls, batch: int, width: int, hidden: int, device, dtype) -> "Inputs":
        return cls(torch.zeros((batch, width), dtype=torch.long, device=device),
                   torch.zeros((batch, width, hidden), dtype=dtype, device=device),
                   torch.zeros((batch, width), dtype=torch.bool, device=device),
                   torch.zeros((batch, width), dtype=torch.long, device=device),
                   torch.zeros(batch, dtype=torch.long, device=device),
                   torch.full((batch,), width, dtype=torch.long, device=device))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.ids, self.vector, self.flag, self.position, self.last

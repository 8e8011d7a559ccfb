"""The recall losses as pure tensor functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def info_nce(queries: torch.Tensor, keys: torch.Tensor, tau: float,
             extra_keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """InfoNCE with in-batch negatives (van den Oord et al. 2018): query i should pick key i.

    queries, keys: [P, H]; extra_keys: [K, H] more negatives (e.g. earlier batches' memories).
    Cosine similarities / tau are the logits, as the memory head scores memories.
    Returns (mean loss, accuracy of the argmax).
    """
    if queries.shape != keys.shape:
        raise ValueError(f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} must have the same shape")
    q = F.normalize(queries.float(), dim=-1)
    k = F.normalize(keys.float(), dim=-1)
    if extra_keys is not None and len(extra_keys):
        k = torch.cat([k, F.normalize(extra_keys.float(), dim=-1)])
    logits = q @ k.T / tau  # [P, P + K]
    target = torch.arange(len(q), device=q.device)
    return F.cross_entropy(logits, target), (logits.argmax(-1) == target).float().mean()


def masked_means(values: torch.Tensor, groups: torch.Tensor, count: int) -> list[torch.Tensor]:
    """Mean of `values` [N] over each group id 0..count-1 in `groups` [N] (0 when a group is empty)."""
    out = []
    for g in range(count):
        m = groups == g
        out.append(values[m].mean() if bool(m.any()) else values.sum() * 0)
    return out

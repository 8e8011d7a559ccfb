"""The fit check: does a memory answer what a person asks about themself? A small network over the pair of
embeddings the memory head already scores (the message's query and the memory's key), trained by
`training/fits.py` on invented people and shipped as `assets/memory-fits.safetensors` (50 KB).

The memory head's cosine alone reads "Nina is the user's cousin." for "What's the name of my daughter?" (0.39, over
`min_score`): a question about the user reads only memories this check admits, and with none the model says it
was not told.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "memory-fits.safetensors"


def pair_features(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """[N, D] unit queries and keys -> [N, 2D]: their product and their distance, dimension by dimension."""
    query, key = query.float(), key.float()
    return torch.cat([query * key, (query - key).abs()], dim=-1)


class FitCheck:
    """`admits(queries, keys)`: for each (query, key) pair, whether the memory answers the question."""

    def __init__(self, features: int, hidden: int, threshold: float = 0.5, key_encoder: str = "",
                 report: dict | None = None):
        self.net = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 1))
        self.threshold, self.key_encoder, self.report = threshold, key_encoder, report or {}

    def eval(self) -> "FitCheck":
        self.net.eval().requires_grad_(False)
        return self

    @torch.no_grad()
    def probability(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.net(pair_features(queries, keys)).squeeze(-1))

    def admits(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[N] bool."""
        return self.probability(queries, keys) >= self.threshold

    def save(self, path: str | Path, key_encoder: str, report: dict) -> None:
        tensors = {k: v.detach().float().contiguous() for k, v in self.net.state_dict().items()}
        tensors["threshold"] = torch.tensor([self.threshold])
        save_file(tensors, str(path), metadata={"key_encoder": key_encoder, "report": json.dumps(report)})

    @classmethod
    def load(cls, path: str | Path = SHIPPED) -> "FitCheck":
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        threshold = float(tensors.pop("threshold")[0])
        hidden, features = tensors["0.weight"].shape
        check = cls(features, hidden, threshold, meta.get("key_encoder", ""), json.loads(meta.get("report", "{}")))
        check.net.load_state_dict(tensors)
        return check.eval()

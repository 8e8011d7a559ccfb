"""The write decision of `memory.remember: auto` as a model: a logistic regression over the key encoder's embedding
of a message (trained by `training/remember.py`, shipped as `assets/remember-decision.safetensors`, 1.6 KB).

A message is written when its score reaches the file's threshold and it is not a question: questions ask, they do
not tell.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "remember-decision.safetensors"


def is_question(text: str) -> bool:
    return text.rstrip().endswith("?")


class WriteDecision:
    """`wants(text, embedding)`: whether a message tells something worth keeping about its author."""

    def __init__(self, weight: torch.Tensor, bias: float, threshold: float, key_encoder: str, report: dict):
        self.weight, self.bias, self.threshold = weight.float(), float(bias), float(threshold)
        self.key_encoder, self.report = key_encoder, report

    @classmethod
    def load(cls, path: str | Path = SHIPPED) -> "WriteDecision":
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            return cls(f.get_tensor("weight"), f.get_tensor("bias")[0], f.get_tensor("threshold")[0],
                       meta.get("key_encoder", ""), json.loads(meta.get("report", "{}")))

    def score(self, embedding: torch.Tensor) -> float:
        return float(torch.sigmoid(embedding.float().reshape(-1) @ self.weight + self.bias))

    def wants(self, text: str, embedding: torch.Tensor) -> bool:
        return not is_question(text) and self.score(embedding) >= self.threshold

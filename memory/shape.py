"""What every memory bank is, whichever store keeps it: `BankShape` (its dimensions and kind of values),
`Memory` (one memory as the memory head hands it to the loop) and `pack_values` (a memory's values checked
and packed for a store). `MemoryVectorDB` (memory/bank.py) and `MilvusBank` (memory/milvus.py) build on them.

A memory is a key (one vector: what the index holds and the memory head scores) and a value (k >= 1
slots, what the memory embedding injects, in order, one per `<|memory_pad|>` slot): k vectors, or k
token ids of the model's vocabulary (a `tokens` bank: the model's own input embeddings of those ids are
injected, looked up at injection, so a memory costs 4 bytes a slot). A bank built without values keeps
the seeds' single-vector memory: k = 1, key = value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from memory.validate import BankError, prepare_values


@dataclass(frozen=True, slots=True)
class Memory:
    """One memory as the memory head hands it to the loop."""

    index: int  # its stable id in the bank
    score: float  # cosine similarity of the query and its key
    values: torch.Tensor  # [k, Dv] float32, or token ids int64 [k]: what is injected a <|memory_pad|> slot, in order
    text: str | None = None
    source: str | None = None  # the label of its bank, when several are searched as one (`memory.personal.Joined`)

    @property
    def token_ids(self) -> bool:
        """Whether `values` are token ids (the model's input embeddings of them are injected)."""
        return not self.values.is_floating_point()

    @property
    def slots(self) -> int:
        return self.values.shape[0]

class BankShape:
    """What every bank says about its vectors, from `_dim`, `_kind`, `_value_dim` (None: value = key) and
    `_tokens` (values are token ids)."""

    _dim: int
    _kind: str
    _value_dim: int | None
    _tokens: bool = False

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def index(self) -> str:
        return self._kind

    @property
    def value_dim(self) -> int | None:
        """The dimension of what is injected: the values', or the keys' when a value is its key; None for token
        ids (the model's own embeddings, whatever its hidden size)."""
        if self._tokens:
            return None
        return self._dim if self._value_dim is None else self._value_dim

    @property
    def has_values(self) -> bool:
        """Whether memories have values of their own (else value = key, one slot)."""
        return self._value_dim is not None or self._tokens

    @property
    def token_values(self) -> bool:
        """Whether the values are token ids of the model that wrote the bank (a `tokens` bank)."""
        return self._tokens


def pack_values(bank: BankShape, values: Sequence[Any], n: int) -> tuple[np.ndarray, np.ndarray]:
    """`add`'s values (one array a memory: [k, Dv] vectors, or [k] token ids in a bank of token values) checked and
    packed flat with their offsets, for a bank of either store."""
    if not bank.has_values:
        raise BankError("add: expected no values (in this bank a memory's value is its key)")
    if len(values) != n:
        raise BankError(f"add: expected {n} value arrays (one per key), got {len(values)}")
    parts = [v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for v in values]
    tokens = bank.token_values
    if any(p.ndim != (1 if tokens else 2) or np.issubdtype(p.dtype, np.integer) != tokens for p in parts):
        raise BankError("add: expected each memory's values as token ids [k] (a bank of token values)" if tokens else
                        f"add: expected each memory's values as a 2-D float array [k, {bank.value_dim}]")
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])])
    flat = np.concatenate(parts) if tokens else np.concatenate([p.astype(np.float32, copy=False) for p in parts])
    return prepare_values(flat, offsets, n, expected_dim=bank.value_dim, source="add")

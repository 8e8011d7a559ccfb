"""Checks shared by `MemoryVectorDB.add` and `MemoryVectorDB.load`: vectors, labels, queries; `BankCheck`, what a
model expects of a bank it opens (a file or a Milvus collection)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

_CHUNK_ELEMENTS = 1 << 22  # per pass when computing norms: bounds the float64 temporary to 32 MB
_SHOW = 5  # offending row numbers named in a message


def shown(text: str, width: int = 80) -> str:
    """A text as a message repeats it: whole up to `width` characters, else its start and its length (a 5,000-character
    id came back whole in its 404)."""
    return text if len(text) <= width else f"{text[:width // 2]}... ({len(text)} characters)"


class BankError(ValueError):
    """A memory bank (file or vectors) that cannot be used; the message says what was expected."""


class DimensionError(BankError):
    """A bank whose vectors are not of the dimension expected of them (a bank of another model): `got` theirs,
    `expected` the model's."""

    def __init__(self, message: str, got: int | None = None, expected: int | None = None):
        super().__init__(message)
        self.got, self.expected = got, expected


@dataclass(frozen=True)
class BankCheck:
    """What a model expects of a bank it opens, checked by `MemoryVectorDB.load` and `MilvusBank.open` alike
    (None: not checked).

    `dim`: the dimension of what is injected (the model's hidden size): the values', or the keys' in a bank
    whose values are its keys (a bank of token values has none: the model embeds its ids). `key_dim`: the
    keys' dimension in a bank with values (its key encoder's). `encoder`: the name of the encoder that must
    have written the bank; a bank that records another is refused (its vectors mean something else to this
    model), one that records none (raw vectors from elsewhere) is accepted as it is.
    """

    dim: int | None = None
    key_dim: int | None = None
    encoder: str | None = None

    def refuses(self, written_by: str | None) -> bool:
        """Whether a bank stamped by the encoder `written_by` (None: no stamp) is refused."""
        return self.encoder is not None and written_by is not None and written_by != self.encoder


def to_numpy(vectors: Any, source: str) -> np.ndarray:
    """A float32 numpy copy of a tensor / ndarray (any float dtype, any device)."""
    if isinstance(vectors, torch.Tensor):
        if not vectors.is_floating_point():
            raise BankError(f"{source}: expected floating-point vectors, got dtype {vectors.dtype}")
        return vectors.detach().to("cpu", torch.float32).numpy().copy()
    if isinstance(vectors, np.ndarray):
        if not np.issubdtype(vectors.dtype, np.floating):
            raise BankError(f"{source}: expected floating-point vectors, got dtype {vectors.dtype}")
        return np.array(vectors, dtype=np.float32, order="C", copy=True)
    raise BankError(f"{source}: expected a torch.Tensor or numpy array of vectors, got {type(vectors).__name__}")


def _chunk_rows(dim: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(dim, 1))


def _rows(rows: np.ndarray) -> str:
    shown = ", ".join(str(int(r)) for r in rows[:_SHOW])
    return shown + (f", ... ({len(rows)} rows in all)" if len(rows) > _SHOW else "")


def prepare_vectors(
    vectors: Any, *, expected_dim: int | None = None, source: str = "vectors"
) -> tuple[np.ndarray, np.ndarray]:
    """Validate a batch of memory vectors; return (raw float32 [N, D], float64 L2 norms [N]).

    Rejects: not 2-D, 0 rows or 0 columns, a dimension other than `expected_dim`, rows holding
    NaN/inf, all-zero rows (no direction, so no cosine). Messages name the offending rows.
    """
    raw = to_numpy(vectors, source)
    if raw.ndim != 2:
        raise BankError(f"{source}: expected a 2-D array of vectors [N, D], got shape {tuple(raw.shape)}")
    n, d = raw.shape
    if n == 0:
        raise BankError(f"{source}: expected at least one vector, got an empty bank (0 rows)")
    if d == 0:
        raise BankError(f"{source}: expected vectors of dimension > 0, got shape {tuple(raw.shape)}")
    if expected_dim is not None and d != expected_dim:
        raise DimensionError(f"{source}: expected vectors of dimension {expected_dim}, got dimension {d}", d,
                             expected_dim)
    norms = np.empty(n, dtype=np.float64)
    step = _chunk_rows(d)
    for s in range(0, n, step):
        norms[s:s + step] = np.linalg.norm(raw[s:s + step].astype(np.float64), axis=1)  # inf/nan propagate
    bad = np.flatnonzero(~np.isfinite(norms))
    if len(bad):
        raise BankError(f"{source}: expected finite vectors, got NaN/inf in rows {_rows(bad)}")
    zero = np.flatnonzero(norms == 0)
    if len(zero):
        raise BankError(f"{source}: expected non-zero vectors (cosine needs a direction), "
                        f"got all-zero rows {_rows(zero)}")
    return raw, norms


def normalise(raw: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """Unit-length float32 copy of `raw` [N, D] given its float64 `norms` [N]."""
    out = np.empty_like(raw)
    step = _chunk_rows(raw.shape[1])
    for s in range(0, len(raw), step):
        out[s:s + step] = raw[s:s + step] / norms[s:s + step, None]
    return out


def _label_list(values: Any, n: int, source: str, what: tuple[str, str, str], item: type, item_name: str) -> list | None:
    """`values` as a list of n entries, each an `item` or None; BankError naming what is wrong."""
    name, plural, singular = what  # e.g. ("metadata", "metadata entries", "metadata entry")
    if values is None:
        return None
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sequence):
        raise BankError(f"{source}: expected {name} as a list of {item_name}s, got {type(values).__name__}")
    if len(values) != n:
        raise BankError(f"{source}: expected {n} {plural} (one per vector), got {len(values)}")
    bad = [i for i, v in enumerate(values) if v is not None and not isinstance(v, item)]
    if bad:
        raise BankError(f"{source}: expected each {singular} to be a {item_name}, "
                        f"got {type(values[bad[0]]).__name__} at rows {_rows(np.array(bad))}")
    return list(values)


def check_labels(
    texts: Sequence[str | None] | None, metadata: Sequence[dict | None] | None, n: int, source: str = "vectors"
) -> tuple[list[str | None] | None, list[dict | None] | None]:
    """Texts (str or None) and metadata (JSON-compatible dict or None), one per row, as lists."""
    texts = _label_list(texts, n, source, ("texts", "texts", "text"), str, "string")
    metadata = _label_list(metadata, n, source, ("metadata", "metadata entries", "metadata entry"), dict, "dict")
    if metadata is not None:
        try:
            json.dumps(metadata)
        except (TypeError, ValueError) as e:
            raise BankError(f"{source}: expected JSON-compatible metadata (it is saved as JSON), got {e}") from None
    return texts, metadata


def as_query(query: Any, dim: int) -> np.ndarray:
    """A unit-length float32 [D] query from a tensor (any dtype/device) or array of shape [D] or [1, D]."""
    if isinstance(query, torch.Tensor):
        q = query.detach().to("cpu", torch.float32).numpy()
    else:
        q = np.asarray(query, dtype=np.float32)
    if q.ndim == 2 and q.shape[0] == 1:
        q = q[0]
    if q.shape != (dim,):
        raise ValueError(f"query: expected shape [{dim}] or [1, {dim}], got {tuple(q.shape)}")
    norm = float(np.linalg.norm(q.astype(np.float64)))
    if not np.isfinite(norm) or norm == 0:
        raise ValueError(f"query: expected a finite non-zero vector, got norm {norm}")
    return (q / norm).astype(np.float32)


VALUE_DTYPES = {"float32": np.float32, "float16": np.float16}
TOKEN_DTYPE = np.int32  # token ids of a bank of `tokens` values


def prepare_values(values: Any, offsets: Any, n: int, *, expected_dim: int | None = None,
                   max_slots: int | None = None, vocab_size: int | None = None,
                   source: str = "values") -> tuple[np.ndarray, np.ndarray]:
    """Validate key/value memories' values and offsets [n + 1] (memory i's slots are rows
    offsets[i]:offsets[i+1]). Values are one flat array of either kind:
      vectors  [S, D] float32 or float16 (kept as given): injected as they are (after the memory embedding)
      tokens   [S] integer token ids (stored as int32): the model's own input embeddings, looked up at injection
    Returns (values, int64 offsets).

    Rejects: offsets that are not integers, not n + 1 long, not starting at 0 and ending at S, or not
    strictly increasing (every memory has at least one slot); a memory with more than `max_slots` slots;
    vectors that are not 2-D, of a dimension other than `expected_dim`, or not finite; token ids below 0 or
    not below `vocab_size`. Names the rows.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        values = values.numpy() if values.dtype in (torch.float32, torch.float16) or not values.is_floating_point() \
            else values.float().numpy()
    values = np.asarray(values)
    tokens = np.issubdtype(values.dtype, np.integer)
    if not tokens and not np.issubdtype(values.dtype, np.floating):
        raise BankError(f"{source}: expected floating-point value vectors or integer token ids, got dtype {values.dtype}")
    offsets = offsets.detach().cpu().numpy() if isinstance(offsets, torch.Tensor) else np.asarray(offsets)
    if offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer):
        raise BankError(f"{source}: expected value offsets as a 1-D integer array, got shape "
                        f"{tuple(offsets.shape)} of {offsets.dtype}")
    if len(offsets) != n + 1:
        raise BankError(f"{source}: expected {n + 1} value offsets (one more than the {n} memories), got {len(offsets)}")
    if tokens and values.ndim != 1:
        raise BankError(f"{source}: expected token ids as a 1-D array [slots], got shape {tuple(values.shape)}")
    if not tokens and (values.ndim != 2 or values.shape[1] == 0):
        raise BankError(f"{source}: expected values as a 2-D array [slots, D], got shape {tuple(values.shape)}")
    if not tokens and expected_dim is not None and values.shape[1] != expected_dim:
        raise DimensionError(f"{source}: expected value vectors of dimension {expected_dim}, got dimension "
                             f"{values.shape[1]}")
    offsets = offsets.astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != len(values):
        raise BankError(f"{source}: expected value offsets from 0 to {len(values)} (the number of value rows), "
                        f"got {int(offsets[0])} to {int(offsets[-1])}")
    slots = np.diff(offsets)
    bad = np.flatnonzero(slots < 1)
    if len(bad):
        raise BankError(f"{source}: expected value offsets strictly increasing (every memory has at least one "
                        f"slot), got memories with {int(slots[bad[0]])} slots at rows {_rows(bad)}")
    if max_slots is not None:
        bad = np.flatnonzero(slots > max_slots)
        if len(bad):
            raise BankError(f"{source}: expected at most {max_slots} value slots per memory (memory.max_slots), got "
                            f"{int(slots[bad].max())} at rows {_rows(bad)}")
    if tokens:
        top = np.iinfo(TOKEN_DTYPE).max if vocab_size is None else vocab_size - 1
        wrong = np.flatnonzero((values < 0) | (values > top))
        if len(wrong):
            memories = np.unique(np.searchsorted(offsets, wrong, "right") - 1)
            raise BankError(f"{source}: expected token ids from 0 to {top} (the model's vocabulary), got "
                            f"{int(values[wrong[0]])} in the values of memories {_rows(memories)}")
        return np.ascontiguousarray(values, dtype=TOKEN_DTYPE), offsets
    if values.dtype not in (np.float32, np.float16):
        values = values.astype(np.float32)
    step = _chunk_rows(values.shape[1])
    for s in range(0, len(values), step):
        if not np.isfinite(values[s:s + step]).all():
            rows = np.searchsorted(offsets, s + np.flatnonzero(~np.isfinite(values[s:s + step]).all(1)), "right") - 1
            raise BankError(f"{source}: expected finite values, got NaN/inf in the values of memories {_rows(np.unique(rows))}")
    return np.ascontiguousarray(values), offsets

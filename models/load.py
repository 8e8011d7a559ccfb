"""`load_model`: a model on the backend that runs it, transformers (`models/loading.py`) or llama.cpp
(`models/llamacpp.py`); `auto` is decided here."""

from __future__ import annotations

import importlib.util
import os

from models.embedded import resolve_device
from models.llamacpp import load_gguf_model
from models.loading import LoadedModel, LoadOptions, load_transformers_model

BACKENDS = ("auto", "transformers", "llamacpp")


def resolve_backend(options: LoadOptions, path) -> str:
    """The backend that runs a model, decided here only: a .gguf file runs on llama.cpp (transformers loads
    model folders); `auto` runs the embedded model on llama.cpp on a CPU when llama-cpp-python is installed and
    nothing configured needs transformers (int8 weights, a decoder whose capability llama.cpp lacks), every
    other case on transformers."""
    backend = options.backend
    if backend not in BACKENDS:
        raise ValueError(f"model.backend is {backend!r}; expected auto, transformers or llamacpp")
    if path is not None and str(path).lower().endswith(".gguf"):
        return "llamacpp"
    if backend != "auto":
        return backend
    llama = (path is None and resolve_device(options.device).type == "cpu" and options.quantize == "none"
             and not options.needs and importlib.util.find_spec("llama_cpp") is not None)
    return "llamacpp" if llama else "transformers"


def load_model(path: str | os.PathLike | None = None, options: LoadOptions = LoadOptions()) -> LoadedModel:
    """Load a model folder, a .gguf file, or the embedded default (`path` None), ready for generation, on the
    backend `options.backend` names (`auto`: `resolve_backend`): `models.loading.load_transformers_model` or
    `models.llamacpp.load_gguf_model`."""
    if resolve_backend(options, path) == "llamacpp":
        return load_gguf_model(path, options)
    return load_transformers_model(path, options)

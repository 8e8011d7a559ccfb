"""Finding memories by meaning: the key encoder (sentence-transformers) over the memories' texts.

A bank keyed by this encoder's text embeddings is searched through its own keys; any other bank
(one hidden-state vector a memory) by encoding its stored texts, cached by text. A memory without
text cannot be found this way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from models.text_keys import TextEncoder


class TextSearch:
    """Cosine search of a query text against a bank's memories, by their texts."""

    def __init__(self, encoder: TextEncoder | None = None):
        self.encoder = encoder or TextEncoder()

    def search(self, db: Any, query: str, top_k: int = 5) -> list[dict[str, Any]]:
        """Best `top_k` memories of `db` for `query`: [{"index", "score", "text"}], best first."""
        query = query.strip()
        if not query:
            raise ValueError("type some words to search for")
        if top_k < 1:
            raise ValueError(f"top_k is {top_k}: must be >= 1")
        if db is not None and db.has_values and db.info.get("keys") == self.encoder.name:
            hits = db.search(self.encoder.encode([query])[0], top_k)
            return [{"index": h["index"], "score": h["score"], "text": h.get("text") or ""} for h in hits]
        labelled = [e for e in db.entries(0, len(db)) if e["text"]] if db is not None else []
        if not labelled:
            raise ValueError("the bank has no memory texts to search (memories written from text keep theirs)")
        vecs = self.encoder.encode([query] + [e["text"] for e in labelled])
        scores = vecs[1:] @ vecs[0]  # [N]
        order = np.argsort(-scores, kind="stable")[:top_k]
        return [{"index": labelled[i]["index"], "score": float(scores[i]), "text": labelled[i]["text"]} for i in order]

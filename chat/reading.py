"""What the memory head reads for a message: the loop's `Recall` context (`recall_context`) and the memories of a
bank it may read (`readable`: none under `min_score`; for a question about its author, only those the fit check
admits, `models.fits`)."""

from __future__ import annotations

import torch

from chat.naming import speaks_of_another
from decoding.engine import Recall
from decoding.settings import RecallSettings
from memory.personal import Only
from models import LoadedModel
from models.remember import mentions_the_user

FIT_DEPTH = 8  # memories a question about its author is checked against (`readable`)


def recall_context(lm: LoadedModel, memory_db, settings: RecallSettings, text: str = "") -> Recall:
    """The loop's recall context: this model's tokens, the bank, its memory embedding and, for a bank keyed by
    text embeddings, the query (the key encoder's embedding of `text`, the user's message) and the token that
    closes a memory (`</recall>` for a model trained to read memories between the two)."""
    tokens, encoder = lm.tokens, lm.encoder
    query, suffix = None, ()
    close = lm.tokenizer.convert_tokens_to_ids(encoder.close) if encoder.close is not None else None
    if memory_db is not None and memory_db.has_values:
        if encoder.keys is None:
            raise ValueError(f"this bank's keys are text embeddings ({memory_db.info.get('keys')}) but {lm.name} "
                             "writes one hidden-state vector a memory (memory.values: state): use a bank it wrote")
        vector = encoder.message_query(text)
        query = lambda hidden: vector  # noqa: E731 - the message, not the <recall> state, is the query
        memory_db = readable(lm, memory_db, vector, settings, text)
        if close is not None:
            suffix = (close,)
    embedding = encoder.embedding_for(memory_db) if memory_db is not None else None
    # with no memory to read, the model answers from what it knows: never a bare <recall> (`NoMemory`); a <recall>
    # whose search finds none at min_score (a bank keyed by states: known only then) reads an empty memory (`close`)
    return Recall(tokens.recall, tokens.memory_pad, memory_db, settings, embedding, query, suffix,
                  without_memory="answer", close=close).with_tokens(lm.model.get_input_embeddings())


def readable(lm: LoadedModel, memory_db, vector: torch.Tensor, settings: RecallSettings, text: str):
    """What the memory head may read for a message: None when no memory scores `min_score` (the model answers from
    what it knows: `NoMemory`); for a message about its author with `fit_check` on, only the memories among the
    best `FIT_DEPTH` that the fit check admits (`models.fits`) and that are about what it asks of
    (`chat.naming.speaks_of_another`); none admitted: None."""
    if not len(memory_db):
        return memory_db
    scores, ids = memory_db.topk(vector, FIT_DEPTH)
    fits = scores >= settings.min_score
    check = lm.encoder.fit_check if settings.fit_check and mentions_the_user(text) else None
    if check is not None and fits.any():
        keys = torch.nn.functional.normalize(torch.stack([memory_db.vector(int(i)) for i in ids[fits]]), dim=-1)
        fits[fits.clone()] = check.admits(vector.reshape(1, -1).expand_as(keys), keys)
        fits &= torch.tensor([not (f and speaks_of_another(text, memory_db.text(int(i)) or ""))
                              for f, i in zip(fits.tolist(), ids)], dtype=torch.bool)
    if not fits.any():
        return None
    return Only(memory_db, (scores[fits], ids[fits]), FIT_DEPTH) if check is not None else memory_db

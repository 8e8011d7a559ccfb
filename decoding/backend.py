"""The seam between the engine and a model: `Backend`, everything the loop asks of a model.

Two implementations: transformers (`decoding.forward.Forward`: eager, the compiled step, the batch's
`StaticCache`) and llama.cpp (`decoding.llamacpp.LlamaForward`, on `models.llamacpp.LlamaCppModel`).
`backend_for` is the one place that tells them apart. A backend's `spec` (`models.spec.ModelSpec`) says
what the model is and what it can run; `NEEDS` says which request needs which capability, and `require`
makes every refusal from it, naming the setting to change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from decoding.forward import Forward
from decoding.llamacpp import LlamaForward
from models.llamacpp import LlamaCppModel
from models.spec import GUIDANCE, LAYERS, MIXTURE, ROWS, ModelSpec


class Backend(Protocol):
    """What the loop asks of a model. Every input is an embedding, so a memory's value vectors and a token's
    own embedding are the same kind of input; positions are explicit."""

    spec: ModelSpec
    model: nn.Module
    embed: nn.Module  # token ids [..] -> input embeddings [.., H]
    device: torch.device
    dtype: torch.dtype

    def positions(self, inputs: Mapping[str, torch.Tensor], input_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Position ids of the whole prompt, as `generate` builds them ([B, L], or [4, B, L] for mRoPE)."""

    def cache_for(self, cache: Any, needed: int, plain: bool) -> Any:
        """The KV cache a request of `needed` positions runs on: `cache` (an earlier turn's, grown to hold them),
        or a new one (`plain`: an unpadded row decoding from the final layer)."""

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None,
                vision: Mapping[str, torch.Tensor], layers: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run prompt embeddings [B, S, H]: (the last position's state [B, H] (`layers`: every layer's, [B, L, H]),
        its logits [B, V] or None when `logits(state)` computes them)."""

    def step(self, embeds: torch.Tensor, position: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None,
             layers: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A decode step's new positions [B, W, H] (W = 1, or a memory's slots): as `prefill`."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [B, V] of final states [B, H]."""

    def joins_batch(self, cache: Any) -> bool:
        """Whether a request on `cache` may decode with other requests (`decoding.batch.Batch`)."""

    def run_round(self, steps: Sequence[Any], batch: Any) -> None:
        """Run a round of requests' decode steps (`decoding.batch.Step`) together, filling their outputs."""

    def reset_request_state(self) -> None:
        """Forget per-request state the model keeps between forwards (Qwen3-VL's rope deltas)."""


# Which request needs which capability, in the words a refusal uses.
NEEDS = {
    ROWS: "a batch of rows in one request (send them as requests: they decode together)",
    LAYERS: "entropy_decoding (every layer's state)",
    GUIDANCE: "guidance_scale (a second forward of the model)",
    MIXTURE: "generation.mixture (two transformers models; its draft may be llama.cpp)",
}


class Unsupported(ValueError):
    """A request asks for what this model or backend does not run: the requester's to change (a refusal, not a
    failure of the work)."""


def require(spec: ModelSpec, capability: str) -> None:
    """Refuse, naming what was asked and the setting to change, when the backend cannot run it."""
    if not spec.can(capability):
        raise Unsupported(f"the {spec.backend} backend does not run {NEEDS[capability]}: set model.backend: "
                         "transformers")


def backend_for(model: nn.Module, want_state: bool = False) -> Backend:
    """The backend that runs `model`. `want_state`: the caller reads the final state (the memory head's query of
    a bank keyed by hidden states); transformers always gives it, llama.cpp reads it only then."""
    return LlamaForward(model, want_state) if isinstance(model, LlamaCppModel) else Forward(model)

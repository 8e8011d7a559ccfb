"""A model's hidden states as memory vectors: which one (`HiddenStateSpec`), read up to its layer only
(`hidden_state`), pooled over a text's tokens (`pool`), for right-padded batches of texts (`right_pad`).
The memory encoder (models/encoder.py) builds on them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from models.modeling import decoder_layers

POOLINGS = ("last", "mean")


@dataclass(frozen=True)
class HiddenStateSpec:
    """Which hidden state becomes the memory vector.

    layer: index into `output_hidden_states` (0 = embeddings, -1 = final layer, which HF models
    return after the final norm). pooling: "last" = last non-pad token, "mean" = mean over the
    non-pad tokens after the first. The first token is left out because in the middle layers of
    most LLMs it is an attention sink with massive activations (SmolLM2 layer 12: norm ~25,000 vs
    ~150 for the others) that would drown every other token in the mean.
    """

    layer: int = -1
    pooling: str = "last"

    def __post_init__(self) -> None:
        if not isinstance(self.layer, int) or isinstance(self.layer, bool):
            raise ValueError(f"layer must be an integer index into the hidden states, got {self.layer!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")

    def as_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "pooling": self.pooling}


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """Pool hidden [B, S, H] over the positions where mask [B, S] is 1 -> [B, H]. Any padding side."""
    mask = mask.to(hidden.device)
    if not bool(mask.any(dim=1).all()):
        raise ValueError("attention_mask: expected at least one real token per row, got a row of padding only")
    if pooling == "last":
        positions = torch.arange(mask.shape[1], device=mask.device)  # [S]
        last = (mask.long() * positions).argmax(dim=1)  # [B] last position whose mask is 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    if pooling == "mean":
        mask = mask.clone()
        rows = torch.arange(mask.shape[0], device=mask.device)
        first = mask.long().argmax(dim=1)  # [B] first real token
        mask[rows, first] = torch.where(mask.sum(dim=1) > 1, 0, mask[rows, first])  # keep a lone token
        m = mask.to(hidden.dtype).unsqueeze(-1)  # [B, S, 1]
        return (hidden * m).sum(dim=1) / m.sum(dim=1)
    raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")


def right_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Token id lists -> right-padded input_ids and attention_mask [B, S].

    Right padding leaves a causal model's real tokens exactly as if each row ran alone.
    """
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}


class _Enough(Exception):
    """Raised by a forward hook once the wanted layer has run: the layers above are not needed."""


def hidden_state(model: nn.Module, inputs: dict[str, Any], layer: int) -> torch.Tensor:
    """`output_hidden_states[layer]` of the model on prepared inputs, [B, S, H], with autograd.

    An earlier layer stops the forward right after it (the layers above would be wasted work;
    layer 0, the embeddings, right before the first layer); the final layer (-1 or L) is the
    model's normalised `last_hidden_state`.
    """
    layers = decoder_layers(model)
    count = len(layers) + 1  # embeddings + one per layer
    if not -count <= layer < count:
        raise ValueError(f"layer {layer}: expected an index in [-{count}, {count - 1}] "
                         f"(the model gives {count} hidden states: embeddings + {count - 1} layers)")
    layer %= count
    kwargs = dict(inputs)
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs.setdefault("logits_to_keep", 1)  # only hidden states are wanted: skip most of lm_head
    if layer == count - 1:
        return model(**kwargs, output_hidden_states=True, use_cache=False, return_dict=True).hidden_states[-1]
    caught: list[torch.Tensor] = []

    def stop(_module, _args, output):
        caught.append(output[0] if isinstance(output, tuple) else output)
        raise _Enough

    def stop_before(_module, args, kwargs):  # layer 0: the input of the first layer (embeddings, scaled as the model does)
        caught.append(args[0] if args else kwargs["hidden_states"])
        raise _Enough

    handle = (layers[0].register_forward_pre_hook(stop_before, with_kwargs=True) if layer == 0
              else layers[layer - 1].register_forward_hook(stop))
    try:
        model(**kwargs, use_cache=False, return_dict=True)
    except _Enough:
        pass
    finally:
        handle.remove()
    return caught[0]

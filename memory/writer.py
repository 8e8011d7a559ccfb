"""Turning texts into memory vectors: hidden states of a loaded HF model, pooled per text.

Texts are encoded as plain text (tokenizer special tokens, no chat template): a memory is a
piece of content, not a chat turn, and the same text always gives the same vector whatever
conversation it came from. Queries encoded for an offline search use the same path.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from memory.bank import MemoryVectorDB

POOLINGS = ("last", "mean")


@dataclass(frozen=True)
class HiddenStateSpec:
    """Which hidden state becomes the memory vector.

    layer: index into `output_hidden_states` (0 = embeddings, -1 = final layer, which HF models
    return after the final norm). pooling: "last" = last non-pad token, "mean" = mean over non-pad tokens.
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
        m = mask.to(hidden.dtype).unsqueeze(-1)  # [B, S, 1]
        return (hidden * m).sum(dim=1) / m.sum(dim=1)
    raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")


def encode_inputs(
    model: torch.nn.Module, inputs: dict[str, Any], spec: HiddenStateSpec = HiddenStateSpec()
) -> torch.Tensor:
    """Run the model on prepared inputs (input_ids, attention_mask, pixel_values, ...) -> float32 CPU [B, H].

    With left padding and no explicit `position_ids`, positions are counted from each row's first
    real token (as `generate` does), so a padded row encodes like the row alone. Inputs carrying
    an image/video grid keep the model's own (mRoPE) positions, which already follow the mask.
    """
    kwargs = dict(inputs)
    ref = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if ref is None:
        raise ValueError(f"inputs: expected 'input_ids' or 'inputs_embeds', got keys {sorted(kwargs)}")
    mask = kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones(ref.shape[:2], dtype=torch.long)
        kwargs["attention_mask"] = mask
    multimodal = kwargs.get("image_grid_thw") is not None or kwargs.get("video_grid_thw") is not None
    if "position_ids" not in kwargs and not multimodal and bool((mask[:, 0] == 0).any()):
        kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, S]
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs.setdefault("logits_to_keep", 1)  # only hidden states are wanted: skip most of lm_head
    device = next(model.parameters()).device
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    stateful = [m for m in model.modules() if hasattr(m, "rope_deltas")]  # Qwen3-VL's per-request mRoPE state
    try:
        for m in stateful:
            m.rope_deltas = None
        with torch.no_grad():
            out = model(**kwargs, output_hidden_states=True, use_cache=False, return_dict=True)
    finally:
        for m in stateful:
            m.rope_deltas = None
    states = out.hidden_states
    if not -len(states) <= spec.layer < len(states):
        raise ValueError(f"layer {spec.layer}: expected an index in [-{len(states)}, {len(states) - 1}] "
                         f"(the model gives {len(states)} hidden states: embeddings + {len(states) - 1} layers)")
    return pool(states[spec.layer].float(), mask, spec.pooling).cpu()  # [B, H]


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


def encode_texts(
    model: torch.nn.Module, tokenizer: Any, texts: Sequence[str], spec: HiddenStateSpec = HiddenStateSpec(),
    batch_size: int = 8, progress: bool = True,
) -> torch.Tensor:
    """Encode texts as plain text in length-sorted, right-padded batches -> float32 CPU [N, H].

    The tokenizer is not modified: padding is done here, with its pad id (or EOS, or 0 when it has
    neither; the value never matters since pads are masked and come after the real tokens).
    """
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts: expected a list of strings")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ids = tokenizer(list(texts), add_special_tokens=True)["input_ids"]
    empty = [i for i, s in enumerate(ids) if not s]
    if empty:
        raise ValueError(f"texts: expected each text to give at least one token, got none for rows {empty[:5]}")
    pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: torch.Tensor | None = None
    with tqdm(total=len(ids), desc="encoding memories", unit="text", disable=not progress) as bar:
        for s in range(0, len(order), batch_size):
            rows = order[s:s + batch_size]
            vecs = encode_inputs(model, right_pad([ids[i] for i in rows], pad_id), spec)  # [b, H]
            if out is None:
                out = torch.empty(len(ids), vecs.shape[1], dtype=torch.float32)
            out[rows] = vecs
            bar.update(len(rows))
    if out is None:
        raise ValueError("texts: expected at least one text, got none")
    return out


def build_bank(model: torch.nn.Module, tokenizer: Any, texts: Sequence[str], spec: HiddenStateSpec = HiddenStateSpec(),
               index: str = "flat", metadata: Sequence[dict | None] | None = None, *, batch_size: int = 8,
               progress: bool = True) -> MemoryVectorDB:
    """Encode texts and put them, with their texts and metadata, into a new bank."""
    vectors = encode_texts(model, tokenizer, texts, spec, batch_size=batch_size, progress=progress)
    db = MemoryVectorDB(vectors.shape[1], index)
    db.add(vectors, list(texts), metadata)
    db.info = {**spec.as_dict(), "encoding": "plain text"}
    return db

"""The memory encoder: which hidden state of a text becomes its memory vector.

A memory vector is a hidden state of the model itself, pooled over the memory's tokens
(`HiddenStateSpec`: layer and pooling); it is what a bank stores and what the memory head scores.
A model trained to recall adds a small `MemoryProjector` (xRAG style) as its memory embedding: it
maps the chosen vector into the model's input-embedding space, where it is injected at
`<|memory_pad|>`. Without a projector the vector is injected as it is. The same `MemoryEncoder`
writes banks and is trained with the adapter, and its `name` is stamped into every bank it writes,
so a bank from another encoder is refused instead of being recalled from silently wrong vectors.

Texts are encoded as plain text (no chat template): a memory is a piece of content, not a chat
turn, and the same text always gives the same vector whatever conversation it came from.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from memory import MemoryVectorDB
from models.modeling import decoder_layers

POOLINGS = ("last", "mean")
ENCODER_CONFIG = "memory_encoder.json"
PROJECTOR_WEIGHTS = "memory_projector.safetensors"


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


class MemoryProjector(nn.Module):
    """Pooled hidden state [B, H] -> input embedding [B, H]: a residual MLP on the RMS-normalised state.

    `gain * (x̂ + down(gelu(up(x̂))))` with `down` zero-initialised, so a new projector passes the
    pooled state's direction through at the scale of the model's token embeddings (`gain`
    starts at their mean norm / sqrt(H)): reading starts from what the state already says.
    """

    def __init__(self, hidden: int, inner: int, embedding_norm: float = 1.0):
        super().__init__()
        self.hidden, self.inner = hidden, inner
        self.norm = nn.RMSNorm(hidden, eps=1e-6, elementwise_affine=False)
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)
        self.gain = nn.Parameter(torch.tensor(embedding_norm / hidden ** 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.gain * (x + self.down(nn.functional.gelu(self.up(x))))


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


class MemoryEncoder:
    """Texts or prepared inputs -> memory vectors [B, H], as stored in a bank and scored by the memory head.

    `center` and `scale` ([H], optional) standardise the pooled state per dimension. A trained
    encoder sets them from its training facts: middle-layer states share a few huge dimensions
    (SmolLM2 layer 10: dimensions 507 and 247 hold most of every token's norm), so raw vectors of
    different texts have cosine ~0.9 and the memory head could hardly tell them apart.
    """

    def __init__(self, spec: HiddenStateSpec = HiddenStateSpec(), projector: MemoryProjector | None = None,
                 name: str = "plain", center: torch.Tensor | None = None, scale: torch.Tensor | None = None):
        self.spec, self.projector, self.name = spec, projector, name
        self.center, self.scale = center, scale

    @property
    def trained(self) -> bool:
        return self.projector is not None

    def describe(self) -> dict[str, Any]:
        """What a bank records about the encoder that wrote it."""
        out = {"encoder": self.name, **self.spec.as_dict()}
        if self.projector is not None:
            out["projector"] = [self.projector.hidden, self.projector.inner]
        return out

    def __call__(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """Memory vectors [B, H] of prepared inputs (input_ids, attention_mask, vision inputs), differentiable.

        With left padding and no explicit `position_ids`, positions are counted from each row's
        first real token (as `generate` does), so a padded row encodes like the row alone. Inputs
        carrying an image grid keep the model's own (mRoPE) positions, which follow the mask.
        """
        kwargs = dict(inputs)
        ref = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if ref is None:
            raise ValueError(f"inputs: expected 'input_ids' or 'inputs_embeds', got keys {sorted(kwargs)}")
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = kwargs["attention_mask"] = torch.ones(ref.shape[:2], dtype=torch.long)
        multimodal = kwargs.get("image_grid_thw") is not None or kwargs.get("video_grid_thw") is not None
        if "position_ids" not in kwargs and not multimodal and bool((mask[:, 0] == 0).any()):
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, S]
        device = next(model.parameters()).device
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        stateful = [m for m in model.modules() if hasattr(m, "rope_deltas")]  # Qwen3-VL's per-request mRoPE state
        try:
            for m in stateful:
                m.rope_deltas = None
            states = hidden_state(model, kwargs, self.spec.layer)  # [B, S, H]
        finally:
            for m in stateful:
                m.rope_deltas = None
        pooled = pool(states.float(), mask, self.spec.pooling)  # [B, H]
        if self.center is not None:
            pooled = (pooled - self.center.to(pooled.device)) / self.scale.to(pooled.device)
        return pooled

    def embedding(self, vectors: torch.Tensor) -> torch.Tensor:
        """The memory embedding: memory vectors [N, H] as input embeddings (the projector, if any)."""
        if self.projector is None:
            return vectors
        return self.projector.to(vectors.device)(vectors.float())

    @torch.no_grad()
    def encode_texts(self, model: nn.Module, tokenizer: Any, texts: Sequence[str], batch_size: int = 8,
                     progress: bool = True) -> torch.Tensor:
        """Encode texts as plain text in length-sorted, right-padded batches -> float32 CPU [N, H].

        The tokenizer is not modified: padding is done here, with its pad id (or EOS, or 0 when it
        has neither; the value never matters since pads are masked and come after the real tokens).
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
                vecs = self(model, right_pad([ids[i] for i in rows], pad_id)).float().cpu()  # [b, H]
                if out is None:
                    out = torch.empty(len(ids), vecs.shape[1], dtype=torch.float32)
                out[rows] = vecs
                bar.update(len(rows))
        if out is None:
            raise ValueError("texts: expected at least one text, got none")
        return out

    # ----------------------------------------------------------------- files

    def save(self, folder: str | Path) -> None:
        """Write `memory_encoder.json` (and the projector's safetensors) into `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {"name": self.name, **self.spec.as_dict()}
        tensors = {}
        if self.projector is not None:
            config["projector"] = {"hidden": self.projector.hidden, "inner": self.projector.inner}
            tensors.update(self.projector.state_dict())
        if self.center is not None:
            tensors.update({"standardize.center": self.center, "standardize.scale": self.scale})
        if tensors:
            save_file({k: v.detach().float().cpu().contiguous() for k, v in tensors.items()},
                      str(folder / PROJECTOR_WEIGHTS))
        (folder / ENCODER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path, hidden_size: int) -> MemoryEncoder:
        """The encoder saved in `folder` by `save`; a clear error when it does not fit the model."""
        folder = Path(folder)
        try:
            config = json.loads((folder / ENCODER_CONFIG).read_text())
            spec = HiddenStateSpec(config["layer"], config["pooling"])
            weights = load_file(str(folder / PROJECTOR_WEIGHTS)) if (folder / PROJECTOR_WEIGHTS).exists() else {}
            center, scale = weights.pop("standardize.center", None), weights.pop("standardize.scale", None)
            projector = None
            if "projector" in config:
                hidden, inner = config["projector"]["hidden"], config["projector"]["inner"]
                if hidden != hidden_size:
                    raise ValueError(f"its projector is for hidden size {hidden}, the model has {hidden_size}")
                projector = MemoryProjector(hidden, inner)
                projector.load_state_dict(weights)
                projector.eval().requires_grad_(False)
            return cls(spec, projector, str(config["name"]), center, scale)
        except (OSError, KeyError, TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{folder}: not a usable memory encoder ({e})") from None


def build_bank(model: nn.Module, tokenizer: Any, texts: Sequence[str], encoder: MemoryEncoder | None = None,
               index: str = "flat", metadata: Sequence[dict | None] | None = None, *, batch_size: int = 8,
               progress: bool = True) -> MemoryVectorDB:
    """Encode texts and put them, with their texts and metadata, into a new bank stamped with the encoder."""
    encoder = encoder or MemoryEncoder()
    vectors = encoder.encode_texts(model, tokenizer, texts, batch_size=batch_size, progress=progress)
    db = MemoryVectorDB(vectors.shape[1], index)
    db.add(vectors, list(texts), metadata)
    db.info = encoder.describe()
    return db

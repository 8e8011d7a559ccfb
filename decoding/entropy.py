"""Entropy-based intermediate-layer decoding (seed 002): decode each step from the layer whose
next-token distribution has the least entropy (`trough`), or from a layer drawn uniformly between
that one and the last (`random_after`, per row and per step).

Every decoder layer i = 0..L-1 (the embedding output is not a layer) proposes a distribution for
the next token: its last-position hidden state through the model's final norm (the last layer's
state comes from the backbone already normed, so it is not normed twice), the shared output head
with the model's own final logit processing (`head_logits`: Gemma soft-capping, ...), then the
request's logits processors. All layers go through the head as ONE matrix product
([B*L, H] @ W^T) and through the processors as ONE [B*L, V] batch (each row's input ids repeated
per layer), so a stateful processor still sees each step once. A token a processor masked (-inf)
counts 0 * log 0 = 0.

Units: the layer is chosen from entropies in nats, as before; the records (`LayerEvent`,
`EntropyTrace`, the seed API, the page's plot) carry them in seed 002's unit, normalised by the
vocabulary in bits: H / log2 V (the same ratio as nats / ln V), 0 for a one-hot distribution and 1 for
uniform over all V tokens. Dividing every layer by the same positive log V cannot move the least, and
choosing before dividing keeps the choice bit for bit what nats choose (no rounding tie).

The selected layer's processed scores then go to the usual sampling / greedy choice. The loop
keeps the final layer's state for the memory head's query at `<recall>` and still forces
`<|memory_pad|>` after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LogitsProcessorList
from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

from decoding.events import EntropyTrace, Event, LayerEvent, TokenEvent
from decoding.settings import ENTROPY_MODES
from models.modeling import backbone_and_head, decoder_layers, final_norm, head_logits

# ---- pure tensor functions ----------------------------------------------------------------------


def layer_logits(model: nn.Module, head: nn.Module, norm: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """Float32 logits [B, L, V] of every layer's state [B, L, H] (the last one already normed): one head product."""
    batch, layers, size = states.shape
    normed = torch.cat([norm(states[:, :-1]), states[:, -1:]], dim=1)  # [B, L, H]
    return head_logits(model, head, normed.reshape(batch * layers, size)).view(batch, layers, -1)  # [B, L, V]


def repeat_rows(x: torch.Tensor | None, layers: int) -> torch.Tensor | None:
    """Each row of x [B, ...] repeated `layers` times in a row: [B*L, ...] (row b*L + i is layer i of row b)."""
    return None if x is None else x.repeat_interleave(layers, dim=0)


def process_layers(processors: LogitsProcessorList | None, input_ids: torch.Tensor,
                   logits: torch.Tensor) -> torch.Tensor:
    """Processed scores [B, L, V] of raw logits [B, L, V]: the processors run once, on [B*L, V]."""
    if not processors:
        return logits
    batch, layers, vocab = logits.shape
    scores = processors(repeat_rows(input_ids, layers), logits.reshape(batch * layers, vocab))  # [B*L, V]
    return scores.view(batch, layers, vocab)


def masked_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(scores) over the last axis: [..., V] -> [...]; -inf tokens count 0."""
    logp = torch.log_softmax(scores.float(), dim=-1)
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(dim=-1)


def normalised_bits(nats: torch.Tensor, vocab: int) -> torch.Tensor:
    """Entropies in nats as seed 002's unit: bits over log2 `vocab`, 0 (one-hot) to 1 (uniform); same shape."""
    return nats / math.log(vocab)


def trough_layers(entropies: torch.Tensor) -> torch.Tensor:
    """The layer of least entropy of each row, [B, L] -> [B]; the deepest on ties (a one-token truncation, top_k=1,
    makes every layer one-hot: the model's own last layer then, where the first decoded "\n\n\n..."), NaN never
    chosen."""
    last = entropies.shape[-1] - 1
    return last - torch.argmin(torch.nan_to_num(entropies, nan=float("inf")).flip(-1), dim=-1)


def random_after_layers(trough: torch.Tensor, num_layers: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A layer drawn uniformly from trough..L-1 for each row: [B] -> [B] (torch's global RNG by default)."""
    span = num_layers - trough  # [B], >= 1
    u = torch.rand(trough.shape, device=trough.device, generator=generator)  # [B] in [0, 1)
    return trough + torch.minimum((u * span).long(), span - 1)


def select_layers(entropies: torch.Tensor, mode: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """The layer each row decodes from, [B, L] entropies -> [B]."""
    trough = trough_layers(entropies)
    if mode == "trough":
        return trough
    if mode == "random_after":
        return random_after_layers(trough, entropies.shape[-1], generator)
    raise ValueError(f"entropy_decoding is {mode!r}: must be one of {', '.join(map(repr, ENTROPY_MODES))}")


# ---- one step, and the request's record --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EntropyStep:
    """One step of entropy decoding, on the device."""

    layers: torch.Tensor  # [B] the selected layer of each row
    normalised_entropies: torch.Tensor  # [B, L] each layer's processed distribution's entropy, H / log2 V (0..1)
    layer_token_ids: torch.Tensor | None  # [B, L] argmax of each layer's raw logits (entropy_record_tokens)
    logits: torch.Tensor  # [B, V] the selected layer's raw logits
    scores: torch.Tensor  # [B, V] the selected layer's processed scores: what sampling / greedy reads


class EntropyDecoder:
    """Entropy decoding for one request: each step's layer choice, the stream's LayerEvents, the trace."""

    def __init__(self, model: nn.Module, mode: str, record_tokens: bool = False,
                 generator: torch.Generator | None = None):
        if mode not in ENTROPY_MODES:
            raise ValueError(f"entropy_decoding is {mode!r}: must be one of {', '.join(map(repr, ENTROPY_MODES))}")
        self.model, self.mode, self.record_tokens, self.generator = model, mode, record_tokens, generator
        self.head = backbone_and_head(model)[1]
        self.norm = final_norm(model)
        self.num_layers = len(decoder_layers(model))
        self._kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._pending: dict[tuple[int, int], LayerEvent] = {}  # (row, position) -> event awaiting its token
        self._positions: list[list[int]] = []  # per step, each row's first new position (a memory span's first slot)

    @staticmethod
    def check(processors: LogitsProcessorList | None) -> None:
        """Refuse a processor that cannot score one row per layer (classifier-free guidance)."""
        if any(isinstance(p, UnbatchedClassifierFreeGuidanceLogitsProcessor) for p in processors or ()):
            raise ValueError("entropy decoding cannot run with classifier-free guidance: its processor runs its own "
                             "forward with a cache over the batch and cannot score one row per layer; set "
                             "guidance_scale=1.0 or entropy_decoding=None")

    def step(self, states: torch.Tensor, input_ids: torch.Tensor,
             processors: LogitsProcessorList | None) -> EntropyStep:
        """Choose this step's layers from every layer's last-position state [B, L, H] and the ids so far [B, T]."""
        if states.dim() != 3 or states.shape[1] != self.num_layers:
            raise ValueError(f"entropy decoding needs the states of all {self.num_layers} decoder layers [B, L, H], "
                             f"got shape {tuple(states.shape)}")
        logits = layer_logits(self.model, self.head, self.norm, states)  # [B, L, V]
        tokens = logits.argmax(dim=-1) if self.record_tokens else None  # [B, L], before any processor
        scores = process_layers(processors, input_ids, logits)  # [B, L, V]
        nats = masked_entropy(scores)  # [B, L]
        layers = select_layers(nats, self.mode, self.generator)  # [B], chosen from nats: see the module's "Units"
        entropies = normalised_bits(nats, scores.shape[-1])  # [B, L], the seed's unit for the records
        rows = torch.arange(states.shape[0], device=layers.device)
        self._kept.append((layers, entropies, tokens))
        return EntropyStep(layers, entropies, tokens, logits[rows, layers], scores[rows, layers])

    def annotate(self, events: list[Event], step: EntropyStep, alive: list[bool], positions: list[int]) -> list[Event]:
        """`events` with a LayerEvent right after each TokenEvent (a held `<recall>` token's comes with it).

        `alive` are the rows still running before this step; `positions[row]` is where the row's token of this
        step went (a recall's span: its first slot, the position the sampled token was replaced at).
        """
        layers, entropies = step.layers.tolist(), step.normalised_entropies.tolist()
        tokens = step.layer_token_ids.tolist() if step.layer_token_ids is not None else None
        self._positions.append(list(positions))
        for row in (r for r, on in enumerate(alive) if on):
            position = positions[row]
            self._pending[(row, position)] = LayerEvent(row, position, layers[row], tuple(entropies[row]),
                                                        tuple(tokens[row]) if tokens is not None else None)
        out: list[Event] = []
        for event in events:
            out.append(event)
            if isinstance(event, TokenEvent) and (event.row, event.position) in self._pending:
                out.append(self._pending.pop((event.row, event.position)))
        return out

    def trace(self, sequences: torch.Tensor) -> EntropyTrace:
        """The per-step record for the result: one entry per decode step (a recall's span is one step, its
        token the first slot), for the steps whose tokens are in `sequences` [B, T]."""
        steps = sum(1 for p in self._positions if max(p) < sequences.shape[1])  # a dropped <recall> left no position
        kept = self._kept[:steps]
        batch, layers, device = sequences.shape[0], self.num_layers, sequences.device
        if not kept:
            empty = torch.empty(batch, 0, dtype=torch.long, device=device)
            return EntropyTrace(self.mode, empty, torch.empty(batch, 0, layers, device=device),
                                torch.empty(batch, 0, layers, dtype=torch.long, device=device)
                                if self.record_tokens else None, empty if self.record_tokens else None)
        chosen, entropies, tokens = zip(*kept)
        return EntropyTrace(
            self.mode, torch.stack(chosen, dim=1), torch.stack(entropies, dim=1),
            torch.stack(tokens, dim=1) if self.record_tokens else None,
            sequences.gather(1, torch.tensor(self._positions[:steps], device=device).T) if self.record_tokens else None)

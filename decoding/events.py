"""What the generation loop reports: small events while it runs, a result at the end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

FinishReason = Literal["stop", "length", "interrupted", "tool_call"]


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token of one row, with the text it adds (may be "" while a character is incomplete)."""

    row: int
    token_id: int
    position: int  # index of the token in the row's sequence
    text: str


@dataclass(frozen=True, slots=True)
class RecallEvent:
    """One memory injection: the `length` `<|memory_pad|>` slots from `position` on carry memory `memory_index`."""

    row: int
    position: int  # the first slot
    score: float  # cosine similarity of the query and the memory's key
    memory_index: int
    text: str | None = None  # the memory's text, when the bank has one
    length: int = 1  # value slots, injected in order at consecutive positions
    source: str | None = None  # the bank it came from, when several are searched as one ("yours", the shared one)


@dataclass(frozen=True, slots=True)
class PrefillEvent:
    """Prefill progress between chunks of a long prompt: `done` of `total` prompt tokens are in the cache."""

    done: int
    total: int


@dataclass(frozen=True, slots=True)
class FinishEvent:
    row: int
    reason: FinishReason


@dataclass(frozen=True, slots=True)
class LayerEvent:
    """Entropy decoding (seed 002): the layer the token at `position` of `row` was decoded from.

    Streamed right after that token's TokenEvent. Layers count 0 (first decoder layer) to L-1 (last);
    `normalised_entropies[i]` is layer i's entropy over its processed next-token distribution in seed
    002's unit, H / log2 V (0 one-hot, 1 uniform over the vocabulary), and
    `layer_token_ids[i]` the argmax of layer i's raw logits (with `entropy_record_tokens`, else None).
    At a `<|memory_pad|>` position the token was forced by the recall, whatever the layer.
    """

    row: int
    position: int
    layer: int
    normalised_entropies: tuple[float, ...]
    layer_token_ids: tuple[int, ...] | None = None


@dataclass
class EntropyTrace:
    """Entropy decoding's record over the generated positions (seed 002's outputs, stacked over steps).

    Every row has a value at every step, also after it finished (its token is then padding).
    """

    mode: str  # "trough" | "random_after"
    selected_layer_indices: torch.LongTensor  # [B, steps] the layer each step decoded from, 0..L-1
    normalised_entropies: torch.Tensor  # [B, steps, L] each layer's processed distribution's entropy, H / log2 V
    per_layer_token_ids: torch.LongTensor | None = None  # [B, steps, L] argmax of each layer's raw logits
    selected_token_ids: torch.LongTensor | None = None  # [B, steps] the tokens written (= the new tokens)

    @property
    def num_layers(self) -> int:
        return self.normalised_entropies.shape[-1]


@dataclass
class GenerationResult:
    sequences: torch.LongTensor  # [B, L]: prompt and generated tokens
    prompt_length: int
    finish_reasons: list[FinishReason]
    injections: list[RecallEvent]
    # Every <|memory_pad|> position of each row (earlier turns' too) -> the value vector fed there.
    memory_vectors: list[dict[int, torch.Tensor]]
    cache: Any = None  # KV cache over a prefix of sequences: all but the last token, unless stopped in prefill
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    logits: torch.Tensor | None = None  # [B, steps, V] raw logits (the selected layer's), with output_logits=True
    entropy: EntropyTrace | None = None  # with settings.entropy_decoding
    attention_mask: torch.Tensor | None = None  # [B, L] for a padded batch (also where another row's memory span
                                                # gave a row masked columns); None: every position is real
    # Per row, with recall off in `Recall.without_memory: answer` mode: the model's first choice was <recall> at
    # some step (it answered without the memory it asked for); also a recall that found no memory at min_score
    # (`Recall.close`: an empty memory was read). None when neither could happen.
    missed_recall: list[bool] | None = None

    @property
    def new_tokens(self) -> torch.LongTensor:
        return self.sequences[:, self.prompt_length:]


@dataclass(frozen=True, slots=True)
class DoneEvent:
    """The last event of a stream."""

    result: GenerationResult


Event = TokenEvent | RecallEvent | PrefillEvent | FinishEvent | LayerEvent | DoneEvent

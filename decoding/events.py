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
    """One memory injection: `<|memory_pad|>` at `position` carries memory `memory_index`."""

    row: int
    position: int
    score: float  # cosine similarity of the <recall> hidden state and the memory
    memory_index: int
    text: str | None = None  # the memory's text, when the bank has one


@dataclass(frozen=True, slots=True)
class FinishEvent:
    row: int
    reason: FinishReason


@dataclass
class GenerationResult:
    sequences: torch.LongTensor  # [B, L]: prompt and generated tokens
    prompt_length: int
    finish_reasons: list[FinishReason]
    injections: list[RecallEvent]
    # Every <|memory_pad|> position of each row (earlier turns' too) -> the vector fed there.
    memory_vectors: list[dict[int, torch.Tensor]]
    cache: Any = None  # KV cache over sequences[:, :-1] (the last token is not yet forwarded)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    logits: torch.Tensor | None = None  # [B, steps, V] raw logits, with output_logits=True

    @property
    def new_tokens(self) -> torch.LongTensor:
        return self.sequences[:, self.prompt_length:]


@dataclass(frozen=True, slots=True)
class DoneEvent:
    """The last event of a stream."""

    result: GenerationResult


Event = TokenEvent | RecallEvent | FinishEvent | DoneEvent

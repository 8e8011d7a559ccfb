"""The prompts of answers that start together, read in one forward (`decoding.graph_rows`).

On a GPU a prompt's eager forward costs about what a decode step of the eager loop does, whatever its length (the
launches, not the arithmetic: about 20 ms for the SmolLM2-1.7B shape on an H200), so answers that join one by one
wait for each other's reads: 32 at once waited 0.7 s before the last one's first token (`docs/gpu/results-4.md`).
Each answer parks its prompt's next chunk as a `PromptTurn`; the round's `PromptReader.run` reads them all in one
forward, each row its own: a row's cached positions (an earlier turn's, its chunks before) right-aligned before a
common column P, its chunk from P on, an attention mask holding the row's own columns; each answer then goes on with
its own cache and its chunk's last state, as if read alone. A lone turn is read on its own cache, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from decoding.batch import Parked
from decoding.compiled import seq_length


@dataclass(eq=False)
class PromptTurn(Parked):
    """A chunk of one answer's prompt, waiting for the round."""

    runner: "PromptReader"
    fwd: object  # the request's `decoding.forward.Forward`
    embeds: torch.Tensor  # [1, n, H]
    positions: torch.Tensor  # [1, n] (text positions)
    cache: DynamicCache  # what the answer read before (an earlier turn's positions, the chunks before): the run
    # replaces it with a cache that holds the chunk's positions too
    hidden: torch.Tensor | None = None  # set by the run: the chunk's last state [1, H]


class PromptReader:
    """Runs a round's `PromptTurn`s: one forward for as many as fit `positions` (rows x their padded length: the
    cached positions are copied into the forward's cache, so 32 conversations of 4,096 positions each would copy
    about 25 GB of the SmolLM2-1.7B shape's keys and values at once); turns of similar cached lengths together.
    `forwards` and `turns` count what it ran."""

    def __init__(self, positions: int = 8192):
        self.positions = positions
        self.forwards = 0
        self.turns = 0

    @torch.no_grad()
    def run(self, turns: list[PromptTurn]) -> None:
        self.turns += len(turns)
        groups, group = [[t] for t in turns if not _together(t)], []
        for t in sorted((t for t in turns if _together(t)), key=lambda t: seq_length(t.cache)):
            if group and (len(group) + 1) * _size([*group, t]) > self.positions:
                groups.append(group)
                group = []
            group.append(t)
        for group in [*groups, group] if group else groups:
            try:
                self._read(group)
            except Exception as e:  # noqa: BLE001 - (out of memory, say) each read alone: only what fails alone fails
                if len(group) == 1:
                    group[0].error = e
                    continue
                for t in group:
                    try:
                        self._read([t])
                    except Exception as alone:  # noqa: BLE001 - its answer raises it (`Batch.park`)
                        t.error = alone

    def _read(self, group: list[PromptTurn]) -> None:
        self.forwards += 1
        if len(group) == 1:
            t = group[0]
            t.hidden, _ = t.fwd.prefill(t.embeds, t.positions, t.cache, None, {})
        else:
            read_together(group)


def _size(turns: list[PromptTurn]) -> int:
    """The padded length of a forward of `turns`: the longest cached length plus the longest chunk."""
    return max(seq_length(t.cache) for t in turns) + max(t.embeds.shape[1] for t in turns)


STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # rotary frequencies that do not depend on the batch's positions


def _together(turn: PromptTurn) -> bool:
    """Whether the turn can be a row of a padded forward: text positions (not mRoPE's), plain layers that keep every
    position (not a sliding window's), rotary frequencies fixed (`dynamic` and `longrope` rescale them by the
    longest position in the batch, so a row would not read as alone)."""
    config = turn.fwd.base.config.get_text_config(decoder=True)
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    return (turn.positions.dim() == 2 and rope in STATIC_ROPE
            and all(type(layer) is DynamicLayer for layer in turn.cache.layers))


def read_together(turns: list[PromptTurn]) -> None:
    """Every turn's chunk in one forward of len(turns) rows; each turn's `cache` and `hidden` as if read alone."""
    fwd, first = turns[0].fwd, turns[0].embeds
    pasts, sizes = [seq_length(t.cache) for t in turns], [t.embeds.shape[1] for t in turns]
    b, p, n = len(turns), max(pasts), max(sizes)
    embeds = first.new_zeros((b, n, first.shape[-1]))
    positions = torch.zeros((b, n), dtype=torch.long, device=first.device)
    mask = torch.zeros((b, p + n), dtype=torch.long, device=first.device)
    for i, (t, past, size) in enumerate(zip(turns, pasts, sizes)):
        embeds[i, :size] = t.embeds[0]
        positions[i, :size] = t.positions[0]
        positions[i, size:] = t.positions[0, -1]  # (the padding's: never read; none past the row's own)
        mask[i, p - past:p + size] = 1
    cache = fwd.new_cache()
    if p:
        longest = pasts.index(p)
        for layer, held in enumerate(zip(*(t.cache.layers for t in turns))):
            like = held[longest]  # (an empty cache's layers hold no tensors yet)
            keys = like.keys.new_zeros((b, like.keys.shape[1], p, like.keys.shape[-1]))
            values = like.values.new_zeros((b, like.values.shape[1], p, like.values.shape[-1]))
            for i, (h, past) in enumerate(zip(held, pasts)):
                if past:
                    keys[i, :, p - past:], values[i, :, p - past:] = h.keys[0, :, :past], h.values[0, :, :past]
            cache.update(keys, values, layer)
    states = fwd.forward_block(embeds, positions, cache, attention_mask=mask)  # [B, n, H]
    read = []
    for i, (past, size) in enumerate(zip(pasts, sizes)):
        own = fwd.new_cache()
        for layer, held in enumerate(cache.layers):
            own.update(held.keys[i:i + 1, :, p - past:p + size], held.values[i:i + 1, :, p - past:p + size], layer)
        read.append((own, states[i:i + 1, size - 1]))
    for t, (own, hidden) in zip(turns, read):  # (only now: a failure before leaves every turn as it came)
        t.cache, t.hidden = own, hidden

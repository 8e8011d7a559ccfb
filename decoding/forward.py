"""The transformers backend (`decoding.backend.Backend`): prefill, then one position a step (gpt-fast style).

Every pass feeds `inputs_embeds`, so a memory vector and a token's own embedding are the same kind
of input. Positions are explicit: plain `[B, S]`, or Qwen3-VL's mRoPE `[4, B, S]` (text positions
stacked on the three rotary axes), computed at prefill like `generate` does and advanced by one a
step after, also at memory positions.
"""

from __future__ import annotations

from typing import Mapping

import torch

from transformers import DynamicCache, StaticCache

from decoding.compiled import capturing, compiled_step, fit, static_cache
from models.modeling import backbone_and_head, head_logits, unwrap_model
from models.spec import transformers_spec


class Forward:
    """A transformers model's backbone, head and input embeddings, resolved once per request."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.base = unwrap_model(model)
        self.spec = transformers_spec(model)
        self.backbone, self.head = backbone_and_head(model)
        self.embed = self.base.get_input_embeddings()
        param = next(self.base.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.compiled = compiled_step(model)  # the compiled decode step, once it is warm (decoding/compiled.py)

    def positions(self, inputs: Mapping[str, torch.Tensor], input_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None) -> torch.Tensor:
        return prefill_positions(self.backbone, inputs, input_ids, attention_mask)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.base.config.get_text_config(decoder=True))

    def cache_for(self, cache, needed: int, plain: bool):
        """The KV cache a request of `needed` positions runs on: `cache` (an earlier turn's; a static one grown
        to hold them), or a new one: static for the compiled step when the request is `plain` (unpadded
        text decoding from the final layer), else dynamic."""
        if cache is None:
            fast = plain and self.compiled is not None and not hasattr(self.backbone, "get_rope_index")
            return static_cache(self.model, needed) if fast else self.new_cache()
        return fit(cache, self.model, needed) if isinstance(cache, StaticCache) else cache

    def joins_batch(self, cache) -> bool:
        """A sliding-window cache keeps only its window: such a request decodes alone."""
        return not any(getattr(layer, "is_sliding", False) for layer in cache.layers)

    def run_round(self, steps, batch) -> None:
        """The round's steps as rows of one forward on the batch's `StaticCache` (a lone step on its own cache)."""
        batch.run_rows(steps, self)

    def forward_block(self, embeds: torch.Tensor, positions: torch.Tensor, cache,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Every new position's final state [B, S, H] of embeds [B, S, H] on `cache` (the mixture's verify; prompts
        read together, with `attention_mask` [B, cached + S])."""
        return self.backbone(inputs_embeds=embeds, position_ids=positions, past_key_values=cache,
                             attention_mask=attention_mask, use_cache=True).last_hidden_state

    def text_positions(self, start: int, length: int, rows: int) -> torch.Tensor:
        """Position ids [R, S] of positions start..start+S-1 of text (stacked [4, R, S] for mRoPE models)."""
        text = torch.arange(start, start + length, device=self.device).expand(rows, -1)
        if hasattr(self.backbone, "get_rope_index"):
            return torch.cat([text[None], text[None].expand(3, -1, -1)])
        return text

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [B, V] of final hidden states [B, H], as the model's own forward gives them."""
        return head_logits(self.model, self.head, hidden)

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, cache, attention_mask: torch.Tensor | None,
                vision: Mapping[str, torch.Tensor], layers: bool = False) -> tuple[torch.Tensor, None]:
        """Run the uncached prompt embeddings [B, S, H]; (the last position's hidden state [B, H] (with
        `layers`: every decoder layer's, [B, L, H], the last one normed), None: `logits` gives the logits)."""
        with capturing(layers):
            out = self.backbone(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions,
                                past_key_values=cache, use_cache=True, **vision, **_all_layers(layers))
        return _last_position(out, layers), None

    def step(self, embeds: torch.Tensor, position: torch.Tensor, cache,
             attention_mask: torch.Tensor | None, layers: bool = False) -> tuple[torch.Tensor, None]:
        """The new positions of a step: embeds [B, W, H] (W = 1, or a memory's slots) -> (the last one's hidden
        state [B, H] (`layers`: [B, L, H]), None), on the KV cache (compiled for one position of unpadded rows
        on a static cache)."""
        if (self.compiled is not None and embeds.shape[1] == 1 and self.compiled.covers(cache)
                and attention_mask is None and not layers):
            return self.compiled(embeds, position, cache), None
        with capturing(layers):
            out = self.backbone(inputs_embeds=embeds, position_ids=position, past_key_values=cache, use_cache=True,
                                attention_mask=attention_mask, **_all_layers(layers))
        return _last_position(out, layers), None

    def reset_request_state(self) -> None:
        """Qwen3-VL keeps per-request rope deltas on the module: never let one request see another's."""
        if hasattr(self.backbone, "rope_deltas"):
            self.backbone.rope_deltas = None


def _all_layers(layers: bool) -> dict:
    """The backbone's keyword for every layer's output (not passed at all otherwise: the plain path is untouched)."""
    return {"output_hidden_states": True} if layers else {}


def _last_position(out, layers: bool) -> torch.Tensor:
    """The last position's final state [B, H], or every decoder layer's [B, L, H] (`hidden_states[1:]`: the
    embedding output is not a layer; the last entry is `last_hidden_state`, already through the final norm)."""
    if not layers:
        return out.last_hidden_state[:, -1]
    return torch.stack([h[:, -1] for h in out.hidden_states[1:]], dim=1)


def prefill_positions(backbone, inputs: Mapping[str, torch.Tensor], input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Position ids of the whole prompt as `generate` builds them: [B, L], or [4, B, L] for mRoPE."""
    if attention_mask is not None:
        text = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)  # [B, L]
    else:
        text = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
    if not hasattr(backbone, "get_rope_index"):
        return text
    if inputs.get("image_grid_thw") is not None:
        rope, _ = backbone.get_rope_index(
            input_ids, mm_token_type_ids=inputs["mm_token_type_ids"].to(input_ids.device),
            image_grid_thw=inputs["image_grid_thw"].to(input_ids.device), attention_mask=attention_mask)
    else:
        rope = text[None].expand(3, -1, -1)
    return torch.cat([text[None], rope.to(text.dtype)], dim=0)  # [4, B, L]


def vision_suffix(inputs: Mapping[str, torch.Tensor], past_len: int, device) -> dict[str, torch.Tensor]:
    """Vision kwargs for the images that lie after the cached prefix (the cache holds the others)."""
    if inputs.get("video_grid_thw") is not None or inputs.get("pixel_values_videos") is not None:
        raise ValueError("the inputs carry a video, which the recall loop does not read (images only): "
                         "send frames as images instead")
    grid = inputs.get("image_grid_thw")
    if grid is None:
        return {}
    types = inputs["mm_token_type_ids"]
    before = 0
    if past_len:  # images wholly inside the cached prefix are already in the cache
        prefix = types[:, :past_len].bool()
        before = int((prefix[:, 1:] & ~prefix[:, :-1]).sum() + prefix[:, 0].sum())
    if before == grid.shape[0]:
        return {}
    rows_before = int(grid[:before].prod(-1).sum())
    return {"pixel_values": inputs["pixel_values"][rows_before:].to(device),
            "image_grid_thw": grid[before:].to(device),
            "mm_token_type_ids": types[:, past_len:].to(device)}

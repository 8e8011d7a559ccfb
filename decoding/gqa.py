"""Grouped-query attention of a few positions without copying its keys and values (`GraphStep(gqa="packed")`).

A model whose query heads share key/value heads (SmolLM2-135M: 9 and 3; Qwen3-VL-2B: 16 and 8) attends, under
transformers' SDPA with an attention mask (the graph step always passes one), after `repeat_kv` has copied every
key/value head once a query head: two copies of the cache's window a layer and a forward. On GPU run 5's 135M step
those copies were 58 kernels and 114 µs of its 0.94 ms of kernels a token; in its 17-wide recall span likely about as
much again (60 kernels, 89 µs, whose names hold the attention's copy, fused with the rotary embedding). The query
heads that share a key/value head can instead be the rows of one attention over it: the query [B, H, L, D] viewed as
[B, H_kv, G * L, D] (a key/value head's G query heads, each with its L positions), the keys and values read as they
are, the mask [B, 1, L, S] as it is for one position (broadcast over the G rows) and repeated G times for several (a
copy of L * G * S flags a layer, against two copies of S * H * D values a layer); the output viewed back. The same
dot products and softmax, so the same numbers up to the kernel's summation order (what transformers itself does for
one position outside torch.compile, `pack_gqa`; it keeps `repeat_kv` under compile).

`PACKED` is an attention implementation registered with transformers (with SDPA's masks): the packed attention for
up to `MAX_POSITIONS` positions (a decode step, a recall's span graphs) of a grouped-query layer with a mask shared
by its heads, SDPA's own otherwise (a prompt).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED = "recall_packed_sdpa"
MAX_POSITIONS = 64  # the most positions packed: the widest span graph (33; `decoding.graph.SPANS`) and room


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, H, L, D], key and value [B, H_kv, S, D] -> ([B, L, H, D], None);
    `kwargs` as transformers passes them (dropout, scaling, is_causal, ...)."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, length, dim = query.shape
    if groups == 1 or length > MAX_POSITIONS or attention_mask is None or attention_mask.shape[1] != 1 \
            or kwargs.get("dropout") or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = query.reshape(batch, heads // groups, groups * length, dim)  # a key/value head's query heads as its rows
    if length > 1:  # row g * L + l is position l's: its mask row
        mask = attention_mask.expand(-1, -1, length, -1)[:, :, None].expand(-1, -1, groups, -1, -1)
        attention_mask = mask.reshape(mask.shape[0], 1, groups * length, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=attention_mask,
                                                           scale=kwargs.get("scaling"))  # [B, H_kv, G * L, D]
    return out.reshape(out.shape[0], heads, length, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED, packed_sdpa)
AttentionMaskInterface.register(PACKED, sdpa_mask)


def pack(config) -> bool:
    """The text model of `config` attends with `PACKED` from now on, if it attended with SDPA; whether it does."""
    if config._attn_implementation == "sdpa":
        config._attn_implementation = PACKED
    return config._attn_implementation == PACKED

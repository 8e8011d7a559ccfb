"""The windows of the graph step's static cache (`decoding/graph.py`): a replay attends over the smallest stretch of
the cache, from its start, that holds the replay's columns, not over all `max_len` positions of it. A replay reads
every key and value it attends to, masked or not (transformers' `StaticCache` hands attention the whole cache): on the
SmolLM2-1.7B shape 196 KB a position, 0.8 GB a step at 4,096 positions; the rows step reads that for every row.

While the forward runs, the cache's layers hold views of the window (`GraphStep._narrow`) and the step builds the
window's mask itself (`window_mask`: transformers passes a 4D mask through as it is). The window's length is
dynamic to torch.compile, so one compile a width serves every window; on CUDA each window has its own captured
graph. A compile guards on how a tensor's strides relate to its length, so every window must be a strict view: the
cache is allocated one position longer than `max_len` (`allocate_strided`), and the first compile runs on the
narrowest window.
"""

from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from decoding.gqa import PACKED

WINDOW_MIN = 128  # the shortest window


def cache_windows(max_len: int) -> tuple[int, ...]:
    """The windows of a static cache of `max_len` positions: `max_len` and each a quarter of the next, none under
    `WINDOW_MIN` (4,096: 256, 1,024, 4,096; 512: 128, 512)."""
    windows = [max_len]
    while windows[-1] // 4 >= WINDOW_MIN:
        windows.append(windows[-1] // 4)
    return tuple(sorted(windows))


def windowable(cache: StaticCache, config, max_len: int) -> bool:
    """Whether replays on this cache attend over windows: two or more of them, plain static layers (no sliding ones)
    and SDPA, or SDPA with a step's or a span's heads packed (`decoding.gqa`; the mask `window_mask` builds is
    SDPA's); else over the whole cache, as transformers masks it."""
    return len(cache_windows(max_len)) > 1 and all(type(layer) is StaticLayer for layer in cache.layers) and \
        getattr(config, "_attn_implementation", None) in ("sdpa", PACKED)


def allocate_strided(cache: StaticCache, config, batch: int, max_len: int, dtype: torch.dtype,
                     device: torch.device) -> None:
    """The cache's keys and values allocated now (transformers' own allocation), each the first `max_len` positions
    of a buffer one position longer: every window, the widest too, is then a view with the same strides."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    none = torch.zeros((batch, heads, 0, head_dim), dtype=dtype, device=device)
    for layer in cache.layers:
        layer.max_cache_len += 1
        layer.lazy_initialization(none, none)
        layer.max_cache_len -= 1
        layer.keys, layer.values = layer.keys[:, :, :max_len], layer.values[:, :, :max_len]


def window_mask(cache: StaticCache, width: int, rows: torch.Tensor | None, batch: int) -> torch.Tensor:
    """[B, 1, W, window] bool (SDPA's: True attends), on the narrowed cache: a replay's column attends to the window's
    columns up to its own, and with the rows' mask [B, window] (narrowed too) only to its row's; what transformers
    builds from the cache's positions and a 2D mask, over the whole cache."""
    layer = cache.layers[0]
    window, device = layer.keys.shape[2], layer.keys.device
    columns = layer.cumulative_length + torch.arange(width, device=device)  # [W]: this replay's columns
    attend = torch.arange(window, device=device) <= columns[:, None]  # [W, window]
    if rows is not None:
        attend = attend & rows[:, None]  # [B, W, window]
    return attend.expand(batch, width, window)[:, None]

"""The windows of the graph step's static cache (`decoding/graph_windows.py`); answers across a window's end equal the
loop's in tests/decoding/test_graph.py."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, StaticCache

from decoding.graph_windows import allocate_strided, cache_windows, window_mask, windowable


def config(**kw) -> LlamaConfig:
    c = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, **kw)
    c._attn_implementation = "sdpa"
    return c


def test_the_windows_are_quarters_none_under_the_least():
    assert cache_windows(4096) == (256, 1024, 4096)
    assert cache_windows(512) == (128, 512)
    assert cache_windows(1000) == (250, 1000)
    assert cache_windows(300) == (300,)


def test_windows_only_where_two_or_more_over_plain_static_layers_and_sdpa():
    c = config()
    assert windowable(StaticCache(config=c, max_cache_len=512), c, 512)
    assert not windowable(StaticCache(config=c, max_cache_len=300), c, 300)  # one window: the whole cache
    eager = config()
    eager._attn_implementation = "eager"  # (its mask is additive floats, not SDPA's booleans)
    assert not windowable(StaticCache(config=eager, max_cache_len=512), eager, 512)
    sliding = config(sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    assert not windowable(StaticCache(config=sliding, max_cache_len=512), sliding, 512)


def test_every_window_the_widest_too_is_a_view_with_the_same_strides():
    c = config()
    cache = StaticCache(config=c, max_cache_len=512)
    allocate_strided(cache, c, 3, 512, torch.float32, torch.device("cpu"))
    keys = cache.layers[0].keys
    assert keys.shape == (3, 2, 512, 8) and cache.layers[0].max_cache_len == 512
    assert {keys[:, :, :w].stride() for w in cache_windows(512)} == {keys.stride()} and not keys.is_contiguous()


def test_the_mask_attends_up_to_each_column_and_a_rows_own():
    c = config()
    cache = StaticCache(config=c, max_cache_len=512)
    allocate_strided(cache, c, 2, 512, torch.float32, torch.device("cpu"))
    layer = cache.layers[0]
    layer.cumulative_length.fill_(5)  # the replay writes columns 5 and 6
    layer.keys, layer.values = layer.keys[:, :, :128], layer.values[:, :, :128]  # (narrowed, as the step does)
    rows = torch.zeros((2, 128), dtype=torch.bool)
    rows[0, :7], rows[1, 3:7] = True, True  # row 1 starts at column 3
    mask = window_mask(cache, 2, rows, 2)
    assert mask.shape == (2, 1, 2, 128)
    assert mask[0, 0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]
    assert mask[0, 0, 1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert mask[1, 0, 1].nonzero().flatten().tolist() == [3, 4, 5, 6]
    assert window_mask(cache, 2, None, 2)[1, 0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]

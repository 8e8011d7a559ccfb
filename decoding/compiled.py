"""The fast decode path: a static, preallocated KV cache and the decode step compiled once (gpt-fast style).

`enable(model)` attaches a `CompiledStep` to a model: `torch.compile` of one backbone forward for
one new position a row, over transformers' `StaticCache` (keys and values preallocated to one of
a few bucket lengths, written in place). A step has the same shapes whatever the conversation's
length, a token or a memory embedding, so it compiles once per batch size and bucket; a new
conversation, a new cache object or a recall does not recompile. `warm_up()` compiles it on dummy
inputs for each bucket, shortest first (the app runs it in the background at start; until the
first is done the loop decodes eagerly on a dynamic cache). A request starts in the shortest
bucket that holds its prompt and moves to the next one when it fills (`fit`, a copy of the keys
and values), eagerly if that one is not compiled yet rather than stall everyone for a compile.
The loop takes the compiled step for unpadded text prompts; a padded batch, Qwen3-VL's mRoPE
positions and entropy decoding (every layer's state) stay eager.

Past dynamo's recompile limit (8 compiles of one function) a step would run eagerly for the rest of
the process without a word, so nothing may recompile it. It runs without autograd, on copies of its
inputs with a fresh tensor's strides: dynamo guards on strides, also those of size-1 dimensions,
which `.contiguous()` keeps, so a slice of a wider tensor would compile anew. Each model's step
counts its compiles apart from other models' (`isolate_recompiles` from torch 2.13 on; before it, a copy of
the function's code a step, as dynamo counts a code object's compiles), so the 7 buckets of one model and
those of another (int8 beside fp32) never add up past the limit.

While dynamo traces a forward, transformers' output capture (`output_hidden_states`: every layer's
state, which entropy decoding reads) is one process-wide variable, not per thread: a forward that
captures in another thread at that moment loses layers. The warm-up holds `TRACING` while it
compiles a bucket, and a forward that captures takes it (`capturing`): it waits for that bucket.
`stop()` ends a warm-up after the bucket it is compiling (a service that closes calls it).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
import types

import torch
from transformers import StaticCache

from models.modeling import backbone_and_head, max_positions, unwrap_model

BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)  # static cache lengths: few shapes, few compiles. A step
                                                    # attends over its whole bucket (masked): the shorter the better
_ATTR = "_recall_compiled_step"
_ISOLATE = "isolate_recompiles" in inspect.signature(torch.compile).parameters  # torch >= 2.13
log = logging.getLogger("decoding.compiled")
TRACING = threading.Lock()  # held while a warm-up compiles: transformers' output capture is not thread-safe then


def capturing(layers: bool):
    """The context a forward runs in: with `layers` (it captures every layer's state) it waits while
    another thread traces a forward (`TRACING`)."""
    return TRACING if layers else contextlib.nullcontext()


def _own_code(method):
    """`method` on a copy of its function's code: before torch 2.13 dynamo counts compiles (and its recompile
    limit) per code object, so every step's would count together."""
    f = method.__func__
    copy = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return types.MethodType(copy, method.__self__)


class CompiledStep:
    """One decode step, compiled: embeds [B, 1, H], position ids [B, 1], a `StaticCache` -> hidden [B, H]."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.backbone, _ = backbone_and_head(model)
        self._fn = torch.compile(self._step, dynamic=False, isolate_recompiles=True) if _ISOLATE else \
            torch.compile(_own_code(self._step), dynamic=False)  # (each model's step counts its own compiles)
        self.ready = threading.Event()  # set once warm_up has compiled it
        self.lengths: set[int] = set()  # cache lengths it is compiled for (a longer cache decodes eagerly:
                                        # compiling another shape would stall the worker for minutes)
        self.compile_seconds: float | None = None
        self.error: str | None = None
        self._stop = threading.Event()

    def _step(self, embeds: torch.Tensor, position: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        return self.backbone(inputs_embeds=embeds, position_ids=position, past_key_values=cache,
                             use_cache=True).last_hidden_state[:, -1]

    @torch.no_grad()  # (grad mode and an input's requires_grad are guarded too)
    def __call__(self, embeds: torch.Tensor, position: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        fresh = torch.contiguous_format  # whatever the inputs were sliced from: the strides it was compiled for
        return self._fn(embeds.clone(memory_format=fresh), position.clone(memory_format=fresh), cache)

    def __deepcopy__(self, memo) -> None:
        return None  # a copy of the model (the mixture's base copy) starts uncompiled

    def covers(self, cache) -> bool:
        """Whether a step on `cache` runs compiled (a static cache of a length compiled for)."""
        return isinstance(cache, StaticCache) and cache.layers[0].max_cache_len in self.lengths

    def warm_up(self, batch: int = 1, up_to: int | None = None) -> float:
        """Compile on dummy inputs (a 2-token prompt, two steps) for every bucket up to the model's
        context (or the bucket that holds `up_to` positions), shortest first; `ready` is set after the
        first. Returns the seconds the first took.
        A failure is logged and kept in `error`: the buckets not compiled decode eagerly. A `stop()` ends this
        warm-up (also one asked before it began), not a later one."""
        try:
            self._compile_buckets(batch, min(max_positions(self.model) or BUCKETS[-1], up_to or BUCKETS[-1]))
        finally:
            self._stop.clear()
        return self.compile_seconds or 0.0

    def _compile_buckets(self, batch: int, context: int) -> None:
        for length in BUCKETS:
            if self._stop.is_set():
                return
            t0 = time.perf_counter()
            try:
                with TRACING:
                    self._compile(length, batch)
            except Exception as e:  # noqa: BLE001 - any compiler failure leaves the exact eager path in charge
                self.error = f"{type(e).__name__}: {e}"
                log.warning("compiling the decode step failed, decoding stays eager: %s", self.error)
                return
            self.lengths.add(length)
            if self.compile_seconds is None:
                self.compile_seconds = time.perf_counter() - t0
                self.ready.set()
            if length >= context:
                return

    def stop(self) -> None:
        """End a warm-up after the bucket it is compiling (the buckets compiled so far stay in use)."""
        self._stop.set()

    def _compile(self, length: int, batch: int) -> None:
        param = next(self.model.parameters())
        embed = unwrap_model(self.model).get_input_embeddings()
        ids = torch.zeros((batch, 2), dtype=torch.long, device=param.device)
        with torch.no_grad():
            cache = static_cache(self.model, length)
            self.backbone(inputs_embeds=embed(ids), past_key_values=cache, use_cache=True)
            for pos in (2, 3):
                self(embed(ids[:, :1]), torch.full((batch, 1), pos, device=param.device), cache)


def enable(model: torch.nn.Module) -> CompiledStep:
    """Attach a (not yet compiled) `CompiledStep` to the model; the loop uses it once it is ready."""
    base = unwrap_model(model)
    step = getattr(base, _ATTR, None)
    if step is None:
        step = CompiledStep(model)
        object.__setattr__(base, _ATTR, step)  # not a submodule: kept out of state_dict and .to()
    return step


def attached(model: torch.nn.Module) -> CompiledStep | None:
    """The step `enable` attached to the model, compiled or not yet."""
    return getattr(unwrap_model(model), _ATTR, None)


def compiled_step(model: torch.nn.Module) -> CompiledStep | None:
    """The model's compiled step, if `enable` attached one and it is compiled."""
    step = attached(model)
    return step if step is not None and step.ready.is_set() else None


def static_cache(model: torch.nn.Module, needed: int) -> StaticCache:
    """A static cache for at least `needed` positions: the shortest bucket that holds them (beyond the
    longest, a multiple of it)."""
    config = unwrap_model(model).config.get_text_config(decoder=True)
    length = next((b for b in BUCKETS if b >= needed), -(-needed // BUCKETS[-1]) * BUCKETS[-1])
    return StaticCache(config=config, max_cache_len=length)


def seq_length(cache) -> int:
    """Positions a cache holds, as an int (a static cache counts in a tensor)."""
    return int(cache.get_seq_length())


def crop(cache, drop: int) -> None:
    """Forget the last `drop` positions of a cache. A static cache only moves its write position back:
    what lies past it is overwritten before it is ever attended to."""
    if drop <= 0:
        return
    if isinstance(cache, StaticCache):
        for layer in cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.sub_(drop)
    else:
        cache.crop(-drop)


def fit(cache, model: torch.nn.Module, needed: int) -> StaticCache:
    """A static cache that holds `needed` positions with `cache`'s contents: `cache` itself when it is a
    static cache long enough, else a new one (from a shorter static cache, or a dynamic one)."""
    if isinstance(cache, StaticCache) and cache.layers[0].max_cache_len >= needed:
        return cache
    bigger = static_cache(model, needed)
    held = seq_length(cache)
    for old, new in zip(cache.layers, bigger.layers):
        if old.is_initialized:
            new.lazy_initialization(old.keys, old.values)
            new.keys[:, :, :held] = old.keys[:, :, :held]
            new.values[:, :, :held] = old.values[:, :, :held]
            new.cumulative_length.fill_(held)
    return bigger

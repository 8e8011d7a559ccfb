"""A decode step on fixed device buffers, replayed as one CUDA graph, and a host loop that never waits for it.

`GraphStep` holds one transformers `StaticCache` (B rows, `max_len` positions) and the step's inputs as
preallocated device tensors: token ids [B, W], an injection vector [B, W, H] and a flag [B, W] (a
`<|memory_pad|>` slot is `where(flag, vector, embed(id))`, so a memory is one more replay), positions [B, W],
the column whose state is wanted [B] and the real width n. The forward is compiled by inductor for W = 1 and
for each span bucket (`SPANS`: a memory's slots and its suffix, padded to the smallest bucket that holds
them; a longer one takes several replays), and on CUDA the whole step is captured in one `torch.cuda.CUDAGraph`
per width and sampler kind: the repetition penalty's count of the input tokens, the positions, the forward,
the cache's padding forgotten, the request's processors and draw (`decoding.device_sampler`), the token
written into the next replay's input and into a ring copied to pinned host memory. A step is one `replay()`;
torch.compile's own CUDA graphs (`graphs="trees"`, the first run's path) are the fallback.

`GraphDecoder.stream` is the host loop (`decoding.graph_loop`: gpt-fast's `decode_n_tokens` with the read-back of
mlx-lm's `generate_step`): it launches step n + 1 before it reads step n's tokens, so the device never waits for the
host, and a stop (EOS, the length, an interrupt) ends the request one step later at most. Processors without
a tensor form run as transformers' processors after the replay (`DeviceSampler.configure`). A recall (batch
1): the read-back shows `<recall>` while the step that took it as input is already queued; that step's final
state is the memory head's query (exact search on the device, `MemoryVectorDB.topk`), its token is dropped,
and choosing the memory reads its k scores back (the host needs the memory's slot count).

A replay attends over the smallest window of the static cache that holds its columns (`decoding.graph_windows`: each
a quarter of the next, none under 128), not all of it: one compile a width for every window, a captured graph each.

Qwen3-VL's mRoPE positions go through the same buffer: a step feeds its text positions and adds the rotary
offset its prompt's images left (`delta`, set at prefill) on the three rotary axes.

`GraphDecoder.stream` (rows of one request, equal lengths; a recall takes one row) is the standalone engine of
`bench/gpu.py` and `tests/decoding/test_graph.py`; the chat answers on it through `decoding.graph_stream`, which adds
the loop's events, stop strings and conversations. In rows mode (`rows=True`: `decoding.graph_rows`) each row is its
own request: a replay writes the same columns of every row, a row's positions are the columns its attention mask
holds, and a span is right-aligned (the other rows decode their one token in its last column).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable, ContextManager, Iterator

import torch
from transformers import StaticCache

from decoding.compiled import TRACING
from decoding.memory import Recall
from decoding.device_sampler import FULL, DeviceSampler, Kind
from decoding.fused import fuse_projections
from decoding.graph_compile import forwards, gqa_of, matvec_of
from decoding.graph_inputs import Inputs
from decoding.graph_windows import allocate_strided, cache_windows, window_mask, windowable
from decoding.graph_loop import Decoded, HostLoop
from decoding.processors import build_logits_processor
from decoding.settings import GenerationSettings
from models.modeling import backbone_and_head, head_logits, unwrap_model

log = logging.getLogger("decoding.graph")
SPANS = (17, 33)  # widths of the wide graphs: a recalled memory's slots and its suffix in one replay (16 + 1, 32 + 1)


class GraphStep:
    """The step on one static cache of `batch` rows and `max_len` positions; `compile=False` runs it eagerly
    (the same code: what the CPU tests compare against the loop).

    `graphs`: "manual" (on CUDA: the forward compiled by inductor without CUDA graphs, and the whole step, the
    sampler's operations and the commit of the token included, captured in one `torch.cuda.CUDAGraph` per width
    and sampler kind: a step is one `replay()`), "trees" (torch.compile's own CUDA graphs of the forward,
    `mode="reduce-overhead"`; the sampler runs eagerly around it: the first run's path) or "none". A manual
    capture that fails falls back to "trees" (logged in `fallback`).

    `freeze`, `fuse`, `matvec`, `autotune` and `gqa`: how its forwards are compiled (`decoding.graph_compile`);
    `matvec` and `gqa` as resolved for this step and model."""

    def __init__(self, model: torch.nn.Module, *, batch: int = 1, max_len: int = 1024,
                 spans: tuple[int, ...] = SPANS, compile: bool = True, graphs: str = "manual", rows: bool = False,
                 freeze: bool = False, fuse: bool = False, matvec: str = "cublas", gqa: str = "repeat",
                 autotune: bool = False):
        self.model = model
        self.fuse = fuse and compile
        if self.fuse:
            fuse_projections(model)
        self.backbone, self.head = backbone_and_head(model)
        self.mrope = hasattr(self.backbone, "get_rope_index")  # Qwen3-VL: positions [4, B, S] (text, then t/h/w)
        base = unwrap_model(model)
        self.embed = base.get_input_embeddings()
        param = next(base.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.config = config = base.config.get_text_config(decoder=True)
        self.gqa = gqa_of(config, gqa)
        self.matvec = matvec_of(matvec, self.device, batch, config.hidden_size)
        self.autotune = autotune and compile
        self.batch, self.max_len, self.spans = batch, max_len, tuple(sorted(spans))
        self.cache = StaticCache(config=config, max_cache_len=max_len)
        # a replay attends over the smallest window of the cache that holds its columns (`decoding.graph_windows`)
        self.windowed = graphs != "trees" and windowable(self.cache, config, max_len)
        self.windows = cache_windows(max_len) if self.windowed else (max_len,)
        self.window = max_len  # the window of the replay being run
        if self.windowed:
            allocate_strided(self.cache, config, batch, max_len, self.dtype, self.device)
        self.one = Inputs.zeros(batch, 1, config.hidden_size, self.device, self.dtype)
        self.wide = {w: Inputs.zeros(batch, w, config.hidden_size, self.device, self.dtype) for w in self.spans}
        # a single row's span inputs, staged by `forward_span` in one copy: ids [W], flags [W], n, last (the span
        # graph's first kernels copy them into its inputs; rows fill theirs themselves)
        self.staged = {w: torch.tensor([0] * (2 * w) + [w, 0], device=self.device) for w in self.spans}
        self.offsets = {w: torch.arange(w, device=self.device) for w in (1, *self.spans)}  # [W]
        self.delta = torch.zeros((batch, 1), dtype=torch.long, device=self.device)  # mRoPE: rotary - text position
        # rows: each row its own request (`decoding.graph_rows`): a replay writes the same columns of every row, a
        # row's positions are the columns its mask holds (`host_mask`: the host's copy), a span is right-aligned
        self.rows = rows
        self.mask = torch.zeros((batch, max_len + 1), dtype=torch.bool, device=self.device)[:, :max_len] if rows \
            else None  # (a strict view, as the cache's: `graph_windows.allocate_strided`)
        self.host_mask = torch.zeros((batch, max_len), dtype=torch.bool) if rows else None
        self.sampler = DeviceSampler(batch, self.embed.weight.shape[0], self.device, max_len=max_len)
        self.length = 0  # positions the cache holds (counted on the host)
        self.owner: Callable[[], object] | None = None  # weakref to the conversation's handle whose positions the
        # cache holds (`decoding.graph_stream.GraphCache`): it takes them with it before they are overwritten
        self.compiled = compile
        cuda = self.device.type == "cuda"
        self.mode = graphs if compile and cuda else "none"
        self.graphs = self.mode != "none"
        self.fallback: str | None = None
        self.freeze = freeze and compile and self.mode != "trees"
        self._freezing = False  # the frozen forward may compile now (the warm-up's)
        self._mark_state()
        self._fn, self._fn_one = self._compile()
        self._captured: dict = {}  # (width, kind, window) -> (CUDAGraph, (hidden, logits))
        self.compile_seconds: float | None = None

    def _compile(self) -> tuple[Callable, Callable]:
        """(the forward of the span graphs, the one-position forward): `decoding.graph_compile.forwards`."""
        if not self.compiled:
            return self._forward, self._forward
        return forwards(self._forward, mode=self.mode, device=self.device, fuse=self.fuse, freeze=self.freeze,
                        matvec=self.matvec, autotune=self.autotune, freezing=lambda: self._freezing)

    def _mark_state(self) -> None:
        """The step's buffers (inputs and mutable state) as static addresses (torch.compile's CUDA graphs then use
        them in place: never copied into the graph's own inputs), or, with `freeze`, as plain inputs: freezing
        folds a static input into a constant (GPU run 3's wrong step took the cache's length as one). The cache's
        tensors exist after its first update (a prefill: eager); transformers marks them static then, so a prefill
        calls this again."""
        state = [self.delta, *([self.mask] if self.rows else []), *self.one.tensors(),
                 *(t for inputs in self.wide.values() for t in inputs.tensors())]
        state += [t for layer in self.cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        for t in state:
            if self.freeze:
                vars(t).pop("_dynamo_static_input_type", None)  # (what `mark_static_address` sets; no public undo)
            else:
                torch._dynamo.mark_static_address(t)

    def _forward(self, ids: torch.Tensor, vector: torch.Tensor, flag: torch.Tensor, position: torch.Tensor,
                 last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = torch.where(flag[..., None], vector, self.embed(ids))  # [B, W, H]
        if self.mrope:  # text positions, and the three rotary axes where the prompt's images left them
            position = torch.cat([position[None], (position + self.delta)[None].expand(3, -1, -1)])  # [4, B, W]
        mask = window_mask(self.cache, ids.shape[1], self.mask, self.batch) if self.windowed else self.mask
        out = self.backbone(inputs_embeds=embeds, position_ids=position, past_key_values=self.cache, use_cache=True,
                            attention_mask=mask).last_hidden_state  # [B, W, H]
        hidden = out.gather(1, last[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]  # [B, H]
        return hidden, head_logits(self.model, self.head, hidden)

    @contextlib.contextmanager
    def _narrow(self) -> Iterator[None]:
        """The cache's layers hold views of their first `window` positions while the forward runs (the step's own
        mask is as wide); their length dynamic to torch.compile, so every window shares one compile."""
        full, mask = [(layer.keys, layer.values) for layer in self.cache.layers], self.mask
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :self.window], layer.values[:, :, :self.window]
        if self.rows:
            self.mask = mask[:, :self.window]
        if self.compiled:  # (what is dynamic: the views are new tensors each time)
            for layer in self.cache.layers:
                torch._dynamo.mark_dynamic(layer.keys, 2)
                torch._dynamo.mark_dynamic(layer.values, 2)
            if self.rows:
                torch._dynamo.mark_dynamic(self.mask, 1)
        try:
            yield
        finally:
            for layer, (keys, values) in zip(self.cache.layers, full):
                layer.keys, layer.values = keys, values
            self.mask = mask

    def _body(self, inputs: Inputs, kind: Kind | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything one replay does: count the input tokens (repetition penalty), set the positions, the forward,
        forget the padding's cache positions, advance the position, and (with a kind) choose and commit the
        token."""
        width, offsets = inputs.ids.shape[1], self.offsets[inputs.ids.shape[1]]
        if width > 1 and not self.rows:  # a single row's span: its inputs from `forward_span`'s one staged copy
            staged = self.staged[width]
            inputs.ids.copy_(staged[:width].expand(self.batch, -1))
            inputs.flag.copy_((staged[width:2 * width] > 0).expand(self.batch, -1))
            inputs.n.copy_(staged[-2].expand(self.batch))
            inputs.last.copy_(staged[-1].expand(self.batch))
        first = width - inputs.n[:, None] if self.rows else 0  # [B, 1]: a row's first real column (rows: right-aligned)
        valid = (offsets >= first) if self.rows else (offsets < inputs.n[:, None])  # [B, W]
        if kind is not None and kind.sees:
            self.sampler.see(inputs.ids, None if width == 1 else valid.expand_as(inputs.ids))
        if width > 1:
            torch.add(self.one.position - first, offsets, out=inputs.position)  # [B, W]: this span's positions
        if self.rows:  # the columns this replay writes: each row's real ones join its mask
            columns = (self.cache.layers[0].cumulative_length + offsets).expand(self.batch, -1)
            self.mask.scatter_(1, columns, valid.expand(self.batch, -1))
        if self.mode == "trees":
            torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs are dead (copied out)
        with self._narrow() if self.windowed else contextlib.nullcontext():
            hidden, logits = (self._fn_one if width == 1 else self._fn)(*inputs.tensors())
        if width > 1 and not self.rows:
            pad = width - inputs.n  # the padding's keys are overwritten before they are read
            lengths = [layer.cumulative_length for layer in self.cache.layers]
            torch._foreach_sub_(lengths, [pad[0]] * len(lengths))  # (one kernel in the graph, not one a layer)
        self.one.position.add_(inputs.n[:, None])
        if kind is not None and kind.commit:
            self.sampler.commit(self.sampler.choose(logits, kind), self.one.ids, kind.masked)
        return hidden, logits

    @torch.no_grad()
    def _run(self, inputs: Inputs, kind: Kind | None, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One replay of `inputs` (its graph: width, kind and the smallest window of the cache that holds the
        replay's columns, or `window`)."""
        ends = self.length + inputs.ids.shape[1]
        self.window = window or next((w for w in self.windows if w >= ends), self.max_len)
        if self.mode != "manual":
            return self._body(inputs, kind)
        key = (inputs.ids.shape[1], kind, self.window)
        if key not in self._captured:
            try:
                graph = torch.cuda.CUDAGraph()
                # thread_local: the chat's loop may run on another thread meanwhile (only this one is captured)
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    outs = self._body(inputs, kind)
                self._captured[key] = graph, outs
            except Exception as e:  # noqa: BLE001 - the proven path instead of none
                self.fallback = f"manual capture failed ({type(e).__name__}: {e}); torch.compile's CUDA graphs"
                self.mode, self._captured, self.freeze = "trees", {}, False
                self.windowed, self.windows, self.window = False, (self.max_len,), self.max_len
                self._mark_state()
                self._fn, self._fn_one = self._compile()
                return self._body(inputs, kind)
        graph, outs = self._captured[key]
        graph.replay()
        return outs

    @torch.no_grad()
    def prefill(self, embeds: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None,
                vision: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt embeddings [B, L, H] run eagerly from position `start` (the cache keeps the `start` positions
        before them, an earlier prefill's or turn's); (the last state [B, H], logits [B, V]). The next step's input
        position is start + L. `positions`: their position ids when they are not start.. (mRoPE's [4, B, L] of a
        prompt with images, `decoding.forward.prefill_positions`), with the images' `vision` kwargs."""
        b, n = embeds.shape[:2]
        if b != self.batch or start + n >= self.max_len or not 0 <= start <= self.length:
            raise ValueError(f"prompt of {b} rows x {n} positions from {start}; this step holds {self.batch} rows x "
                             f"{self.max_len} positions, {self.length} of them now")
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(start)
        if start == 0:
            self.release()  # starting over: the conversation whose positions the cache held takes them with it
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device).expand(b, -1)
            if self.mrope:
                positions = positions[None].expand(4, -1, -1)
        if self.mrope:
            self.delta.copy_(positions[1:2, :, -1].T - positions[0, :, -1:])
        if self.rows:  # (a warm-up's prompt: every row's)
            self.mask[:, start:start + n] = True
            self.host_mask[:, start:start + n] = True
        hidden = self.backbone(inputs_embeds=embeds, position_ids=positions, past_key_values=self.cache,
                               use_cache=True, attention_mask=self.mask, **(vision or {})).last_hidden_state[:, -1]
        if self.freeze:
            self._mark_state()  # (a cache's tensors are made on its first update, here, and transformers marks them)
        self.length = start + n
        self.one.position.fill_(start + n)
        return hidden, head_logits(self.model, self.head, hidden)

    def release(self) -> None:
        """The cache's owner (a weakref's conversation handle with a `hold()`) copies its positions out of it."""
        owner = self.owner() if self.owner is not None else None
        self.owner = None
        if owner is not None:
            owner.hold()

    def step(self, kind: Kind | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One position a row: the token in `one.ids` at `one.position` -> (state [B, H], logits [B, V]), the
        graph's own output buffers (valid until its next replay); with a `kind`, the next token is chosen and
        committed in the same replay."""
        if self.length + 1 > self.max_len:
            raise ValueError(f"the static cache is full ({self.max_len} positions)")
        out = self._run(self.one, kind)
        self.length += 1
        return out

    def _width(self, left: int) -> int:
        """The graph a span's next part takes: the smallest that holds the `left` tokens, else the widest."""
        return next((w for w in self.spans if w >= left), self.spans[-1])

    def room_for(self, n: int) -> bool:
        """Whether a span of `n` forced positions fits from `one.position` on (its padded replays included)."""
        length = self.length
        while n > 0:
            width = self._width(n)
            if length + width > self.max_len:
                return False
            length, n = length + min(width, n), n - min(width, n)
        return True

    def forward_span(self, tokens: list[int], vectors: dict[int, torch.Tensor],
                     kind: Kind | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forced positions from `one.position` on, the same for every row: `tokens`, with `vectors[i]` [H] (model
        dtype, on the device) in place of token i's embedding; (the last one's state [B, H], logits [B, V]), in the
        smallest span graph that holds them (several replays of the widest for a longer span)."""
        if not self.spans:
            raise ValueError("this step was built without span graphs (spans=())")
        out, start = None, 0
        while start < len(tokens):
            width = self._width(len(tokens) - start)
            if self.length + width > self.max_len:  # the padded width is written before it is cropped
                raise ValueError(f"no room for a span of {len(tokens)} in the static cache ({self.length} of "
                                 f"{self.max_len} positions held)")
            part, w = tokens[start:start + width], self.wide[width]
            n = len(part)
            here = [i for i in range(n) if start + i in vectors]
            # ids, flags, n and the last column in one copy from pinned memory (its block is not reused before the
            # copy ran: torch's pinned allocator records it); the span graph copies them into its inputs
            flags = [int(i in here) for i in range(width)]
            staged = torch.tensor([*part, *[0] * (width - n), *flags, n, n - 1], pin_memory=self.device.type == "cuda")
            self.staged[width].copy_(staged, non_blocking=True)
            if here:  # (a memory's slots are one run of columns: a slice's copy, no index sent to the device)
                stacked = torch.stack([vectors[start + i] for i in here])
                columns = slice(here[0], here[-1] + 1) if here[-1] - here[0] + 1 == len(here) else here
                w.vector[:, columns] = stacked.to(w.vector.dtype)
            last = start + n >= len(tokens)
            out = self._run(w, kind if last or kind is None else dataclasses.replace(kind, commit=False))
            self.length += n
            start += n
        return out

    def _rewind(self, length: int) -> None:
        """The cache back to its first `length` positions (the warm-up's dummy prompt), on the device and the host."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)
        self.one.position.fill_(length)
        self.length = length

    @contextlib.contextmanager
    def _compiling(self) -> Iterator[None]:
        """While the warm-up compiles: the frozen forward's compile is frozen (`_compile`)."""
        self._freezing = self.freeze
        try:
            yield
        finally:
            self._freezing = False

    def warm_up(self, prompt: int = 4, spans: bool = True, kinds: tuple[Kind | None, ...] = (),
                stop: threading.Event | None = None) -> float:
        """Compile the forward for each width, run every sampler operation once, and capture the graphs of greedy
        decoding, of the fallback (processors after the replay) and of `kinds`, on a dummy prompt; the cache is left
        empty. A `stop` set ends it between graphs (the rest are captured when first used). Returns the seconds.
        A warm-up that fails with the cache's windows is run again without them (logged, in `fallback`)."""
        t0 = time.perf_counter()
        try:
            self._warm_up(prompt, spans, kinds, stop)
        except Exception as e:  # noqa: BLE001 - the whole cache instead of no step
            if not self.windowed:
                raise
            log.warning("the graph step's cache windows failed (%s: %s); it attends over the whole cache",
                        type(e).__name__, e)
            self.fallback = f"cache windows failed ({type(e).__name__}: {e}); the whole cache"
            self.windowed, self.windows, self._captured = False, (self.max_len,), {}
            self._warm_up(prompt, spans, kinds, stop)
        self.compile_seconds = time.perf_counter() - t0
        return self.compile_seconds

    def _warm_up(self, prompt: int, spans: bool, kinds: tuple[Kind | None, ...],
                 stop: threading.Event | None) -> None:
        greedy = Kind()
        # (compiled on the narrowest window: a view narrower than the cache has its own strides, so the compile does
        # not tie them to its length, and the wider windows run on it too)
        self.window = self.windows[0]
        with torch.no_grad(), self._compiling():
            self.prefill(self.embed(torch.zeros((self.batch, prompt), dtype=torch.long, device=self.device)))
            widths = self.spans if spans else ()
            for _ in range(3 if self.mode == "trees" else 2):  # compile (and, for trees, record and replay)
                if stop is not None and stop.is_set():
                    break
                self._rewind(prompt)
                self._body(self.one, None) if self.mode == "manual" else self.step(greedy)
                for w in widths:
                    if stop is not None and stop.is_set():
                        break
                    self._rewind(prompt)
                    self.forward_span([0, 0], {0: torch.zeros(self.embed.weight.shape[1], device=self.device,
                                                              dtype=self.dtype)}) if self.mode != "manual" else \
                        self._body(self.wide[w], None)
            self.sampler.choose(torch.zeros((self.batch, self.sampler.vocab), device=self.device), FULL)
            for kind in dict.fromkeys((greedy, None, *kinds)) if self.mode == "manual" else ():
                # (a memory longer than the widest span replays it first without committing a token)
                long = () if kind is None or not widths else ((widths[-1], dataclasses.replace(kind, commit=False)),)
                for (width, variant), window in itertools.product(((1, kind), *((w, kind) for w in widths), *long),
                                                                  self.windows):
                    if stop is not None and stop.is_set():
                        break
                    self._rewind(prompt)  # (a capture does not run: its replay moves the cache on)
                    self._run(self.one if width == 1 else self.wide[width], variant, window)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        self._rewind(0)
        if self.rows:
            self.mask.zero_()
            self.host_mask.zero_()


class GraphDecoder:
    """Requests of `batch` equal-length rows on one `GraphStep` (its cache is reused: one request at a time)."""

    def __init__(self, model: torch.nn.Module, **step_options):
        self.graph = GraphStep(model, **step_options)
        self.launch_guard: Callable[[], ContextManager] = contextlib.nullcontext  # around each step's launch (tests)
        self.ready = threading.Event()  # set once warmed up: the chat's engine uses it from then on
        self._stop = threading.Event()
        self.busy = False  # a chat answer or read holds the step (`decoding.graph_stream`)
        self.max_slots = 128  # the most value slots of a memory the chat may recall (room kept for one in the cache)
        self.error: str | None = None

    def __deepcopy__(self, memo) -> None:
        return None  # a copy of the model (the mixture's base copy) starts without one

    def warm_up(self, spans: bool = True, settings: tuple[GenerationSettings, ...] = (),
                eos: list[int] | None = None) -> float:
        """Compile and capture (`GraphStep.warm_up`, holding `decoding.compiled.TRACING`), also the graphs of the
        processors of `settings` (the configured defaults; `eos`: the model's end ids), with nothing to read too;
        `ready` is set after, unless `stop()` came first (a stop asked before it began too). A failure is logged
        and kept in `error`: the chat then decodes in its loop."""
        g = self.graph
        try:
            kinds = [kind for s in settings if (kind := self._kind(s, eos)) is not None]
            kinds += [dataclasses.replace(k, no_memory=True) for k in kinds]  # (no bank: the chat's NoMemory)
            with TRACING:
                seconds = g.warm_up(spans=spans, kinds=tuple(kinds), stop=self._stop)
        except Exception as e:  # noqa: BLE001 - the loop stays in charge
            self.error = f"{type(e).__name__}: {e}"
            log.warning("warming up the graph step failed, the chat decodes in its loop: %s", self.error)
            return 0.0
        finally:
            stopped = self._stop.is_set()
            self._stop.clear()
        if not stopped:
            self.ready.set()
        return seconds

    def _kind(self, settings: GenerationSettings, eos: list[int] | None) -> Kind | None:
        """The sampler kind a request of these settings runs (None: the fallback, or settings that need what a
        warm-up has not: guidance's second model)."""
        g = self.graph
        ids = torch.zeros((g.batch, 1), dtype=torch.long, device=g.device)
        try:
            procs = build_logits_processor(dataclasses.replace(settings, guidance_scale=1.0, negative_prompt=None),
                                           eos_token_id=eos or None, prompt_ids=ids, vocab_size=g.sampler.vocab)
        except ValueError:
            return None
        return g.sampler.configure(procs, do_sample=settings.do_sample, seed=0, eos=list(eos or []), pad=0,
                                   masked=False)

    def stop(self) -> None:
        """End a warm-up between two graphs (the decoder then stays unready: the chat decodes in its loop)."""
        self._stop.set()

    def stream(self, input_ids: torch.Tensor, settings: GenerationSettings = GenerationSettings(), *,
               recall: Recall | None = None, eos_token_id: int | list[int] | None = None, pad_token_id: int = 0,
               interrupt: threading.Event | None = None, keep_logits: bool = False,
               out: Decoded | None = None) -> Iterator[list[int]]:
        """Yield each position's tokens [B] (host ints) as the host reads them back, a step behind the device;
        forced span tokens as soon as they are known. `out` (a `Decoded`) collects recalls, logits and counts.
        The request's processors and draw run inside the step's graph when `DeviceSampler.configure` has a tensor
        form for all of them, else (the fallback) as transformers' processors and `sampling.draw` after it."""
        rows = input_ids.shape[0]
        if rows != self.graph.batch:
            raise ValueError(f"input_ids has {rows} rows; this decoder was built for {self.graph.batch}")
        if recall is not None and recall.active and rows != 1:
            raise ValueError(f"recall in the graph decoder takes one row, got {rows} (decode them with decoding.loop)")
        run = HostLoop(self.graph, input_ids, settings, recall, eos_token_id, pad_token_id, keep_logits,
                       out if out is not None else Decoded([], "length"))
        g = self.graph
        with torch.no_grad():
            hidden, logits = g.prefill(g.embed(run.prompt))
            for tokens, forced in run.tokens(hidden, logits, interrupt, self.launch_guard):
                yield from ([t] for t in tokens) if forced else [tokens]

    def generate(self, input_ids: torch.Tensor, settings: GenerationSettings = GenerationSettings(),
                 **kwargs) -> Decoded:
        """`stream` run to the end."""
        out = Decoded([], "length")
        for _ in self.stream(input_ids, settings, out=out, **kwargs):
            pass
        return out



_ATTR = "_recall_graph_decoder"


def enable(model: torch.nn.Module, max_slots: int = 128, **step_options) -> GraphDecoder:
    """Attach a `GraphDecoder` of one row to the model (not warmed up: `warm_up()` makes it `ready`); the chat's
    engine answers on it from then on (`decoding.graph_stream`). `max_slots`: the most value slots of a memory it
    may recall (the chat's `memory.max_slots`)."""
    base = unwrap_model(model)
    decoder = getattr(base, _ATTR, None)
    if decoder is None:
        decoder = GraphDecoder(model, batch=1, **step_options)
        object.__setattr__(base, _ATTR, decoder)  # not a submodule: kept out of state_dict and .to()
    decoder.max_slots = max_slots
    return decoder


def attached(model: torch.nn.Module) -> GraphDecoder | None:
    """The decoder `enable` attached to the model, warmed up or not."""
    return getattr(unwrap_model(model), _ATTR, None)

"""A decode step on fixed device buffers, replayed as a CUDA graph, and a host loop that never waits for it.

`GraphStep` holds one transformers `StaticCache` (B rows, `max_len` positions) and the step's inputs as
preallocated device tensors: token ids [B, W], an injection vector [B, W, H] and a flag [B, W] (a
`<|memory_pad|>` slot is `where(flag, vector, embed(id))`, so a memory is one more replay of the same
graph), positions [B, W] and the column whose state is wanted [B]. The backbone and the head run inside
the step: it returns that column's final state [B, H] and float32 logits [B, V]. It is compiled with
`torch.compile(mode="reduce-overhead")` (inductor + CUDA graphs, as gpt-fast and transformers' static-cache
`generate` do) for two widths: W = 1, a token a row, and W = `span`, a recalled memory's slots and its
suffix in one forward (a shorter span is padded on the right and the cache's write position moved back
over the padding; a longer one takes several). The cache and the input buffers are marked static
addresses, so a replay copies nothing in. Outputs of a CUDA graph are overwritten by its next replay:
whatever outlives a step is copied out first (the sampled token into the input buffer, a recall query
cloned).

`GraphDecoder.stream` is the host loop (gpt-fast's `decode_n_tokens` with the read-back of mlx-lm's
`generate_step`): each step's processors (the request's transformers `LogitsProcessorList`, fed a device
copy of the sequence) and the draw (`sampling.draw`: argmax, or the exponential race instead of
`torch.multinomial`) run on the device; the sampled tokens are copied to pinned host memory without
waiting, and the host reads step n's tokens only after step n+1 is queued, so the device never waits for
the host, and a stop (EOS, the length, an interrupt) ends the request one step later at most. A recall
(batch 1) is the one exception: the read-back shows `<recall>` while the step that took it as input is
already queued; that step's final state is the memory head's query (exact search on the device,
`MemoryVectorDB.topk`), its sampled token is dropped, and choosing the memory reads its k scores back
(the host needs the memory's slot count).

What stays out: Qwen3-VL's mRoPE positions, padded batches, rows recalling in a batch, stop strings and
the processors that synchronise (`NoRepeatNGram...`, `PrefixConstrained...`: they run, but wait for the
device). This decoder is the standalone engine of `bench/gpu.py` and `tests/decoding/test_graph.py`; the
chat's loop (`decoding/loop.py`) does not use it yet.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator

import torch
from transformers import LogitsProcessorList, StaticCache

from decoding.memory import MemorySelector, Recall, recall_step
from decoding.processors import build_logits_processor
from decoding.sampling import draw
from decoding.settings import GenerationSettings
from models.modeling import backbone_and_head, head_logits, unwrap_model

SPAN = 32  # positions of the wide graph: a recalled memory's slots and its suffix in one replay


@dataclass(frozen=True)
class Inputs:
    """One graph's input buffers (device tensors, written in place between replays)."""

    ids: torch.Tensor  # [B, W] int64
    vector: torch.Tensor  # [B, W, H] model dtype: what a flagged position gets instead of its token's embedding
    flag: torch.Tensor  # [B, W] bool
    position: torch.Tensor  # [B, W] int64
    last: torch.Tensor  # [B] int64: the column whose state and logits come out

    @classmethod
    def zeros(cls, batch: int, width: int, hidden: int, device, dtype) -> "Inputs":
        made = cls(torch.zeros((batch, width), dtype=torch.long, device=device),
                   torch.zeros((batch, width, hidden), dtype=dtype, device=device),
                   torch.zeros((batch, width), dtype=torch.bool, device=device),
                   torch.zeros((batch, width), dtype=torch.long, device=device),
                   torch.zeros(batch, dtype=torch.long, device=device))
        for t in made.tensors():
            torch._dynamo.mark_static_address(t)  # replayed in place: never copied into the graph's own inputs
        return made

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.ids, self.vector, self.flag, self.position, self.last


class GraphStep:
    """The step on one static cache of `batch` rows and `max_len` positions; `compile=False` runs it eagerly
    (the same code: what the CPU tests compare against the loop)."""

    def __init__(self, model: torch.nn.Module, *, batch: int = 1, max_len: int = 1024, span: int = SPAN,
                 compile: bool = True, mode: str = "reduce-overhead"):
        self.model = model
        self.backbone, self.head = backbone_and_head(model)
        if hasattr(self.backbone, "get_rope_index"):
            raise ValueError(f"{type(self.backbone).__name__} takes mRoPE positions [4, B, S]: the graph step feeds "
                             "plain positions [B, S] (decode it with decoding.loop)")
        base = unwrap_model(model)
        self.embed = base.get_input_embeddings()
        param = next(base.parameters())
        self.device, self.dtype = param.device, param.dtype
        config = base.config.get_text_config(decoder=True)
        self.batch, self.max_len, self.span = batch, max_len, span
        self.cache = StaticCache(config=config, max_cache_len=max_len)
        self.one = Inputs.zeros(batch, 1, config.hidden_size, self.device, self.dtype)
        self.wide = Inputs.zeros(batch, span, config.hidden_size, self.device, self.dtype)
        self.offsets = torch.arange(span, device=self.device)  # [W]
        self.length = 0  # positions the cache holds (counted on the host)
        self.compiled = compile
        self.graphs = compile and self.device.type == "cuda"
        self._fn = torch.compile(self._forward, mode=mode, dynamic=False) if compile else self._forward
        self.compile_seconds: float | None = None

    def _forward(self, ids: torch.Tensor, vector: torch.Tensor, flag: torch.Tensor, position: torch.Tensor,
                 last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = torch.where(flag[..., None], vector, self.embed(ids))  # [B, W, H]
        out = self.backbone(inputs_embeds=embeds, position_ids=position, past_key_values=self.cache,
                            use_cache=True).last_hidden_state  # [B, W, H]
        hidden = out.gather(1, last[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]  # [B, H]
        return hidden, head_logits(self.model, self.head, hidden)

    @torch.no_grad()
    def _run(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs are dead (copied out)
        return self._fn(*inputs.tensors())

    @torch.no_grad()
    def prefill(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start over: the prompt's embeddings [B, L, H] run eagerly from position 0; (the last state [B, H],
        logits [B, V]). The next step's input position is L."""
        b, n = embeds.shape[:2]
        if b != self.batch or n >= self.max_len:
            raise ValueError(f"prompt of {b} rows x {n} positions; this step holds {self.batch} rows x "
                             f"{self.max_len} positions")
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.zero_()
        positions = torch.arange(n, device=self.device).expand(b, -1)
        hidden = self.backbone(inputs_embeds=embeds, position_ids=positions, past_key_values=self.cache,
                               use_cache=True).last_hidden_state[:, -1]
        self.length = n
        self.one.position.fill_(n)
        return hidden, head_logits(self.model, self.head, hidden)

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One position a row: the token in `one.ids` at `one.position` -> (state [B, H], logits [B, V]), the
        graph's own output buffers (valid until the next replay)."""
        if self.length + 1 > self.max_len:
            raise ValueError(f"the static cache is full ({self.max_len} positions)")
        out = self._run(self.one)
        self.one.position.add_(1)
        self.length += 1
        return out

    def forward_span(self, tokens: list[int], vectors: dict[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forced positions from `one.position` on, the same for every row: `tokens`, with `vectors[i]` [H] (model
        dtype, on the device) in place of token i's embedding; (the last one's state [B, H], logits [B, V])."""
        if self.length + self.span > self.max_len:  # the padded width is written before it is cropped
            raise ValueError(f"no room for a span of {len(tokens)} in the static cache ({self.length} of "
                             f"{self.max_len} positions held)")
        out = None
        for start in range(0, len(tokens), self.span):
            part = tokens[start:start + self.span]
            n, w = len(part), self.wide
            w.ids.zero_()
            w.ids[:, :n] = torch.tensor(part, device=self.device)
            w.flag.zero_()
            for i in range(n):
                if start + i in vectors:
                    w.flag[:, i] = True
                    w.vector[:, i] = vectors[start + i]
            torch.add(self.one.position, self.offsets, out=w.position)  # [B, W]: this span's positions
            w.last.fill_(n - 1)
            out = self._run(w)
            for layer in self.cache.layers:  # forget the padding: its keys are overwritten before they are read
                layer.cumulative_length.sub_(self.span - n)
            self.one.position.add_(n)
            self.length += n
        return out

    def warm_up(self, prompt: int = 4) -> float:
        """Compile and record both graphs on a dummy prompt (three calls each: warm-up, record, replay); the
        cache is left empty. Returns the seconds it took."""
        t0 = time.perf_counter()
        with torch.no_grad():
            self.prefill(self.embed(torch.zeros((self.batch, prompt), dtype=torch.long, device=self.device)))
            for _ in range(3):
                self.step()
            for _ in range(3):
                self.forward_span([0, 0], {0: torch.zeros(self.embed.weight.shape[1], device=self.device,
                                                          dtype=self.dtype)})
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        self.length = 0
        for layer in self.cache.layers:
            layer.cumulative_length.zero_()
        self.compile_seconds = time.perf_counter() - t0
        return self.compile_seconds


class ReadBack:
    """Each step's tokens [B] copied to pinned host memory without waiting; read (waiting for that copy
    alone) a step later. Two slots: the token being read and the one queued behind it."""

    def __init__(self, rows: int, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.zeros((2, rows), dtype=torch.long, pin_memory=cuda)
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.next = 0

    def push(self, tokens: torch.Tensor) -> int:
        slot, self.next = self.next, 1 - self.next
        self.host[slot].copy_(tokens, non_blocking=True)
        if self.events[slot] is not None:
            self.events[slot].record()
        return slot

    def read(self, slot: int) -> list[int]:
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        return self.host[slot].tolist()


@dataclass
class Decoded:
    """What `GraphDecoder.generate` made: per row its new tokens (sampled and forced), and how it ended."""

    tokens: list[list[int]]
    finish: str  # stop (every row at EOS) | length | interrupted
    recalls: list = field(default_factory=list)  # RecallEvent of each injection
    memory_vectors: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> value vector (row 0)
    logits: list[torch.Tensor] = field(default_factory=list)  # with keep_logits: [B, V] of each sampled step
    positions: list[int] = field(default_factory=list)  # with keep_logits: the position each of them scored from
    steps: int = 0  # replays launched (a dropped step, one after the stop, included)
    ttft: float = 0.0  # seconds to the first token on the host


class GraphDecoder:
    """Requests of `batch` equal-length rows on one `GraphStep` (its cache is reused: one request at a time)."""

    def __init__(self, model: torch.nn.Module, **step_options):
        self.graph = GraphStep(model, **step_options)
        self.launch_guard: Callable[[], ContextManager] = contextlib.nullcontext  # around each step's launch (tests)

    def warm_up(self) -> float:
        return self.graph.warm_up()

    def stream(self, input_ids: torch.Tensor, settings: GenerationSettings = GenerationSettings(), *,
               recall: Recall | None = None, eos_token_id: int | list[int] | None = None, pad_token_id: int = 0,
               interrupt: threading.Event | None = None, keep_logits: bool = False,
               out: Decoded | None = None) -> Iterator[list[int]]:
        """Yield each position's tokens [B] (host ints) as the host reads them back, a step behind the device;
        forced span tokens as soon as they are known. `out` (a `Decoded`) collects recalls, logits and counts."""
        g, out = self.graph, out if out is not None else Decoded([], "length")
        t0 = time.perf_counter()
        rows, length = input_ids.shape
        if rows != g.batch:
            raise ValueError(f"input_ids has {rows} rows; this decoder was built for {g.batch}")
        recall_on = recall is not None and recall.active
        if recall_on and rows != 1:
            raise ValueError(f"recall in the graph decoder takes one row, got {rows} (decode them with decoding.loop)")
        seq = torch.zeros((rows, g.max_len), dtype=torch.long, device=g.device)  # the processors' input_ids
        seq[:, :length] = input_ids.to(g.device)
        cur = length  # columns of `seq` written
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        processors = build_logits_processor(settings, eos_token_id=eos or None, prompt_ids=seq[:, :length],
                                            vocab_size=g.embed.weight.shape[0])
        generator = None if settings.seed is None else torch.Generator(g.device).manual_seed(settings.seed)
        selector = MemorySelector.of(recall, None if settings.seed is None else
                                     torch.Generator().manual_seed(settings.seed)) if recall_on else None
        masked = rows > 1 and bool(eos)  # finished rows of a batch go on with padding, decided on the device
        eos_t = torch.tensor(eos or [-1], device=g.device)
        unfinished = torch.ones(rows, dtype=torch.bool, device=g.device)
        readback = ReadBack(rows, g.device)

        def pick(logits: torch.Tensor, processors: LogitsProcessorList = processors) -> torch.Tensor:
            nonlocal unfinished
            if keep_logits:
                out.logits.append(logits.clone())
                out.positions.append(cur - 1)
            scores = processors(seq[:, :cur], logits) if processors else logits
            tokens = draw(scores, settings.do_sample, generator)  # [B]
            if masked:
                tokens = torch.where(unfinished, tokens, pad_token_id)
                unfinished = unfinished & ~torch.isin(tokens, eos_t)
            return tokens

        def commit(tokens: torch.Tensor) -> int:
            nonlocal cur
            g.one.ids.copy_(tokens[:, None])
            seq[:, cur].copy_(tokens)
            cur += 1
            return readback.push(tokens)

        def recall_span(hidden: torch.Tensor) -> tuple[list[int], int]:
            """Recall at the newest position (its final state `hidden` [1, H]); forward the memory's slots and
            suffix; (the forced tokens, the read-back slot of the token sampled after them)."""
            nonlocal cur
            tokens, vectors, event = recall_step(selector, recall, hidden[0], 0, cur)
            out.recalls.append(event)
            out.memory_vectors.update(vectors)
            seq[:, cur:cur + len(tokens)] = torch.tensor(tokens, device=g.device)
            cur += len(tokens)
            slots = {p - event.position: v for p, v in vectors.items()}
            embedded = recall.embed(torch.stack([slots[i] for i in sorted(slots)]), g.device, g.dtype)  # [k, H]
            _, logits = g.forward_span(tokens, dict(zip(sorted(slots), embedded)))
            out.steps += 1
            return tokens, commit(pick(logits))

        out.tokens = [[] for _ in range(rows)]
        done = [False] * rows
        with torch.no_grad():
            hidden, logits = g.prefill(g.embed(seq[:, :length]))
            if recall_on and int(input_ids[0, -1]) == recall.recall_id:  # the prompt ends with <recall>
                pick(logits)  # drawn and dropped, as the loop draws a token and forces the span instead
                forced, pending = recall_span(hidden)
                for t in forced:
                    out.tokens[0].append(t)
                    yield [t]
                made = len(forced)
            else:
                pending, made = commit(pick(logits)), 0
            while True:
                queued = None
                if made + 1 < settings.max_new_tokens and g.length + 1 < g.max_len:
                    with self.launch_guard():
                        hidden, logits = g.step()  # input: the pending token, already in `one.ids`
                        if recall_on:
                            hidden = hidden.clone()
                        queued = commit(pick(logits))
                    out.steps += 1
                tokens = readback.read(pending)  # the device is already busy with the step queued behind it
                if not out.ttft:
                    out.ttft = time.perf_counter() - t0
                made += 1
                for row, t in enumerate(tokens):
                    if not done[row]:
                        out.tokens[row].append(t)
                        done[row] = t in eos
                yield tokens
                if all(done):
                    out.finish = "stop"
                    break
                if made >= settings.max_new_tokens or queued is None:
                    out.finish = "length"
                    break
                if interrupt is not None and interrupt.is_set():
                    out.finish = "interrupted"
                    break
                if recall_on and tokens[0] == recall.recall_id:  # the queued step took <recall>: its state is the
                    cur -= 1  # query, and the token it sampled is dropped
                    forced, queued = recall_span(hidden)
                    for t in forced:
                        out.tokens[0].append(t)
                        yield [t]
                    made += len(forced)
                    if made >= settings.max_new_tokens:  # (the span is forced whole, as the loop forces it)
                        out.finish = "length"
                        break
                pending = queued

    def generate(self, input_ids: torch.Tensor, settings: GenerationSettings = GenerationSettings(),
                 **kwargs) -> Decoded:
        """`stream` run to the end."""
        out = Decoded([], "length")
        for _ in self.stream(input_ids, settings, out=out, **kwargs):
            pass
        return out

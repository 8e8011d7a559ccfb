"""The geometric mixture q* of two models with one tokenizer (seed 003), drawn directly or by exact
speculative sampling (`decoding.speculative`).

    q_α(x) ∝ π_θ(x)^α · π_t(x)^(1-α),   α* solves KL(q_α ‖ π_θ) = KL(q_α ‖ π_t)   (per row and step)

With D = log π_t - log π_θ: δ(α) = KL(q_α‖π_θ) - KL(q_α‖π_t) = E_{q_α}[D] and δ'(α) = -Var_{q_α}(D) <= 0,
δ(0) = KL(π_t‖π_θ) >= 0, δ(1) = -KL(π_θ‖π_t) <= 0: δ is monotone with a root in [0, 1], found by
Newton's method kept inside a bisection bracket (`solve_alpha`), in float64, to `tol`. A fixed α is
decoding-time realignment (DeRa: Liu et al. 2024, "Decoding-time Realignment of Language Models";
the same product of experts as Hinton 2002): α = 1 is π_θ, α = 0 is π_t.

Conventions: temperature and the request's logits processors act on both models' logits alike
before mixing. q* lives on S = supp π_θ ∩ supp π_t (a token masked in either has q* = 0); the KL
balance uses both models conditioned on S (the plain balance when nothing is masked, and the form
that always has a root). π_θ = π_t on S: every α solves, α* = 0.5. S empty: q* = π_θ, α* = 1.

The seed's "speculative" scheme (k candidates from π_θ, the first kept with min(1, q*/π_θ), else a
draw from q*) is not exact (on π_θ = (.9, .1), q* = (.5, .5) it samples (.70, .30) at k = 1) and
is not used anywhere; Leviathan et al.'s rule is.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from decoding.events import DoneEvent, FinishEvent, GenerationResult, PrefillEvent, TokenEvent
from decoding.loop import TOOL_CALL_END
from decoding.memory import MemorySelector, NoMemory, Recall, recall_step
from decoding.processors import build_logits_processor, build_stopping_criteria
from decoding.settings import GenerationSettings, MixtureSettings
from decoding.speculative import HeadDraft, ModelDraft, ModelPair, PairDraft, make_draft, process_block, speculative_round

from decoding.request import Detokenizer, generators
from models.modeling import check_bank_dim, max_positions, unwrap_model

MASKED = -1e30  # scores at or below this count as masked (transformers masks with -inf or finfo.min)
ATOL = 1e-12  # |δ| below this is a root (float64)

# ---- q* (pure, batched over any leading dims) ---------------------------------------------------


def common_support(scores_theta: torch.Tensor, scores_t: torch.Tensor):
    """(log π_θ|S, log π_t|S [..., V] float64, S [..., V] bool or None for "no token masked", empty [...]).

    Both log-softmaxes of the processed scores [..., V] are conditioned on S = the tokens neither
    model masks; a row with S empty gets S = supp π_θ and π_t := π_θ there (so q* = π_θ)."""
    keep_theta, keep_t = scores_theta > MASKED, scores_t > MASKED
    common = keep_theta & keep_t
    if bool(common.all()):  # the common case without top-k / top-p / bans: nothing to condition on
        empty = torch.zeros(common.shape[:-1], dtype=torch.bool, device=common.device)
        return torch.log_softmax(scores_theta.double(), -1), torch.log_softmax(scores_t.double(), -1), None, empty
    empty = ~common.any(-1)
    common = torch.where(empty[..., None], keep_theta, common)
    lp = torch.log_softmax(scores_theta.double().masked_fill(~common, -math.inf), -1)
    lr = torch.log_softmax(scores_t.double().masked_fill(~common, -math.inf), -1)
    return lp, torch.where(empty[..., None], lp, lr), common, empty


def mix(lp: torch.Tensor, lr: torch.Tensor, common: torch.Tensor | None, alpha: torch.Tensor) -> torch.Tensor:
    """log q_α [..., V] = log_softmax(α log π_θ + (1-α) log π_t) on S, -inf off S; alpha [...]."""
    a = alpha.to(lp.dtype)[..., None]
    if common is None:
        return torch.log_softmax(a * lp + (1 - a) * lr, -1)
    z = a * lp.masked_fill(~common, 0) + (1 - a) * lr.masked_fill(~common, 0)
    return torch.log_softmax(z.masked_fill(~common, -math.inf), -1)


def _compress(lp, lr, common):
    """Keep only the columns some row's S uses (e.g. top-k): [N, V] -> [N, k], when k < V / 2."""
    k = int(common.sum(-1).max()) if common.numel() else 0
    if not 0 < k < common.shape[-1] // 2:
        return lp, lr, common
    cols = common.to(torch.float32).topk(k, -1).indices  # [..., k]
    return lp.gather(-1, cols), lr.gather(-1, cols), common.gather(-1, cols)


def solve_alpha(lp, lr, common=None, tol: float = 1e-6, max_iter: int = 100) -> torch.Tensor:
    """α* [...] float64 with δ(α*) = 0, for conditioned log-probabilities [..., V] (`common_support`).

    Safeguarded Newton in float64: δ' = -Var_q(D) gives the step, a bracket [lo, hi] with
    δ(lo) > 0 > δ(hi) falls back to bisection when a step leaves it or the variance vanishes;
    stops when every row moves less than `tol` (Newton converges quadratically, so the error is
    then far below tol). δ ≡ 0 (π_θ = π_t on S) stops at the start, α* = 0.5."""
    if common is not None:
        lp, lr, common = _compress(lp, lr, common)
    d = lr - lp if common is None else (lr - lp).masked_fill(~common, 0)  # D on S  [..., k]
    base = lr if common is None else lr.masked_fill(~common, -math.inf)  # log q_α = base - α D + const
    alpha = torch.full(d.shape[:-1], 0.5, dtype=torch.float64, device=d.device)
    lo, hi = torch.zeros_like(alpha), torch.ones_like(alpha)
    for _ in range(max_iter):
        q = torch.softmax(base - alpha[..., None] * d, -1)
        qd = q * d
        delta = qd.sum(-1)
        var = ((qd * d).sum(-1) - delta ** 2).clamp_min(0)
        lo, hi = torch.where(delta > 0, alpha, lo), torch.where(delta < 0, alpha, hi)
        newton = alpha + delta / var.clamp_min(1e-300)
        step = torch.where((var > 0) & (newton > lo) & (newton < hi), newton, (lo + hi) / 2)
        step = torch.where(delta.abs() <= ATOL, alpha, step)
        moved = (step - alpha).abs()
        alpha = step
        if bool((moved <= tol).all()):
            break
    return alpha


def mixture_log_probs(scores_theta: torch.Tensor, scores_t: torch.Tensor, alpha: str | float = "auto",
                      tol: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(log q* [..., V] float32, α [...] float64) from both models' processed scores [..., V]."""
    lp, lr, common, empty = common_support(scores_theta, scores_t)
    if alpha == "auto":
        a = solve_alpha(lp, lr, common, tol)
    else:
        a = torch.full(lp.shape[:-1], float(alpha), dtype=torch.float64, device=lp.device)
    a = torch.where(empty, torch.ones_like(a), a)
    return mix(lp, lr, common, a).float(), a


# ---- settings, event, result -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class MixtureEvent:
    """One verify round: α* of each token it emitted (from `position` on), and the draft's fate."""

    position: int
    alphas: tuple[float, ...]
    drafted: int
    accepted: int


@dataclass
class MixtureResult(GenerationResult):
    alphas: list[float] = field(default_factory=list)  # α* per generated token; nan for a forced <|memory_pad|>
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0  # verify forwards

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def tokens_per_round(self) -> float:
        """Tokens drawn from q* per verify forward (forced <|memory_pad|> tokens left out)."""
        return sum(a == a for a in self.alphas) / self.rounds if self.rounds else math.nan


# ---- the streaming loop (batch of one) ---------------------------------------------------------


class _Run:
    """One request: the sequence, the pair's caches (all but the last token), memories, events."""

    def __init__(self, pair, seq, settings, mixture, recall, tokenizer, processors, criteria, eos, limit, memory,
                 rngs):
        self.pair, self.seq, self.settings, self.mixture = pair, seq, settings, mixture
        self.recall, self.processors, self.criteria, self.eos, self.limit = recall, processors, criteria, eos, limit
        self.memory = memory  # position -> memory vector (raw, as the bank stores it)
        self.detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self.active = recall is not None and recall.active  # recall on; else recall only places memories
        self.generator, memory_generator = rngs  # a seeded request's own random states (tokens, memories)
        self.selector = MemorySelector.of(recall, memory_generator) if self.active else None
        self.alphas, self.injections, self.reason = [], [], None
        self.drafted = self.accepted = self.rounds = 0
        self.t0 = time.perf_counter()

    def embedded(self, position: int) -> torch.Tensor:
        return self.recall.embed(self.memory[position][None], self.pair.device, self.pair.dtype)[0]

    def prefill(self, chunk: int) -> Iterator[PrefillEvent]:
        """All but the last prompt token into both caches, `chunk` tokens at a time."""
        todo = len(self.seq) - 1
        for start in range(0, todo, chunk):
            end = min(todo, start + chunk)
            inject = {p - start: self.embedded(p) for p in self.memory if start <= p < end}
            self.pair.run(self.seq[start:end], inject, logits=False)
            yield PrefillEvent(end, todo)

    def emit(self, token: int, alpha: float, events: list) -> bool:
        """Append a token; True when the row finished with it."""
        self.seq.append(token)
        self.alphas.append(alpha)
        text = self.detok.push(token) if self.detok is not None else ""
        events.append(TokenEvent(0, token, len(self.seq) - 1, text))
        if self.settings.early_stop_on_tool_call and self.detok is not None and TOOL_CALL_END in self.detok.tail:
            self.reason = "tool_call"
        elif len(self.seq) >= self.limit or bool(self.criteria(torch.tensor([self.seq]), None)[0]):
            late = self.settings.max_time is not None and time.perf_counter() - self.t0 > self.settings.max_time
            self.reason = "stop" if token in self.eos else "length" if len(self.seq) >= self.limit or late else "stop"
        if self.reason is not None:
            events.append(FinishEvent(0, self.reason))
        return self.reason is not None

    def recall_step(self, events: list) -> None:
        """The newest token is <recall>: its θ hidden state queries the bank; the memory's slots (and the suffix)
        follow whole, their value vectors in both models' caches but for the last token, as always."""
        self.pair.crop(len(self.seq) - 1)
        _, hidden = self.pair.run([self.seq[-1]], logits=False)  # [1, H]
        start = len(self.seq)
        span, vectors, event = recall_step(self.selector, self.recall, hidden[-1], 0, start)
        self.memory.update(vectors)
        self.injections.append(event)
        events.append(event)
        for token in span[:-1]:  # a memory is never cut: the finish checks wait for its last token
            self.seq.append(token)
            self.alphas.append(math.nan)
            events.append(TokenEvent(0, token, len(self.seq) - 1, self.detok.push(token) if self.detok else ""))
        self.emit(span[-1], math.nan, events)
        if len(span) > 1:
            self.pair.run(span[:-1], {p - start: self.embedded(p) for p in vectors if p < start + len(span) - 1},
                          logits=False)

    def target(self, seq, drafts, logits):
        theta, t = process_block(self.processors, seq, drafts, logits)
        return mixture_log_probs(theta, t, self.mixture.alpha, self.mixture.tol)

    def round(self, draft, events: list) -> None:
        seq, last = self.seq, len(self.seq) - 1
        gamma = min(self.mixture.gamma, self.limit - len(seq) - 1)
        memory = {p: self.embedded(p) for p in self.memory} if isinstance(draft, (ModelDraft, PairDraft, HeadDraft)) else {}
        inject = {0: self.embedded(last)} if last in self.memory else {}
        rnd = speculative_round(list(seq), self.pair, draft, gamma, self.target, self.settings.do_sample,
                                processors=self.processors, memory=memory, inject=inject, generator=self.generator)
        start = len(seq)
        for token, alpha in zip(rnd.tokens, rnd.alphas):
            if self.emit(token, alpha, events) or self.active and token == self.recall.recall_id:
                break
        self.pair.crop(len(self.seq) - 1)  # a stop or a <recall> cut the round short
        self.drafted, self.accepted, self.rounds = self.drafted + rnd.drafted, self.accepted + rnd.accepted, self.rounds + 1
        emitted = len(self.seq) - start
        events.append(MixtureEvent(start, tuple(self.alphas[-emitted:]), rnd.drafted, rnd.accepted))

    def recall_due(self) -> bool:
        return self.reason is None and self.active and self.seq[-1] == self.recall.recall_id


def _check_request(inputs, settings: GenerationSettings) -> torch.LongTensor:
    input_ids = inputs["input_ids"]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: the mixture streams one row ([1, L])")
    mask = inputs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("the mixture takes an unpadded prompt: attention_mask must be all ones")
    if inputs.get("pixel_values") is not None or inputs.get("image_grid_thw") is not None:
        raise ValueError("the mixture reads text only: images are not supported")
    if settings.guidance_scale != 1:
        raise ValueError(f"guidance_scale is {settings.guidance_scale}: classifier-free guidance runs its own model "
                         "and is not supported with the mixture (set guidance_scale=1.0)")
    return input_ids


def stream_mixture(model_theta, model_t, inputs: Mapping[str, torch.Tensor],
                   settings: GenerationSettings = GenerationSettings(),
                   mixture: MixtureSettings = MixtureSettings(enabled=True), *, recall: Recall | None = None,
                   tokenizer=None, interrupt: threading.Event | None = None, eos_token_id=None, pad_token_id=None,
                   memory_vectors: Mapping[int, torch.Tensor] | None = None,
                   logits_processor: LogitsProcessorList | None = None,
                   stopping_criteria: StoppingCriteriaList | None = None, batched: bool = True,
                   prefill_chunk: int = 512, draft_head: torch.nn.Module | None = None,
                   draft_gguf=None) -> Iterator:
    """Generate one row from q*(π_θ = model_theta, π_t = model_t, or its PEFT base when None), yielding
    the main loop's PrefillEvent / TokenEvent / RecallEvent / FinishEvent, a `MixtureEvent` per verify
    round, and a `DoneEvent` whose result is a `MixtureResult` (α* per token, acceptance counts) last.

    A `<recall>` drawn from q* makes θ's hidden state at it query the bank; the memory is injected at
    the next position (`<|memory_pad|>`) of both models. `memory_vectors` places earlier turns'
    memories; the whole prompt is prefilled, `prefill_chunk` tokens at a time (no cache reuse;
    `result.cache` is None). `batched`: one forward for a PEFT pair, whose adapter is unmerged for
    it (a merged adapter cannot be switched off per row). `draft_head`: the trained DraftHead that
    `mixture.draft="head"` drafts with; `draft_gguf`: the llama_cpp.Llama of `mixture.draft="gguf"`
    (models.gguf.load_gguf_draft). A seed gives the request its own random
    state (the global one is not touched). `pad_token_id` is unused (one row).
    """
    input_ids = _check_request(inputs, settings)
    pair = ModelPair(model_theta, model_t, batched=batched)
    seq, prompt_len = input_ids[0].tolist(), input_ids.shape[1]
    context = max_positions(model_theta)
    if context is not None and prompt_len >= context:
        raise ValueError(f"the prompt has {prompt_len} tokens but the model's context holds {context}")
    config = unwrap_model(model_theta).generation_config
    eos = eos_token_id if eos_token_id is not None else config.eos_token_id
    eos = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])]
    recall_on = recall is not None and recall.active
    if recall is not None:
        recall = recall.with_tokens(unwrap_model(model_theta).get_input_embeddings())
    if memory_vectors and recall is None:
        raise ValueError("memory_vectors were given without recall=Recall(...): placing them needs the "
                         "<|memory_pad|> id and the model's memory embedding")
    if recall_on:
        check_bank_dim(model_theta, recall.bank, recall.query)
    if logits_processor is None:
        logits_processor = build_logits_processor(settings, eos_token_id=eos or None, prompt_ids=input_ids.to(pair.device),
                                                  device=pair.device, vocab_size=pair.vocab)
    no_memory = NoMemory.of(recall, recall_on)
    if no_memory is not None:
        logits_processor = LogitsProcessorList([*logits_processor, no_memory])
    criteria = build_stopping_criteria(settings, prompt_length=prompt_len, eos_token_id=eos or None,
                                       tokenizer=tokenizer, max_position_embeddings=context)
    criteria.extend(stopping_criteria or [])
    limit = min(prompt_len + settings.max_new_tokens, context or math.inf)
    run = _Run(pair, seq, settings, mixture, recall, tokenizer, logits_processor, criteria, eos, limit,
               dict(memory_vectors or {}), generators(settings.seed, pair.device))
    draft = (make_draft(mixture.draft, pair, model_theta, mixture.ngram, draft_head, draft_gguf)
             if mixture.speculative else None)
    yield from _drive(run, draft, interrupt, prompt_len, prefill_chunk, no_memory)


@torch.no_grad()  # as a decorator: grad mode is off only while this generator runs, not between its yields
def _drive(run: _Run, draft, interrupt, prompt_len: int, prefill_chunk: int, no_memory: NoMemory | None) -> Iterator:
    prefill_s, t1 = 0.0, run.t0
    if interrupt is not None and interrupt.is_set():  # stopped while queued: the models are not touched
        run.reason = "interrupted"
        yield FinishEvent(0, "interrupted")
    if run.reason is None:
        for event in run.prefill(prefill_chunk):  # other requests, and a stop, wait one chunk at most
            yield event
            if interrupt is not None and interrupt.is_set():
                run.reason = "interrupted"
                yield FinishEvent(0, "interrupted")
                break
        prefill_s, t1 = time.perf_counter() - run.t0, time.perf_counter()
    while run.reason is None:
        events: list = []
        if run.recall_due():  # the prompt ends with <recall>
            run.recall_step(events)
        if run.reason is None:
            run.round(draft, events)
        if run.recall_due():  # right away, so an interrupt never separates <recall> from its memory
            run.recall_step(events)
        yield from events
        if run.reason is None and interrupt is not None and interrupt.is_set():
            run.reason = "interrupted"
            yield FinishEvent(0, "interrupted")
    run.pair.reset()
    yield DoneEvent(MixtureResult(
        sequences=torch.tensor([run.seq], device=run.pair.device), prompt_length=prompt_len,
        finish_reasons=[run.reason], injections=run.injections, memory_vectors=[run.memory], cache=None,
        prefill_seconds=prefill_s, decode_seconds=time.perf_counter() - t1, steps=run.rounds, alphas=run.alphas,
        drafted=run.drafted, accepted=run.accepted, rounds=run.rounds,
        missed_recall=no_memory.rows(1) if no_memory is not None else None))


def generate_mixture(*args, **kwargs) -> MixtureResult:
    """`stream_mixture` run to the end."""
    for event in stream_mixture(*args, **kwargs):
        if isinstance(event, DoneEvent):
            return event.result
    raise RuntimeError("generation ended without a result")


# ---- seed 003's surface ------------------------------------------------------------------------


class OptimalSpeculativeDecoder:
    """Seed 003's class, now exact: `generate` draws from q* with Leviathan et al.'s rule, k = γ drafts
    per verify from π_θ (as the seed meant, with θ's logits reused by the verify when the two models run
    as two forwards), α* per step to `tol`. `model_t=None`: a PEFT model against its own base.
    `draft="gguf"` with `gguf=` a llama_cpp.Llama (models.gguf.load_gguf_draft) drafts with llama.cpp."""

    def __init__(self, model_theta, model_t=None, k: int = 5, tol: float = 1e-6, draft: str = "theta", gguf=None):
        if draft == "head":
            raise ValueError("OptimalSpeculativeDecoder drafts with theta, target, ngram or gguf; an EAGLE head goes "
                             "through stream_mixture(..., draft_head=...)")
        self.model_theta, self.model_t, self.k, self.tol, self.gguf = model_theta, model_t, k, tol, gguf
        self.mixture = MixtureSettings(enabled=True, speculative=True, gamma=k, tol=tol, draft=draft)

    def generate(self, input_ids: torch.LongTensor, max_length: int = 100, temperature: float = 1.0, *,
                 do_sample: bool | None = None, seed: int | None = None, pad_token_id: int = 0) -> torch.LongTensor:
        """[B, L] -> [B, L + max_length], row by row (EOS does not stop it, as in the seed; only the
        context length can, the rest is then `pad_token_id`); temperature 0 is greedy."""
        do_sample = temperature > 0 if do_sample is None else do_sample
        out = input_ids.new_full((input_ids.shape[0], input_ids.shape[1] + max_length), pad_token_id)
        out[:, :input_ids.shape[1]] = input_ids
        if max_length < 1:
            return out
        settings = GenerationSettings(do_sample=do_sample, temperature=temperature if do_sample else 1.0, top_k=0,
                                      max_new_tokens=max_length, seed=seed)
        for row in range(input_ids.shape[0]):
            result = generate_mixture(self.model_theta, self.model_t, {"input_ids": input_ids[row:row + 1]}, settings,
                                      self.mixture, eos_token_id=[], draft_gguf=self.gguf)
            out[row, :result.sequences.shape[1]] = result.sequences[0]
        return out

"""The geometric mixture q* of two models with one tokenizer (seed 003), drawn directly or by exact
speculative sampling (`decoding.speculative`, its drafts `decoding.drafts`).

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

import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch

from decoding.backend import require
from decoding.events import DoneEvent, GenerationResult, PrefillEvent
from decoding.memory import Recall
from decoding.request import Controls, Prompt, Request, prepare
from decoding.settings import GenerationSettings, MixtureSettings
from decoding.drafts import HeadDraft, ModelDraft, PairDraft, make_draft
from decoding.gamma import GammaSchedule, adaptive_k
from decoding.speculative import ModelPair, Sampling, process_block, speculative_round
from models.spec import MIXTURE

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
    """The mixture's decoder on a shared `decoding.request.Request` (one row): the pair's caches (all but the last
    token), the speculative rounds and α* per token. Tokens, finishes, recalls and the result are the request's."""

    def __init__(self, req: Request, pair: ModelPair, mixture: MixtureSettings):
        self.req, self.pair, self.mixture = req, pair, mixture
        self.alphas: list[float] = []
        self.schedule = GammaSchedule(mixture.gamma_rule, mixture.gamma)
        self.drafted = self.accepted = self.rounds = 0

    @property
    def seq(self) -> list[int]:
        rows = self.req.rows
        return rows.seq[0, :rows.cur].tolist()

    @property
    def done(self) -> bool:
        return not self.req.rows.alive[0]

    def embedded(self, position: int) -> torch.Tensor:
        req = self.req
        return req.recall.embed(req.rows.memory[0][position][None], self.pair.device, self.pair.dtype)[0]

    def prefill(self, chunk: int) -> Iterator[PrefillEvent]:
        """All but the last prompt token into both caches, `chunk` tokens at a time."""
        seq, todo = self.seq, self.req.rows.cur - 1
        for start in range(0, todo, chunk):
            end = min(todo, start + chunk)
            inject = {p - start: self.embedded(p) for p in self.req.rows.memory[0] if start <= p < end}
            self.pair.run(seq[start:end], inject, logits=False)
            yield PrefillEvent(end, todo)

    def emit(self, tokens: list[int], alphas: list[float], events: list) -> None:
        """Append tokens one at a time, each checked by the request's criteria (a stop in the middle of a round
        ends the row there): their events, through `Request.events`."""
        req, rows = self.req, self.req.rows
        for token, alpha in zip(tokens, alphas):
            rows.write(torch.tensor([[token]], device=rows.seq.device), [0])
            self.alphas.append(alpha)
            still = rows.cur < req.limit and not bool(req.criteria(rows.seq[:, :rows.cur], None)[0])
            events += req.events(0, [token], still)
            if self.done or req.recall_on and token == req.recall.recall_id:  # (a <recall> is answered next)
                return

    def recall_step(self, events: list) -> None:
        """The newest token is <recall>: its θ hidden state queries the bank; the memory's slots (and the suffix)
        follow whole, their value vectors in both models' caches but for the last token, as always."""
        req, rows = self.req, self.req.rows
        self.pair.crop(rows.cur - 1)
        _, hidden = self.pair.run([self.seq[-1]], logits=False)  # [1, H]
        start = rows.cur
        span, vectors, happened = req.recall_row(0, hidden[-1])
        rows.memory[0].update(vectors)
        events += happened
        if len(span) > 1:  # a memory is never cut: the finish checks wait for its last token
            rows.write(torch.tensor([span[:-1]], device=rows.seq.device), [0])
            self.alphas += [math.nan] * (len(span) - 1)
            events += req.events(0, span[:-1], True)
        self.emit([span[-1]], [math.nan], events)
        if len(span) > 1:
            self.pair.run(span[:-1], {p - start: self.embedded(p) for p in vectors if p < start + len(span) - 1},
                          logits=False)

    def target(self, seq, drafts, logits):
        theta, t = process_block(self.req.processors, seq, drafts, logits)
        return mixture_log_probs(theta, t, self.mixture.alpha, self.mixture.tol)

    def round(self, draft, events: list) -> None:
        req, seq = self.req, self.seq
        last = len(seq) - 1
        gamma = min(self.schedule.gamma, req.limit - len(seq) - 1)  # the rule's γ, within the length limit
        memory = ({p: self.embedded(p) for p in req.rows.memory[0]}
                  if isinstance(draft, (ModelDraft, PairDraft, HeadDraft)) else {})
        inject = {0: self.embedded(last)} if last in req.rows.memory[0] else {}
        sampling = Sampling(req.settings.do_sample, req.processors, req.rng)
        rnd = speculative_round(list(seq), self.pair, draft, gamma, self.target, sampling, memory=memory,
                                inject=inject)
        self.schedule.update(rnd.alphas, rnd.drafted, rnd.accepted)
        start = len(seq)
        self.emit(rnd.tokens, rnd.alphas, events)
        self.pair.crop(req.rows.cur - 1)  # a stop or a <recall> cut the round short
        self.drafted, self.accepted, self.rounds = self.drafted + rnd.drafted, self.accepted + rnd.accepted, self.rounds + 1
        emitted = req.rows.cur - start
        events.append(MixtureEvent(start, tuple(self.alphas[-emitted:]), rnd.drafted, rnd.accepted))

    def recall_due(self) -> bool:
        req = self.req
        return not self.done and req.recall_on and int(req.rows.seq[0, req.rows.cur - 1]) == req.recall.recall_id


def _check_request(inputs, settings: GenerationSettings) -> None:
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


def stream_mixture(model_theta, model_t, prompt: Prompt | Mapping[str, torch.Tensor],
                   settings: GenerationSettings = GenerationSettings(mixture=MixtureSettings(enabled=True)), *,
                   recall: Recall | None = None, tokenizer=None, interrupt: threading.Event | None = None,
                   controls: Controls = Controls()) -> Iterator:
    """Generate one row from q*(π_θ = model_theta, π_t = model_t, or its PEFT base when None) with
    `settings.mixture`, yielding the main loop's PrefillEvent / TokenEvent / RecallEvent / FinishEvent, a
    `MixtureEvent` per verify round, and a `DoneEvent` whose result is a `MixtureResult` (α* per token,
    acceptance counts) last.

    A `<recall>` drawn from q* makes θ's hidden state at it query the bank; the memory is injected at
    the next position (`<|memory_pad|>`) of both models. `prompt.memory_vectors` places earlier turns'
    memories; the whole prompt is prefilled, `controls.prefill_chunk` tokens at a time (no cache reuse;
    `result.cache` is None). `controls.batched_pair`: one forward for a PEFT pair, whose adapter is unmerged
    for it (a merged adapter cannot be switched off per row). `controls.draft_head`: the trained DraftHead
    that `mixture.draft="head"` drafts with; `controls.draft_gguf`: the llama.cpp model of
    `mixture.draft="gguf"` (models.gguf.load_gguf_draft). A seed gives the request its own random state (the
    global one is not touched).
    """
    prompt, mixture = Prompt.of(prompt), settings.mixture
    _check_request(prompt.inputs, settings)
    req = prepare(model_theta, prompt, settings, recall, tokenizer, controls, cached=False)
    require(req.fwd.spec, MIXTURE)
    pair = ModelPair(model_theta, model_t, batched=controls.batched_pair)
    run = _Run(req, pair, mixture)
    draft = (make_draft(mixture.draft, pair, model_theta, mixture.ngram, controls.draft_head, controls.draft_gguf)
             if mixture.speculative else None)
    yield from _drive(run, draft, interrupt, controls.prefill_chunk)


@torch.no_grad()  # as a decorator: grad mode is off only while this generator runs, not between its yields
def _drive(run: _Run, draft, interrupt, prefill_chunk: int) -> Iterator:
    req = run.req
    req.fwd.reset_request_state()
    t1 = req.t0
    if interrupt is not None and interrupt.is_set():  # stopped while queued: the models are not touched
        yield from req.stop_all()
    if not run.done:
        for event in run.prefill(prefill_chunk):  # other requests, and a stop, wait one chunk at most
            yield event
            if interrupt is not None and interrupt.is_set():
                yield from req.stop_all()
                break
        req.prefill_s, t1 = time.perf_counter() - req.t0, time.perf_counter()
    while not run.done:
        events: list = []
        if run.recall_due():  # the prompt ends with <recall>
            run.recall_step(events)
        if not run.done:
            run.round(draft, events)
        if run.recall_due():  # right away, so an interrupt never separates <recall> from its memory
            run.recall_step(events)
        yield from events
        if not run.done and interrupt is not None and interrupt.is_set():
            yield from req.stop_all()
    run.pair.reset()
    req.decode_s, req.steps = time.perf_counter() - t1, run.rounds
    yield DoneEvent(req.result(MixtureResult, alphas=run.alphas, drafted=run.drafted, accepted=run.accepted,
                               rounds=run.rounds))


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
    `draft="gguf"` with `gguf=` a llama.cpp model (models.gguf.load_gguf_draft) drafts with llama.cpp.
    `gamma_rule="seed"`: k per round by the seed's adaptive k (`_adaptive_k`; "acceptance" and "fixed" as in
    `MixtureSettings`)."""

    def __init__(self, model_theta, model_t=None, k: int = 5, tol: float = 1e-6, draft: str = "theta", gguf=None,
                 gamma_rule: str = "fixed"):
        if draft == "head":
            raise ValueError("OptimalSpeculativeDecoder drafts with theta, target, ngram or gguf; an EAGLE head goes "
                             "through stream_mixture(..., controls=Controls(draft_head=...))")
        self.model_theta, self.model_t, self.k, self.tol, self.gguf = model_theta, model_t, k, tol, gguf
        self.mixture = MixtureSettings(enabled=True, speculative=True, gamma=k, tol=tol, draft=draft,
                                       gamma_rule=gamma_rule)

    def _adaptive_k(self, alpha_star) -> int:
        """The seed's adaptive k around `k` from α* (a number, or a tensor whose mean is taken, as the seed's):
        `decoding.gamma.adaptive_k`, which `gamma_rule="seed"` applies each round to the last verified α*. (The
        seed's class sketches a shorter variant, mean α* > 0.7 or < 0.3 → min(10, k + 3), else k, that never
        shortens k; its `adaptive_k` function, with the bounds and thresholds, is the rule kept.)"""
        return adaptive_k(float(torch.as_tensor(alpha_star, dtype=torch.float64).mean()), self.k)

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
            result = generate_mixture(self.model_theta, self.model_t, {"input_ids": input_ids[row:row + 1]},
                                      dataclasses.replace(settings, mixture=self.mixture),
                                      controls=Controls(eos_token_id=[], draft_gguf=self.gguf))
            out[row, :result.sequences.shape[1]] = result.sequences[0]
        return out

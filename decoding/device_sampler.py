"""The request's processors and draw as tensor operations on fixed device buffers: the part of a decode step that
`decoding/graph.py` captures in the same CUDA graph as the forward, so a step is one replay and nothing else.

`DeviceSampler.configure` reads the request's transformers `LogitsProcessorList` (built by `decoding.processors`,
the order of `generate`) and returns a `Kind` when every processor has a tensor form here: one-token
`sequence_bias`, the repetition penalty (no left padding), the no-repeat n-gram ban (n up to `NGRAM_MAX`),
temperature, top-k, top-p, min-p and typical-p, in that order, and the chat's `decoding.memory.NoMemory` before the
warpers (its record of a wanted memory kept on the device, `wanted_at`), with the same operations (so the processed
scores are theirs); `None` otherwise (the documented fallback: multi-token sequence biases, bad words, min-length,
forced tokens, suppressions, epsilon/eta, watermarking, guidance; those run as transformers' processors on the
host's queue, outside the graph, and some of them synchronise). The penalty's counts and the n-gram ban's sequence
are kept on the device as the tokens are fed (`see`). The kind says which operations a graph holds; their values
(penalty, temperature, k, ...) live in buffers, so a new request with other values replays the same graph.

The draw is the Gumbel-max race: argmax(scores + G), G = -log(-log U), which picks i with probability
softmax(scores)_i (the law of `torch.multinomial`). U is a counter-based hash of (seed, the row's commits, lane,
token), so it needs no generator state: the same seed gives the same draws on a CPU, a GPU, eagerly or replayed.

Every value has one row per batch row: `configure` loads one request into all of them (rows of one request: lane =
the row), `configure_row` one request into one row (the rows of `decoding.graph_rows`, each its own request, lane
0, so a request draws the same tokens in any row as alone). A graph holds the union of its rows' kinds; a row
without an operation holds its neutral value (no bias, penalty 1, temperature 1, top-k = the vocabulary, a top-p
bound no sum reaches, min-p 0, n-gram size 0, a typical mass no sum reaches, nothing suppressed, no noise for a
greedy row), so its scores are exactly its own.

`commit` writes the chosen tokens where the next replay reads them (the step's input ids), masks the finished
rows of a batch (EOS then padding, decided on the device), and puts them in a ring of R steps copied to pinned
host memory without waiting: the host reads step n's tokens from slot n % R after that step's event.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper,
)

from decoding.memory import NoMemory

RING = 4  # steps of tokens kept for the host's read-back (it reads one step behind)
EOS_SLOTS = 8  # EOS ids a request may name (the rest of the buffer is -1)
NGRAM_MAX = 10  # the longest no-repeat n-gram with a tensor form (the page's slider ends there)
_M = 0xFFFFFFFF


@dataclass(frozen=True)
class Kind:
    """Which operations one captured graph applies to the logits (their values are in the sampler's buffers)."""

    sample: bool = False
    bias: bool = False
    penalty: bool = False
    temperature: bool = False
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    masked: bool = False  # finished rows of a batch go on with padding
    no_memory: bool = False  # `<recall>` and `<|memory_pad|>` suppressed, wanting a memory recorded (NoMemory)
    ngram: bool = False  # no-repeat n-gram ban
    typical: bool = False  # typical-p
    commit: bool = True  # False: the tokens are seen (`see`) but nothing is chosen (a long span's first parts)

    @staticmethod
    def union(kinds) -> "Kind":
        """The kind of a graph over rows of these kinds (each row's values make the others' operations neutral;
        none: greedy)."""
        kinds = list(kinds)
        return Kind(**{f.name: any(getattr(k, f.name) for k in kinds) for f in dataclasses.fields(Kind)
                       if f.name != "commit"})

    @property
    def sees(self) -> bool:
        """Its operations read the tokens fed so far (`DeviceSampler.see`)."""
        return self.penalty or self.ngram


FULL = Kind(**{f.name: True for f in dataclasses.fields(Kind)})  # every operation (warm-up: each op's first run)
NEVER = 1 << 62  # `wanted_at` of a row that never wanted a memory
_ORDER = (SequenceBiasLogitsProcessor, RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor,
          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper)
_BEFORE_NO_MEMORY = 3  # (NoMemory goes after the bias, the penalty and the n-gram ban: `before_warpers`)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply, constants under 2^31 so no int64 product overflows)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M
    return x ^ (x >> 16)


class DeviceSampler:
    """The buffers of one graph step's sampling: `batch` rows over `vocab` tokens on `device`, sequences of up to
    `max_len` tokens (the n-gram ban's; 0: no n-gram ban in the graph)."""

    def __init__(self, batch: int, vocab: int, device: torch.device, max_len: int = 0):
        z = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.batch, self.vocab, self.device = batch, vocab, device
        f32 = torch.float32
        self.bias = z(batch, vocab, dtype=f32)
        self.penalty, self.temperature = z(batch, 1, dtype=f32) + 1, z(batch, 1, dtype=f32) + 1
        self.top_k, self.top_p, self.min_p = z(batch, 1) + vocab, z(batch, 1, dtype=f32) - 1, z(batch, 1, dtype=f32)
        self.noise = z(batch, 1, dtype=f32)  # 1: the row samples, 0: greedy (a graph that samples other rows)
        self.counts = z(batch, vocab, dtype=torch.int32)  # tokens of each row's sequence (the penalty's input)
        self.ngram, self.typical = z(batch, 1), z(batch, 1, dtype=f32) + 2  # n (0: none); the typical mass
        self.max_len = max_len
        self.history = z(batch, max_len + 1)  # each row's sequence (the n-gram ban's input), a spare column last
        self.length = z(batch)  # tokens in each row's sequence
        k, i = torch.arange(NGRAM_MAX - 1, device=device), torch.arange(max_len, device=device)
        self._k, self._i = k, i  # [K]: a prefix's offsets, [L]: where windows start
        self._windows = (i[:, None] + k).clamp(max=max_len).view(1, -1)  # [1, L * K]: each window's tokens
        self.seed, self.lane = z(batch), torch.arange(batch, device=device)  # the draw's seed and lane per row
        self.step = z(1)  # commits so far (the read-back ring's counter)
        self.row_step = z(batch)  # each row's own commits (the hash's counter, NoMemory's first token)
        self.held = z(batch, dtype=torch.bool)  # rows whose token a replay drops (a long span's first parts)
        self.unfinished = z(batch, dtype=torch.bool) | True
        self.eos, self.pad = z(EOS_SLOTS) - 1, z(1)
        self.ring = z(RING, batch)
        self.host = torch.zeros((RING, batch), dtype=torch.long, pin_memory=device.type == "cuda")
        self.token_hash = _mix(torch.arange(vocab, device=device) * 0x27D4EB2F & _M)  # [V]
        self.recall_id = z(1)
        self.suppress, self.first_ends = z(batch, vocab, dtype=torch.bool), z(batch, vocab, dtype=torch.bool)
        self.wanted_at = z(batch) + NEVER  # the row's first commit whose choice, before NoMemory, was `<recall>`

    def configure(self, procs: LogitsProcessorList, *, do_sample: bool, seed: int, eos: list[int],
                  pad: int, masked: bool, prompt: int = -1) -> Kind | None:
        """Load a request's processors into the buffers of every row; its `Kind`, or None when one of them has no
        tensor form here (the caller then runs `procs` itself on the host's queue). `prompt`: the prompt's length (a
        `NoMemory` last, made for it, applies its first-token rule at the first commit)."""
        if masked and len(eos) > EOS_SLOTS:
            raise ValueError(f"{len(eos)} EOS ids for a batch of rows; the graph step masks at most {EOS_SLOTS}")
        # what `commit` reads, for every request (the fallback's too): the ring from slot 0, the rows' end
        self.step.zero_()
        self.unfinished.fill_(True)
        self.eos.fill_(-1)
        if eos:
            self.eos[:min(len(eos), EOS_SLOTS)] = torch.tensor(eos[:EOS_SLOTS], device=self.device)
        self.pad.fill_(pad)
        self.lane.copy_(torch.arange(self.batch, device=self.device))
        kind = self._load(procs, slice(None), do_sample, seed, prompt)
        return None if kind is None else dataclasses.replace(kind, masked=masked)

    def configure_row(self, row: int, procs: LogitsProcessorList, *, do_sample: bool, seed: int,
                      prompt: int = -1) -> Kind | None:
        """Load one request into row `row` alone (lane 0, its own commits from 0, its counts empty: `see` its
        prompt); its `Kind`, or None (no tensor form: the row is not loaded)."""
        self.lane[row] = 0
        return self._load(procs, slice(row, row + 1), do_sample, seed, prompt)

    def free_row(self, row: int) -> None:
        """A row no request holds: every operation neutral (its tokens are never read)."""
        self._load(LogitsProcessorList(), slice(row, row + 1), False, 0, -1)

    def kind_of(self, procs: LogitsProcessorList, do_sample: bool) -> Kind | None:
        """The `Kind` these processors would load as (None: no tensor form), loading nothing."""
        return self._load(procs, slice(0, 0), do_sample, 0, -1, write=False)

    def _load(self, procs, rows: slice, do_sample: bool, seed: int, prompt: int, write: bool = True) -> Kind | None:
        at = next((i for i, p in enumerate(procs) if isinstance(p, NoMemory)), None)
        no_memory = None if at is None else procs[at]
        if no_memory is not None:  # where `before_warpers` puts it: after the bias, the penalty and the n-gram ban
            before = _ORDER[:_BEFORE_NO_MEMORY]
            if any(type(p) not in before for p in procs[:at]) or any(type(p) in before for p in procs[at:]):
                return None
            procs = [*procs[:at], *procs[at + 1:]]
        found: dict[type, object] = {}
        for p in procs:
            if type(p) not in _ORDER or type(p) in found:
                return None
            found[type(p)] = p
        if [t for t in _ORDER if t in found] != [type(p) for p in procs]:
            return None
        bias = found.get(SequenceBiasLogitsProcessor)
        if bias is not None and any(len(ids) != 1 for ids in bias.sequence_bias):
            return None
        penalty = found.get(RepetitionPenaltyLogitsProcessor)
        if penalty is not None and penalty.prompt_ignore_length is not None:
            return None
        ngram = found.get(NoRepeatNGramLogitsProcessor)
        if ngram is not None and not 0 < ngram.ngram_size <= min(NGRAM_MAX, self.max_len):
            return None
        typical = found.get(TypicalLogitsWarper)
        if typical is not None and typical.min_tokens_to_keep != 1:
            return None
        kind = Kind(sample=do_sample, bias=bias is not None, penalty=penalty is not None,
                    temperature=TemperatureLogitsWarper in found, top_k=TopKLogitsWarper in found,
                    top_p=TopPLogitsWarper in found, min_p=MinPLogitsWarper in found, no_memory=no_memory is not None,
                    ngram=ngram is not None, typical=typical is not None)
        if not write:
            return kind
        self.bias[rows] = 0
        if bias is not None:
            for ids, b in bias.sequence_bias.items() if isinstance(bias.sequence_bias, dict) else bias.sequence_bias:
                self.bias[rows, list(ids)[0]] = b
        self.penalty[rows] = penalty.penalty if penalty is not None else 1.0
        self.temperature[rows] = found[TemperatureLogitsWarper].temperature if TemperatureLogitsWarper in found else 1.0
        self.top_k[rows] = min(found[TopKLogitsWarper].top_k, self.vocab) if TopKLogitsWarper in found else self.vocab
        # (transformers compares with 1 - top_p; -1: no sum of probabilities is at or below it)
        self.top_p[rows] = 1 - found[TopPLogitsWarper].top_p if TopPLogitsWarper in found else -1.0
        self.min_p[rows] = found[MinPLogitsWarper].min_p if MinPLogitsWarper in found else 0.0
        self.ngram[rows] = ngram.ngram_size if ngram is not None else 0
        self.typical[rows] = typical.mass if typical is not None else 2.0  # (a mass no cumulative sum reaches)
        self.noise[rows] = 1.0 if do_sample else 0.0
        self.seed[rows] = seed & 0x7FFFFFFF
        self.row_step[rows] = 0
        self.held[rows] = False
        self.counts[rows] = 0
        self.length[rows] = 0
        self.suppress[rows] = False
        self.first_ends[rows] = False
        self.wanted_at[rows] = NEVER
        if no_memory is not None:
            self.recall_id.fill_(no_memory.recall_id)
            self.suppress[rows, no_memory.ids] = True
            if no_memory.start == prompt and no_memory.eos:
                self.first_ends[rows, no_memory.eos] = True
        return kind

    def see(self, ids: torch.Tensor, valid: torch.Tensor | None = None, rows: slice = slice(None)) -> None:
        """Tokens [B, W] fed to the rows: counted (the penalty's input) and appended to their sequences (the n-gram
        ban's); `valid` [B, W] bool: which of them are real (the rest are not appended)."""
        add = torch.ones_like(ids, dtype=torch.int32) if valid is None else valid.to(torch.int32)
        self.counts[rows].scatter_add_(1, ids, add)
        if self.max_len:
            spare = self.max_len
            at = torch.where(add > 0, self.length[rows][:, None] + add.cumsum(1) - 1, spare).clamp(max=spare)
            self.history[rows].scatter_(1, at, ids)
            self.length[rows] += add.sum(1)

    def scores(self, logits: torch.Tensor, kind: Kind, rows: slice = slice(None)) -> torch.Tensor:
        """The processed scores [B, V] float32 of raw logits [B, V] (of `rows`): transformers' operations, in their
        order."""
        s = logits.float()
        if kind.bias:
            s = s + self.bias[rows]
        if kind.penalty:
            p = self.penalty[rows]
            s = torch.where(self.counts[rows] > 0, torch.where(s < 0, s * p, s / p), s)
        if kind.ngram:
            s = s.masked_fill(self._banned(rows, s.shape[-1]), -float("inf"))
        if kind.no_memory:  # NoMemory, before the warpers
            step, wanted_at = self.row_step[rows], self.wanted_at[rows]
            first = s.argmax(-1) == self.recall_id  # [B]: rows that want a memory (recorded at their first commit)
            wanted_at.copy_(torch.where(first & (wanted_at == NEVER) & ~self.held[rows], step, wanted_at))
            s = s.masked_fill(self.suppress[rows], -float("inf"))  # <recall> and <|memory_pad|>
            s = s.masked_fill(first[:, None] & self.first_ends[rows] & (step == 0)[:, None], -float("inf"))
        if kind.sample:
            s = self._warp(s, kind, rows)
        return s

    def _banned(self, rows: slice, vocab: int) -> torch.Tensor:
        """[B, V] bool: the tokens that would repeat an n-gram of the row's sequence (transformers'
        `NoRepeatNGramLogitsProcessor`: the last n - 1 tokens matched against every window of n, each matching
        window banning its last token), for every row's own n at once."""
        h, n, cur = self.history[rows], self.ngram[rows], self.length[rows][:, None]  # [B, L + 1], [B, 1], [B, 1]
        b, k, i = h.shape[0], self._k, self._i
        windows = h.gather(1, self._windows.expand(b, -1)).view(b, self.max_len, -1)  # [B, L, K]
        prefix = h.gather(1, (cur - n + 1 + k).clamp(0, self.max_len))  # [B, K]: the last n - 1 tokens
        same = (windows == prefix[:, None]) | (k >= n - 1)[:, None]  # (a window's offsets past n - 1 do not count)
        matches = same.all(-1) & (i <= cur - n) & (n > 0)  # [B, L]: the windows of n tokens that match
        last = h.gather(1, (i + n - 1).clamp(0, self.max_len))  # [B, L]: each window's last token
        banned = torch.zeros((b, vocab + 1), dtype=torch.bool, device=h.device)  # (non-matches: the spare column)
        return banned.scatter_(1, torch.where(matches, last.clamp(max=vocab), vocab), True)[:, :vocab]

    def _warp(self, s: torch.Tensor, kind: Kind, rows: slice) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p, as transformers' warpers."""
        if kind.temperature:
            s = s / self.temperature[rows]
        if kind.top_k:
            kth = torch.sort(s, dim=-1, descending=True).values.gather(1, self.top_k[rows] - 1)
            s = s.masked_fill(s < kth, -float("inf"))
        if kind.top_p:
            ordered, order = torch.sort(s, dim=-1, descending=False)
            remove = ordered.softmax(dim=-1).cumsum(dim=-1) <= self.top_p[rows]
            remove[..., -1:] = False
            s = s.masked_fill(remove.scatter(1, order, remove), -float("inf"))
        if kind.min_p:
            probs = torch.softmax(s, dim=-1)
            remove = probs < self.min_p[rows] * probs.amax(dim=-1, keepdim=True)
            remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
            s = s.masked_fill(remove, -float("inf"))
        if kind.typical:
            s = s.masked_fill(self._atypical(s, self.typical[rows]), -float("inf"))
        return s

    @staticmethod
    def _atypical(s: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
        """[B, V] bool: what typical-p removes (transformers' `TypicalLogitsWarper`, its operations) at each row's
        mass [B, 1]."""
        normalized = torch.nn.functional.log_softmax(s, dim=-1)
        ent = -(normalized * torch.exp(normalized)).nansum(-1, keepdim=True)
        ordered, order = torch.sort(torch.abs(-normalized - ent), descending=False)
        cumulative = s.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        last = (cumulative < mass).sum(dim=1).clamp(max=s.shape[-1] - 1)
        remove = ordered > ordered.gather(1, last.view(-1, 1))
        remove[..., :1] = False
        return remove.scatter(1, order, remove)

    def gumbel(self, rows: slice = slice(None)) -> torch.Tensor:
        """G [B, V] = -log(-log U), U in (0, 1) hashed from (seed, the row's commits, lane, token)."""
        row = _mix((self.seed[rows] * 0x9E3779B1 + self.row_step[rows] * 0x632BE5AB + self.lane[rows] * 0x5851F42D)
                   & _M)  # [B]
        x = _mix(row[:, None] ^ self.token_hash)  # [B, V]
        # (23 bits: (2^23 - 1 + 0.5) / 2^23 is a float32 below 1; with 24, the top value rounds to 1 and G to +inf)
        u = ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
        return -torch.log(-torch.log(u))

    def choose(self, logits: torch.Tensor, kind: Kind, rows: slice = slice(None)) -> torch.Tensor:
        """Tokens [B]: the argmax of the processed scores, or the Gumbel-max draw from them (a greedy row of a
        sampling graph draws no noise)."""
        s = self.scores(logits, kind, rows)
        return torch.argmax(torch.where(self.noise[rows] > 0, s + self.gumbel(rows), s) if kind.sample else s, dim=-1)

    def commit(self, tokens: torch.Tensor, into: torch.Tensor, masked: bool) -> None:
        """Tokens [B] become the next replay's input ids `into` [B, 1] and step `step`'s ring slot, copied to the
        pinned host ring without waiting."""
        if masked:
            tokens = torch.where(self.unfinished, tokens, self.pad)
            self.unfinished &= ~(tokens[:, None] == self.eos).any(-1)
        into.copy_(tokens[:, None])
        self.ring.index_copy_(0, self.step % RING, tokens[None])
        self.host.copy_(self.ring, non_blocking=True)
        self.step.add_(1)
        self.row_step.add_((~self.held).long())

    def commit_row(self, row: int, token: torch.Tensor, into: torch.Tensor) -> None:
        """Row `row`'s first token [1] (chosen after its own prefill, read by its request directly) as its next
        replay's input; its commits count it."""
        into[row].copy_(token)
        self.row_step[row] += 1


class ReadBack:
    """Each commit's tokens [B], read on the host from the sampler's pinned ring (waiting for that step alone)."""

    def __init__(self, sampler: "DeviceSampler"):
        self.sampler, self.launched = sampler, 0
        cuda = sampler.device.type == "cuda"
        self.events = [torch.cuda.Event() if cuda else None for _ in range(RING)]

    def pushed(self) -> int:
        """A commit was just queued (in a replay or eagerly): its slot."""
        slot, self.launched = self.launched % RING, self.launched + 1
        if self.events[slot] is not None:
            self.events[slot].record()
        return slot

    def read(self, slot: int) -> list[int]:
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        return self.sampler.host[slot].tolist()

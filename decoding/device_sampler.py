"""The request's processors and draw as tensor operations on fixed device buffers: the part of a decode step that
`decoding/graph.py` captures in the same CUDA graph as the forward, so a step is one replay and nothing else.

`DeviceSampler.configure` reads the request's transformers `LogitsProcessorList` (built by `decoding.processors`,
the order of `generate`) and returns a `Kind` when every processor has a tensor form here: one-token
`sequence_bias`, the repetition penalty (no left padding), temperature, top-k, top-p and min-p, in that order, and
the chat's `decoding.memory.NoMemory` before the warpers (its record of a wanted memory kept on the device,
`wanted_at`), with the same operations (so the processed scores are theirs); `None` otherwise (the documented
fallback: multi-token sequence biases, n-gram bans, bad words, min-length, forced tokens, suppressions,
typical/epsilon/eta, watermarking, guidance; those run as transformers' processors on the host's queue, outside the
graph, and some of them synchronise). The kind says which operations a graph holds; their values (penalty, temperature,
k, ...) live in buffers, so a new request with other values replays the same graph.

The draw is the Gumbel-max race: argmax(scores + G), G = -log(-log U), which picks i with probability
softmax(scores)_i (the law of `torch.multinomial`). U is a counter-based hash of (seed, step, row, token), so
it needs no generator state: the same seed gives the same draws on a CPU, a GPU, eagerly or replayed.

`commit` writes the chosen tokens where the next replay reads them (the step's input ids), masks the finished
rows of a batch (EOS then padding, decided on the device), and puts them in a ring of R steps copied to pinned
host memory without waiting: the host reads step n's tokens from slot n % R after that step's event.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor, TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper,
)

from decoding.memory import NoMemory

RING = 4  # steps of tokens kept for the host's read-back (it reads one step behind)
EOS_SLOTS = 8  # EOS ids a request may name (the rest of the buffer is -1)
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
    commit: bool = True  # False: the tokens are counted (penalty) but nothing is chosen (a long span's first parts)


FULL = Kind(True, True, True, True, True, True, True, True, True)  # every operation (warm-up: each op's first run)
NEVER = 1 << 62  # `wanted_at` of a row that never wanted a memory
_ORDER = (SequenceBiasLogitsProcessor, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
          TopPLogitsWarper, MinPLogitsWarper)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply, constants under 2^31 so no int64 product overflows)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M
    return x ^ (x >> 16)


class DeviceSampler:
    """The buffers of one graph step's sampling: `batch` rows over `vocab` tokens on `device`."""

    def __init__(self, batch: int, vocab: int, device: torch.device):
        z = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.batch, self.vocab, self.device = batch, vocab, device
        self.bias = z(vocab, dtype=torch.float32)
        self.penalty, self.temperature = z(1, dtype=torch.float32) + 1, z(1, dtype=torch.float32) + 1
        self.top_k, self.top_p, self.min_p = z(1) + vocab, z(1, dtype=torch.float32), z(1, dtype=torch.float32)
        self.counts = z(batch, vocab, dtype=torch.int32)  # tokens of each row's sequence (the penalty's input)
        self.seed, self.step = z(batch), z(1)  # the draw's seed per row; commits so far (the hash's counter)
        self.unfinished = z(batch, dtype=torch.bool) | True
        self.eos, self.pad = z(EOS_SLOTS) - 1, z(1)
        self.ring = z(RING, batch)
        self.host = torch.zeros((RING, batch), dtype=torch.long, pin_memory=device.type == "cuda")
        self.rows = torch.arange(batch, device=device)
        self.token_hash = _mix(torch.arange(vocab, device=device) * 0x27D4EB2F & _M)  # [V]
        self.recall_id, self.suppress, self.first_ends = z(1), z(vocab, dtype=torch.bool), z(vocab, dtype=torch.bool)
        self.wanted_at = z(batch) + NEVER  # the first commit whose choice, before NoMemory, was `<recall>`

    def configure(self, procs: LogitsProcessorList, *, do_sample: bool, seed: int, eos: list[int],
                  pad: int, masked: bool, prompt: int = -1) -> Kind | None:
        """Load a request's processors into the buffers; its `Kind`, or None when one of them has no tensor form
        here (the caller then runs `procs` itself on the host's queue). `prompt`: the prompt's length (a `NoMemory`
        last, made for it, applies its first-token rule at the first commit)."""
        if masked and len(eos) > EOS_SLOTS:
            raise ValueError(f"{len(eos)} EOS ids for a batch of rows; the graph step masks at most {EOS_SLOTS}")
        # what `commit` reads, for every request (the fallback's too): the ring from slot 0, the rows' end
        self.step.zero_()
        self.unfinished.fill_(True)
        self.eos.fill_(-1)
        if eos:
            self.eos[:min(len(eos), EOS_SLOTS)] = torch.tensor(eos[:EOS_SLOTS], device=self.device)
        self.pad.fill_(pad)
        at = next((i for i, p in enumerate(procs) if isinstance(p, NoMemory)), None)
        no_memory = None if at is None else procs[at]
        if no_memory is not None:  # where `before_warpers` puts it: after the bias and the penalty, before the rest
            if any(type(p) not in _ORDER[:2] for p in procs[:at]) or any(type(p) in _ORDER[:2] for p in procs[at:]):
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
        self.bias.zero_()
        if bias is not None:
            if any(len(ids) != 1 for ids in bias.sequence_bias):
                return None
            for ids, b in bias.sequence_bias.items() if isinstance(bias.sequence_bias, dict) else bias.sequence_bias:
                self.bias[list(ids)[0]] = b
        penalty = found.get(RepetitionPenaltyLogitsProcessor)
        if penalty is not None:
            if penalty.prompt_ignore_length is not None:
                return None
            self.penalty.fill_(penalty.penalty)
        if TemperatureLogitsWarper in found:
            self.temperature.fill_(found[TemperatureLogitsWarper].temperature)
        if TopKLogitsWarper in found:
            self.top_k.fill_(min(found[TopKLogitsWarper].top_k, self.vocab))
        if TopPLogitsWarper in found:
            self.top_p.fill_(1 - found[TopPLogitsWarper].top_p)  # (transformers compares with 1 - top_p)
        if MinPLogitsWarper in found:
            self.min_p.fill_(found[MinPLogitsWarper].min_p)
        self.seed.fill_(seed & 0x7FFFFFFF)
        self.counts.zero_()
        self.suppress.zero_()
        self.first_ends.zero_()
        self.wanted_at.fill_(NEVER)
        if no_memory is not None:
            self.recall_id.fill_(no_memory.recall_id)
            self.suppress[no_memory.ids] = True
            if no_memory.start == prompt and no_memory.eos:
                self.first_ends[no_memory.eos] = True
        return Kind(do_sample, bias is not None, penalty is not None, TemperatureLogitsWarper in found,
                    TopKLogitsWarper in found, TopPLogitsWarper in found, MinPLogitsWarper in found, masked,
                    no_memory is not None)

    def see(self, ids: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Count tokens [B, W] into the rows' sequences (`valid` [B, W] bool: which of them are real)."""
        add = torch.ones_like(ids, dtype=torch.int32) if valid is None else valid.to(torch.int32)
        self.counts.scatter_add_(1, ids, add)

    def scores(self, logits: torch.Tensor, kind: Kind) -> torch.Tensor:
        """The processed scores [B, V] float32 of raw logits [B, V]: transformers' operations, in their order."""
        s = logits.float()
        if kind.bias:
            s = s + self.bias
        if kind.penalty:
            s = torch.where(self.counts > 0, torch.where(s < 0, s * self.penalty, s / self.penalty), s)
        if kind.no_memory:  # NoMemory, before the warpers
            first = s.argmax(-1) == self.recall_id  # [B]: rows that want a memory (recorded at their first commit)
            self.wanted_at.copy_(torch.where(first & (self.wanted_at == NEVER), self.step, self.wanted_at))
            s = s.masked_fill(self.suppress, -float("inf"))  # <recall> and <|memory_pad|>
            s = s.masked_fill(first[:, None] & self.first_ends & (self.step == 0), -float("inf"))  # (no first end)
        if kind.sample:
            s = self._warp(s, kind)
        return s

    def _warp(self, s: torch.Tensor, kind: Kind) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p, as transformers' warpers."""
        if kind.temperature:
            s = s / self.temperature
        if kind.top_k:
            kth = torch.sort(s, dim=-1, descending=True).values.gather(1, (self.top_k - 1).expand(s.shape[0], 1))
            s = s.masked_fill(s < kth, -float("inf"))
        if kind.top_p:
            ordered, order = torch.sort(s, dim=-1, descending=False)
            remove = ordered.softmax(dim=-1).cumsum(dim=-1) <= self.top_p
            remove[..., -1:] = False
            s = s.masked_fill(remove.scatter(1, order, remove), -float("inf"))
        if kind.min_p:
            probs = torch.softmax(s, dim=-1)
            remove = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
            remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
            s = s.masked_fill(remove, -float("inf"))
        return s

    def gumbel(self) -> torch.Tensor:
        """G [B, V] = -log(-log U), U in (0, 1) hashed from (seed, step, row, token)."""
        row = _mix((self.seed * 0x9E3779B1 + self.step * 0x632BE5AB + self.rows * 0x5851F42D) & _M)  # [B]
        x = _mix(row[:, None] ^ self.token_hash)  # [B, V]
        u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
        return -torch.log(-torch.log(u))

    def choose(self, logits: torch.Tensor, kind: Kind) -> torch.Tensor:
        """Tokens [B]: the argmax of the processed scores, or the Gumbel-max draw from them."""
        s = self.scores(logits, kind)
        return torch.argmax(s + self.gumbel() if kind.sample else s, dim=-1)

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

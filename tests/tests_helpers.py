"""Small builders shared by tests (importable: tests/ is on sys.path via conftest)."""

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LogitsProcessor

from chat.worker import END, Request, ServiceError


def fresh_tiny_llama(like):
    """A tiny random Llama and a tokenizer WITHOUT the recall tokens (re-read from the SmolLM2 files)."""
    from models import embedded_model_dir
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    return LlamaForCausalLM(config).eval(), tok


def kv_recall(model, special: tuple[int, int, int], n: int, slots: tuple[int, int], seed: int = 0,
              key_dim: int = 16):
    """A `Recall` over `n` key/value memories of `slots[0]`..`slots[1]` value slots (random, seeded), `</recall>`
    after them; `special`: the ids of `<recall>`, `<|memory_pad|>` and `</recall>`. The query is a fixed projection
    of the `<recall>` state, computed on the state's device."""
    from decoding.memory import Recall
    from decoding.settings import RecallSettings
    from memory import MemoryVectorDB
    g = torch.Generator().manual_seed(seed)
    h, scale = model.config.hidden_size, float(model.get_input_embeddings().weight.detach().std()) * 3
    db = MemoryVectorDB(key_dim, value_dim=h)
    widths = torch.randint(slots[0], slots[1] + 1, (n,), generator=g).tolist()
    db.add(torch.randn(n, key_dim, generator=g), [f"fact {i}" for i in range(n)],
           values=[torch.randn(k, h, generator=g) * scale for k in widths])
    proj = torch.randn(h, key_dim, generator=torch.Generator().manual_seed(7))
    recall, pad, end = special
    return Recall(recall, pad, db, RecallSettings(), query=lambda hidden: hidden.float() @ proj.to(hidden.device),
                  suffix=(end,))


def bank_file(path, dim: int, n: int = 3):
    """A small valid bank with texts, saved to `path` (format from its extension)."""
    from memory import MemoryVectorDB
    db = MemoryVectorDB(dim)
    db.add(torch.randn(n, dim), [f"fact {i}" for i in range(n)])
    db.save(path)
    return path


class ForceTokens(LogitsProcessor):
    """Forces `tokens`, one a step, from the step whose input has `length` tokens on, in `rows` (None: every row)."""

    def __init__(self, length: int, tokens: list[int], rows: list[int] | None = None):
        self.length, self.tokens, self.rows = length, list(tokens), rows

    def __call__(self, input_ids, scores):
        i = input_ids.shape[1] - self.length
        if not 0 <= i < len(self.tokens):
            return scores
        rows = slice(None) if self.rows is None else self.rows
        scores = scores.clone()
        scores[rows] = -float("inf")
        scores[rows, self.tokens[i]] = 0.0
        return scores


class Evil:
    """A pickle payload: unpickling it creates the directory `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.mkdir, (str(self.marker),)


def drain(req: Request, timeout: float = 60) -> list:
    """All events of a request, END excluded."""
    events = []
    while (event := req.events.get(timeout=timeout)) is not END:
        events.append(event)
    return events


def result(req: Request, timeout: float = 60):
    assert req.done.wait(timeout), f"request {req.kind} did not finish"
    if req.error:
        raise ServiceError(req.error)
    return req.result


def step_positions(result, row: int = 0, suffix: int = 0) -> list[int]:
    """The position each step's logits were read at: the one before the step's first new column (a step
    that injected a memory wrote its `length` slots and `suffix` forced tokens)."""
    widths = {r.position: r.length + suffix for r in result.injections if r.row == row}
    pos, out = result.prompt_length, []
    for _ in range(result.logits.shape[1]):
        out.append(pos - 1)
        pos += widths.get(pos, 1)
    return out


TIE = 1e-3  # logits closer than this: a near tie that another kernel or thread count may decide either way


def assert_decodes_alike(got, want, row: int = 0, suffix: int = 0, atol: float = 1e-4, prefix: bool = False) -> None:
    """`got` (a GenerationResult with logits) decoded what `want` did, as far as it is decidable: the same
    tokens and injections, and logits within `atol`, up to the first step whose choice in `want` was a near tie
    (its two best logits within TIE), where either token may come; from there on they may differ. `prefix`:
    `got` was stopped early, so it may end where `want` goes on."""
    a, b = want.sequences[row].tolist(), got.sequences[row].tolist()
    end = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    steps = [s for s, p in enumerate(step_positions(want, row, suffix)) if p < end and s < got.logits.shape[1]]
    if end < max(len(a), len(b)) and not (prefix and end == len(b)):
        assert end < len(a) and end < len(b), "one answer stopped where the other went on"
        step = len(steps)  # the step that chose position `end`
        logits = want.logits[row, step]
        gap = float(logits[a[end]] - logits[b[end]])
        assert abs(gap) < TIE, f"position {end}: {a[end]} vs {b[end]}, not a near tie (logits {gap:.2e} apart)"
    torch.testing.assert_close(got.logits[row, steps], want.logits[row, steps], atol=atol, rtol=atol)
    same = lambda r: [(e.position, e.memory_index, e.length) for e in r.injections if e.row == row and e.position < end]  # noqa: E731
    assert same(got) == same(want)


def returned(gen):
    """Run a generator to its end: (its return value, the events it yielded)."""
    events = []
    try:
        while True:
            events.append(next(gen))
    except StopIteration as done:
        return done.value, events


def told(events) -> list:
    """What a stream told, comparable across decoders: tokens with their text and position, recalls, finishes."""
    from decoding.events import FinishEvent, RecallEvent, TokenEvent

    out = []
    for e in events:
        if isinstance(e, TokenEvent):
            out.append(("token", e.token_id, e.position, e.text))
        elif isinstance(e, RecallEvent):
            out.append(("recall", e.position, e.memory_index, e.length))
        elif isinstance(e, FinishEvent):
            out.append(("finish", e.reason))
    return out

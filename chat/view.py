"""What the page shows, rendered from typed events and session states (pure; no Gradio here).

The live answer is a `TurnView` of its events; everything else comes from a `chat.state.SessionState`, the same
data whether the model runs in this process or on a replica.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from chat.state import BankState, MessageState, Piece, SessionState
from chat.changes import Remembered
from chat.worker import Failed, Notice, Waiting
from decoding.events import FinishEvent, RecallEvent, TokenEvent

Segment = tuple[str, str | None]  # (text, highlight label or None)
RECALL_COLUMNS = ["turn", "position", "slots", "score", "memory", "text"]
_MARKER_HEAD = re.compile(r"⟨memory #\d+")


def marker(recall: RecallEvent) -> Segment:
    """A memory's injected span (its `<|memory_pad|>` slots) as one highlight segment: (text, label "memory 0.84")."""
    body = f"memory #{recall.memory_index}" + (f": {recall.text}" if recall.text else "")
    return f"⟨{body}⟩", f"memory {recall.score:.2f}"


def inline_text(segments: Sequence[Segment]) -> str:
    """An answer for the chat window, each memory marker short: `⟨memory #3 · 0.84⟩`."""
    short = lambda text, label: f"`{_MARKER_HEAD.match(text)[0]} · {label.split()[1]}⟩`"  # noqa: E731
    return "".join(text if label is None else short(text, label) for text, label in segments)


@dataclass
class TurnView:
    """The live state of one answer, built from the request's events."""

    segments: list[Segment] = field(default_factory=list)
    recalls: list[RecallEvent] = field(default_factory=list)
    ahead: int | None = None
    tokens: int = 0
    reason: str | None = None
    notices: list[str] = field(default_factory=list)
    remembered: list[Remembered] = field(default_factory=list)  # the turn's changes to its author's memory
    error: str | None = None
    done: bool = False

    def apply(self, event: Any) -> None:
        if isinstance(event, Waiting):
            self.ahead = event.ahead
        elif isinstance(event, TokenEvent):
            self.tokens += 1
            if event.text:
                if self.segments and self.segments[-1][1] is None:
                    self.segments[-1] = (self.segments[-1][0] + event.text, None)
                else:
                    self.segments.append((event.text, None))
        elif isinstance(event, RecallEvent):
            self.recalls.append(event)
            self.segments.append(marker(event))
        elif isinstance(event, FinishEvent):
            self.reason = event.reason
        elif isinstance(event, Notice):
            self.notices.append(event.text)
        elif isinstance(event, Remembered):
            self.remembered.append(event)
            self.notices.append(event.describe())
        elif isinstance(event, Failed):
            self.error = event.message

    @property
    def state(self) -> str:
        if self.error:
            state = f"⚠ {self.error}"
        elif self.done:
            state = {"interrupted": f"stopped after {self.tokens} tokens",
                     "length": "done (max new tokens, or the time limit)",
                     None: "stopped before it started"}.get(self.reason, "done")
        elif self.ahead:
            state = f"waiting: {self.ahead} ahead"
        else:
            state = f"generating… {self.tokens} tokens" if self.tokens else "reading the prompt…"
        return " · ".join([state, *self.notices])


def segments(pieces: Sequence[Piece]) -> list[Segment]:
    """A stored answer's pieces as highlight segments, each memory a marker."""
    return [marker(p) if isinstance(p, RecallEvent) else (p, None) for p in pieces]


def chat_messages(messages: Sequence[MessageState]) -> list[dict]:
    """Messages as the chat window shows them: a user's images and text, an answer with short memory markers."""
    out = []
    for msg in messages:
        if msg.role == "user":
            content: list[Any] = [{"path": p} for p in msg.images]
            out.append({"role": "user", "content": content + ([msg.text] if msg.text else [])})
        else:
            note = " _(stopped)_" if msg.finish_reason == "interrupted" else ""
            out.append({"role": "assistant", "content": inline_text(segments(msg.pieces)) + note})
    return out


def recall_table(messages: Sequence[MessageState], live: TurnView | None = None) -> pd.DataFrame:
    """Every injection of the conversation (and of the answer being written): one row each."""
    answers = [m.recalls for m in messages if m.role == "assistant"]
    if live is not None and not live.done:
        answers.append(live.recalls)
    rows = [(turn, r.position, r.length, round(r.score, 4),
             f"{r.memory_index} ({r.source})" if r.source else r.memory_index, r.text or "")
            for turn, recalls in enumerate(answers, 1) for r in recalls]
    return pd.DataFrame(rows, columns=RECALL_COLUMNS)


def bank_summary(bank: BankState | None) -> str:
    if bank is None:
        return "**Bank:** not read yet"
    if bank.error:
        return f"**Bank:** {bank.label} · {bank.error}"
    if bank.size is None:
        return f"**Bank:** {bank.label}. No memories: recall is off. Build the example bank or upload one."
    index = f", {bank.index} index" if bank.index != "flat" else ""
    size = f" · {bank.bytes_per_memory / 1024:.1f} KB a memory in RAM" if bank.bytes_per_memory is not None else ""
    return f"**Bank:** {bank.label} · **{bank.size}** memories · {memory_kind(bank)}{size}{index}"


def memory_kind(bank: BankState) -> str:
    """How a bank's memories are read and found, in words."""
    if not bank.keyed:
        return f"one {bank.dim}-d hidden-state vector each, found by the <recall> state"
    what = "its token ids, read as the model's own embeddings" if bank.token_values else \
        f"vectors of dimension {bank.value_dim}"
    return f"values **{bank.values}** ({what}), found by the {bank.dim}-d text embedding of your message ({bank.keys})"


def bank_sample(bank: BankState | None) -> pd.DataFrame:
    return pd.DataFrame(list(bank.entries) if bank is not None else [], columns=["memory", "text", "slots", "key norm"])


def about_table(entries: Sequence[dict], query: str = "") -> pd.DataFrame:
    """A user's memories, newest first, those containing `query` (any case) when one is given."""
    q = (query or "").strip().lower()
    rows = [(e["id"], time.strftime("%Y-%m-%d %H:%M", time.localtime(e.get("created_at", 0))), e["text"])
            for e in entries if not q or q in e["text"].lower()]
    return pd.DataFrame(rows, columns=["id", "written", "text"])


def found_table(hits: Sequence[dict]) -> pd.DataFrame:
    return pd.DataFrame([(h["index"], round(h["score"], 4), h["text"]) for h in hits],
                        columns=["memory", "similarity", "text"])


def status_line(state: SessionState, extra: str = "") -> str:
    """The model, the bank, the last answer's speed and what is going on, on one line."""
    bank = state.bank
    if bank is None:
        words = "bank: not read yet"
    elif bank.error:  # a shared store that went away (the answer that needed it says why)
        words = f"bank: unreachable ({bank.use})"
    else:
        words = "bank: none" if bank.size is None else f"bank: {bank.size} memories ({bank.use})"  # (0: emptied)
    speed = (f"last answer {state.speed:.1f} tokens/s" if state.speed else
             "" if any(m.role == "assistant" for m in state.messages) else "no answer yet")
    model = f"**{state.model}**" if state.model else ""
    return " · ".join(filter(None, [model, *state.model_notes, words, speed, state.note, state.where, extra]))


def answer_figure(plot: tuple | None):
    """The picture of how the last answer was decoded (`Session.last_plot`), or None."""
    if plot is None:
        return None
    kind, *data = plot
    return {"entropy": entropy_figure, "mixture": alpha_figure}[kind](*data)


def _width(steps: int, height: float) -> tuple[float, float]:
    return min(16.0, max(6.0, 0.32 * steps + 2)), height  # a long answer gets fewer labels, not a wider picture


def _token_ticks(ax, tokens: Sequence[str], most: int = 48) -> None:
    every = max(1, -(-len(tokens) // most))
    ax.set_xticks(range(0, len(tokens), every), [repr(t)[1:-1][:10] for t in tokens[::every]], rotation=90, fontsize=7)


def alpha_figure(alphas: Sequence[float], tokens: Sequence[str]):
    """α* of every token of the mixture's answer (the weight of π_θ in q*; a memory position has none)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=_width(len(alphas), 3.4), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(range(len(alphas)), alphas, marker="o", markersize=3, color="#2563eb")
    ax.axhline(0.5, color="#9ca3af", linewidth=0.8, linestyle="--")
    ax.set_ylim(-0.02, 1.02)
    _token_ticks(ax, tokens)
    ax.set_ylabel("α* (weight of π_θ)")
    ax.set_title("q* ∝ π_θ^α · π_t^(1-α): α* per token of the last answer", fontsize=9)
    return fig


ENTROPY_UNIT = "normalised entropy, H / log2 V (0-1)"  # bits over the most V tokens can have: 0 one-hot, 1 uniform


def entropy_figure(entropies, selected, tokens: Sequence[str], mode: str,
                   layer_tokens: Sequence[Sequence[str]] | None = None):
    """Entropy over layers x generated tokens as a heatmap, the chosen layer of each token marked.

    entropies: [steps, L] in seed 002's unit, H / log2 V (`ENTROPY_UNIT`); selected: [steps] chosen layer;
    tokens: the text of each step's token; layer_tokens: [steps][L] each layer's own most likely token
    (`entropy_record_tokens`), written in its cell when the answer is short enough to read them.
    """
    from matplotlib.figure import Figure  # the object API draws without pyplot's global state or a display

    values = np.asarray(entropies, dtype=float).T  # [L, steps]
    steps = values.shape[1]
    fig = Figure(figsize=_width(steps, 4.2), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(values, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
    ax.scatter(range(steps), list(selected), marker="s", s=18, facecolors="none", edgecolors="#f59e0b",
               label="chosen layer")
    _token_ticks(ax, tokens)
    if layer_tokens is not None and steps <= 40:
        for step, row in enumerate(layer_tokens):
            for layer, text in enumerate(row):
                ax.text(step, layer, repr(text)[1:-1][:6], ha="center", va="center", fontsize=4, color="white")
    ax.set_ylabel("layer")
    ax.set_title(f"entropy of each layer's next-token distribution ({mode}), last answer"
                 + (": each cell its layer's own next token" if layer_tokens is not None else ""), fontsize=9)
    ax.legend(loc="upper right", fontsize=7)
    fig.colorbar(image, ax=ax, label=ENTROPY_UNIT)
    return fig

"""What the page shows, computed from typed events and conversations (pure; no Gradio here)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from chat.session import Conversation
from chat.worker import Failed, Notice, Waiting
from decoding.events import FinishEvent, RecallEvent, TokenEvent
from memory import BankError

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
        elif isinstance(event, Failed):
            self.error = event.message

    @property
    def state(self) -> str:
        if self.error:
            state = f"⚠ {self.error}"
        elif self.done:
            state = {"interrupted": f"stopped after {self.tokens} tokens", "length": "done (max new tokens)",
                     None: "stopped before it started"}.get(self.reason, "done")
        elif self.ahead:
            state = f"waiting: {self.ahead} ahead"
        else:
            state = f"generating… {self.tokens} tokens" if self.tokens else "reading the prompt…"
        return " · ".join([state, *self.notices])


def answer_segments(conv: Conversation, i: int) -> list[Segment]:
    """Stored assistant message `i` as highlight segments, memory markers at their positions."""
    msg = conv.messages[i]
    end = conv.messages[i + 1].start if i + 1 < len(conv.messages) else len(conv.ids)
    decode = lambda a, b: conv.lm.tokenizer.decode(conv.ids[a:b], skip_special_tokens=True)  # noqa: E731
    segments: list[Segment] = []
    cursor = msg.start
    for recall in sorted(msg.recalls, key=lambda r: r.position):  # (a recall read in the prompt comes first)
        if (text := decode(cursor, recall.position)):
            segments.append((text, None))
        segments.append(marker(recall))
        cursor = max(cursor, recall.position + recall.length)
    if (text := decode(cursor, end)):
        segments.append((text, None))
    return segments


def user_message(text: str, images: Sequence[str]) -> dict:
    content: list[Any] = [{"path": str(p)} for p in images]
    if text:
        content.append(text)
    return {"role": "user", "content": content}


def chat_messages(conv: Conversation | None, upto: int | None = None) -> list[dict]:
    """The conversation (its first `upto` messages) as chat-window messages."""
    if conv is None:
        return []
    out = []
    for i, msg in enumerate(conv.messages[:upto]):
        if msg.role == "user":
            out.append(user_message(msg.text, msg.images))
        else:
            note = " _(stopped)_" if msg.finish_reason == "interrupted" else ""
            out.append({"role": "assistant", "content": inline_text(answer_segments(conv, i)) + note})
    return out


def recall_table(conv: Conversation | None, live: TurnView | None = None) -> pd.DataFrame:
    """Every injection of the conversation (and of the answer being written): one row each."""
    answers = [m.recalls for m in conv.messages if m.role == "assistant"] if conv is not None else []
    if live is not None and not live.done:
        answers.append(live.recalls)
    rows = [(turn, r.position, r.length, round(r.score, 4), r.memory_index, r.text or "")
            for turn, recalls in enumerate(answers, 1) for r in recalls]
    return pd.DataFrame(rows, columns=RECALL_COLUMNS)


def bank_summary(db, label: str) -> str:
    if db is None:
        return f"**Bank:** {label}. No memories: recall is off. Build the example bank or upload one."
    index = f", {db.index} index" if db.index != "flat" else ""
    try:
        return (f"**Bank:** {label} · **{len(db)}** memories · {memory_kind(db)} · "
                f"{db.bytes_per_memory() / 1024:.1f} KB a memory{index}")
    except BankError as e:  # a shared store that went away
        return f"**Bank:** {label} · {e}"


def memory_kind(db) -> str:
    """How a bank's memories are read and found, in words."""
    if not db.has_values:
        return f"one {db.dim}-d hidden-state vector each, found by the <recall> state"
    values = db.info.get("values", "values")
    what = "token ids (read as the model's own embeddings)" if db.token_values else f"values of dimension {db.value_dim}"
    return (f"**{values}** {what}, found by the {db.dim}-d text embedding of your "
            f"message ({db.info.get('keys', 'a text encoder')})")


def bank_sample(db, count: int = 8) -> pd.DataFrame:
    try:
        rows = db.entries(0, count) if db is not None else []
    except BankError:  # a shared store that went away: the summary says so
        rows = []
    return pd.DataFrame([(e["index"], e["text"] or "", e["slots"], round(e["norm"], 2)) for e in rows],
                        columns=["memory", "text", "slots", "key norm"])


def found_table(hits: Sequence[dict]) -> pd.DataFrame:
    return pd.DataFrame([(h["index"], round(h["score"], 4), h["text"]) for h in hits],
                        columns=["memory", "similarity", "text"])


def status_line(model: str, db, bank_use: str, speed: float | None, state: str = "") -> str:
    try:
        bank = f"bank: {len(db)} memories ({bank_use})" if db else "bank: none"
    except BankError:  # a shared store that went away (the answer that needed it says why)
        bank = f"bank: unreachable ({bank_use})"
    speed_text = f"last answer {speed:.1f} tokens/s" if speed else "no answer yet"
    return " · ".join(filter(None, [model, bank, speed_text, state]))


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


def entropy_figure(entropies, selected, tokens: Sequence[str], mode: str):
    """Entropy over layers x generated tokens as a heatmap, the chosen layer of each token marked.

    entropies: [steps, L] (nats); selected: [steps] chosen layer; tokens: the text of each step's token.
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
    ax.set_ylabel("layer")
    ax.set_title(f"entropy of each layer's next-token distribution ({mode}), last answer", fontsize=9)
    ax.legend(loc="upper right", fontsize=7)
    fig.colorbar(image, ax=ax, label="entropy (nats)")
    return fig

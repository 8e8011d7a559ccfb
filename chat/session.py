"""A conversation across turns: the exact token ids, the injected memory vectors, the KV cache.

The token ids of every turn are kept exactly as the model read or wrote them (never re-tokenized
from text), so a `<|memory_pad|>` recalled in turn 1 is at the same position in turn 3 and gets
its vector again at prefill, as Qwen3-VL places image features. Each new turn appends only the
chat template's text between the last answer and the new generation prompt, so the KV cache of
the previous turn covers the whole prefix and only the new tokens are prefilled.

A `Session` is what one browser tab (or API request) holds: its conversation, its requests, its bank.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Sequence

import torch

from chat.reading import recall_context
from chat.worker import Request
from chat.users import LOCAL
from decoding.engine import Engine, Prompt, Recall, cache_length, cut_cache, memory_now
from decoding.events import DoneEvent, Event, FinishEvent, GenerationResult, RecallEvent, TokenEvent
from decoding.request import Detokenizer
from decoding.settings import GenerationSettings, RecallSettings
from memory import MemoryVectorDB
from models import LoadedModel
from models.vision import IMAGE_PAD, encode_with_images

_SENTINEL = "\u2063RECALL-CHAT-ANSWER\u2063"
_USER = "\u2063RECALL-CHAT-USER\u2063"  # where the user's own text goes in the template


class TextOnlyModelError(ValueError):
    """Images were attached for a model that reads text only."""


def text_only_message(lm: LoadedModel, images: int) -> str:
    return (f"{lm.name} reads text only: the {images} attached image(s) were not sent; "
            "load a vision-language model (Qwen3-VL) to chat about images")


def on_host(vectors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Memory vectors as the conversation keeps them, on the CPU (a recall on a GPU injects them from the device;
    the next prompt places them with the ones read before, and a saved conversation writes them)."""
    return {p: v.cpu() for p, v in vectors.items()}


@dataclass
class Message:
    role: str  # "user" | "assistant"
    text: str
    images: list[str] = field(default_factory=list)  # paths
    recalls: list[RecallEvent] = field(default_factory=list)  # the injections of an assistant turn
    finish_reason: str | None = None
    start: int = 0  # index in `Conversation.ids` where this message's tokens begin
    said: bool = False  # an answer the app gave itself (`Conversation.say`), not the model


def _content(msg: Message) -> Any:
    if not msg.images:
        return msg.text
    return [{"type": "image"} for _ in msg.images] + [{"type": "text", "text": msg.text}]


class Conversation:
    """State of one chat with one model. Not thread-safe: one request at a time."""

    def __init__(self, lm: LoadedModel, system_prompt: str | None = None, prefill_chunk: int = 512,
                 batch=None):
        self.lm = lm
        self.prefill_chunk = prefill_chunk  # tokens read per forward of a long prompt
        self.batch = batch  # where its answers decode with other sessions' (decoding/batch.py); None: alone
        self.clear()
        self.system_prompt = system_prompt

    def clear(self) -> None:
        """Forget everything, the system prompt included."""
        self.system_prompt = None
        self.messages: list[Message] = []
        self.ids: list[int] = []
        self.memory: dict[int, torch.Tensor] = {}
        self.placed: list[RecallEvent] = []  # memories read in the prompt of the answer to come
        self.pixels: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pixel_values, grid [1, 3]) per image
        self.cache = None  # KV cache over self.ids[:-1]
        self.ahead: list[int] | None = None  # the ids the cache covers after `read_ahead`, until `_settle`
        # turns the model no longer reads (`drop_oldest_turns`), oldest first: shown and saved, not in `ids`; an
        # answer with its pieces (`pieces`) as they were when it left
        self.earlier: list[tuple[Message, tuple[str | RecallEvent, ...]]] = []

    # ----------------------------------------------------------------- building prompts

    def _template(self, messages: list[dict], generation_prompt: bool) -> str:
        if self.system_prompt:
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return self.lm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _delta_text(self, user: Message) -> str:
        """The template text between the end of the last answer and the new generation prompt
        (with `_USER` where the user's own text goes)."""
        history = [{"role": m.role, "content": _content(m)} for m in self.messages]
        new = {"role": "user", "content": _content(Message("user", _USER, user.images))}
        if not history:
            return self._template([new], True)
        history[-1] = {"role": history[-1]["role"], "content": _SENTINEL}
        full = self._template(history + [new], True)
        delta = full[full.rindex(_SENTINEL) + len(_SENTINEL):]
        eos = self.lm.tokenizer.eos_token
        if self.ids and eos and self.ids[-1] == self.lm.tokenizer.eos_token_id and delta.startswith(eos):
            delta = delta[len(eos):]  # the answer already ended with the template's end-of-turn token
        return delta

    def build_inputs(self, text: str, images: Sequence[str] = (), recall_first: bool = False,
                     place: Callable[[int], tuple[list[int], dict, RecallEvent]] | None = None) -> dict:
        """Append a user turn; return the model inputs for the whole conversation. `recall_first` starts the
        answer with `<recall>`; `place` instead reads a memory at the end of the user's message: called with
        the position after `<recall>`, it gives the memory's tokens, vectors and event (`decoding.engine.memory_now`).
        """
        if images and not self.lm.is_vision:
            raise TextOnlyModelError(text_only_message(self.lm, len(images)))
        user = Message("user", text, [str(p) for p in images], start=len(self.ids))
        before, after = self._delta_text(user).split(_USER)
        tok = self.lm.tokenizer
        if self.lm.is_vision:
            enc = encode_with_images(tok, self.lm.image_processor, before, images)
            new_ids = enc["input_ids"][0].tolist()
            grids = enc.get("image_grid_thw")
            if grids is not None:
                counts = grids.prod(-1).tolist()
                for pv, grid in zip(enc["pixel_values"].split(counts), grids):
                    self.pixels.append((pv, grid[None]))
        else:
            new_ids = tok(before, add_special_tokens=False)["input_ids"]
        # the user's text is text: a typed "<|im_start|>" or "<recall>" stays literal, never a control token
        new_ids += tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if place is not None:  # the message, a new line, then the memory, as a model never trained reads best
            new_ids += tok("\n", add_special_tokens=False)["input_ids"] + [self.lm.tokens.recall]
            span, vectors, event = place(len(self.ids) + len(new_ids))
            new_ids += span
            self.memory = {**self.memory, **on_host(vectors)}
            self.placed.append(event)
        new_ids += tok(after, add_special_tokens=False)["input_ids"]
        if recall_first and place is None:
            new_ids = new_ids + [self.lm.tokens.recall]
        self.messages.append(user)
        self.ids = self.ids + new_ids
        return self.inputs()

    def add_answer_text(self, text: str) -> None:
        """An earlier answer given as text (an API client's history): its tokens, then end of turn."""
        if not self.messages or self.messages[-1].role != "user":
            raise ValueError("an assistant message must follow a user message")
        tok = self.lm.tokenizer
        start = len(self.ids)
        self.ids = self.ids + tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        self.ids.append(tok.eos_token_id)
        self.messages.append(Message("assistant", text, start=start, finish_reason="stop"))
        self.cache = None

    def ids_with(self, text: str, images: Sequence[str] = (), recall_first: bool = False) -> list[int]:
        """The conversation's token ids with this message added (nothing is changed)."""
        saved = (self.messages, self.ids, self.pixels)
        self.messages, self.pixels = list(self.messages), list(self.pixels)
        try:
            self.build_inputs(text, images, recall_first)
            return self.ids
        finally:
            self.messages, self.ids, self.pixels = saved

    def length_with(self, text: str, images: Sequence[str] = (), recall_first: bool = False) -> int:
        """How many tokens the conversation would have with this message added (nothing is changed)."""
        return len(self.ids_with(text, images, recall_first))

    def read_ahead(self, text: str, interrupt_event=None) -> Generator[Event, None, bool]:
        """Read the prompt a text message will make, all but its last token, into the KV cache now (the chat's
        memory work runs meanwhile on another thread), yielding its chunks' events; `stream` then prefills one
        token. Only for a text model whose uncached prompt holds no memory vector; returns whether it read it all.
        The cache then runs ahead of `ids` (`ahead`): whatever comes next keeps of it only what its ids begin
        with (`_settle`), so a stop, or a failure before the answer, leaves the conversation as it was."""
        self._settle()
        if self.lm.is_vision:
            return False
        ids = self.ids_with(text)
        start = cache_length(self.cache) if self.cache is not None else 0
        if len(ids) - 1 <= start or any(p >= start for p in self.memory):
            return False
        # (every memory vector is in the cache already: none is placed again)
        prompt, self.cache = Prompt({"input_ids": torch.tensor([ids[:-1]], dtype=torch.long)}, self.cache), None
        read = yield from Engine(self.lm, None, self.prefill_chunk).read(prompt, interrupt_event)  # (failed: no cache)
        self.cache, self.ahead = (prompt.cache if read is None else read), ids[:-1]  # (stopped: a prefix read)
        return read is not None

    def _settle(self) -> None:
        """After `read_ahead`: keep of the cache only the positions the conversation's ids still begin with."""
        if self.ahead is None:
            return
        ahead, self.ahead = self.ahead, None
        if self.cache is None:
            return
        same = next((i for i, (a, b) in enumerate(zip(ahead, self.ids)) if a != b), min(len(ahead), len(self.ids)))
        keep = min(same, len(self.ids) - 1, cache_length(self.cache))
        if keep <= 0:
            self.cache = None
        elif keep < cache_length(self.cache):
            cut_cache(self.cache, keep)

    def pieces(self, i: int) -> tuple[str | RecallEvent, ...]:
        """Stored assistant message `i` in pieces: its text, with each recall at its position."""
        msg = self.messages[i]
        end = self.messages[i + 1].start if i + 1 < len(self.messages) else len(self.ids)
        decode = lambda a, b: self.lm.tokenizer.decode(self.ids[a:b], skip_special_tokens=True)  # noqa: E731
        pieces: list[str | RecallEvent] = []
        cursor = msg.start
        for recall in sorted(msg.recalls, key=lambda r: r.position):  # (a recall read in the prompt comes first)
            if (text := decode(cursor, recall.position)):
                pieces.append(text)
            pieces.append(recall)
            cursor = max(cursor, recall.position + recall.length)
        if (text := decode(cursor, end)):
            pieces.append(text)
        return tuple(pieces)

    def drop_oldest_turns(self, turns: int = 1) -> None:
        """Move the oldest `turns` user messages and their answers out of what the model reads (to `earlier`, still
        shown and saved); the rest keeps its exact tokens and memories, read again once (a turn at a time, a history
        of 161 long messages held the model for minutes)."""
        if not 1 <= turns <= len(self.messages) // 2:
            raise ValueError(f"expected 1 to {len(self.messages) // 2} earlier turns to drop, got {turns}")
        gone = 2 * turns
        kept, old_ids, old_memory = self.messages[gone:], self.ids, self.memory
        system = self.system_prompt
        earlier = [*self.earlier, *((m, self.pieces(i) if m.role == "assistant" else ())
                                    for i, m in enumerate(self.messages[:gone]))]
        self.clear()
        self.system_prompt, self.earlier = system, earlier
        self.rebuild(kept, old_ids, old_memory)

    def rebuild(self, messages: list[Message], ids: list[int], memory: dict[int, torch.Tensor]) -> None:
        """Append `messages`, whose tokens are at their starts in `ids` (with the vectors `memory`), as they were
        sent: each user message through `build_inputs` (with the memory its answer read in the prompt, and the
        `<recall>` of recall first), each answer's own tokens, moved. What `drop_oldest_turns` reads again, and what
        `chat.transcript.load` holds a file's ids to (a token the page never shows is not in them)."""
        for i, m in enumerate(messages):
            if m.role == "user":
                answer = messages[i + 1] if i + 1 < len(messages) else None
                read = [r for r in answer.recalls if r.position < answer.start] if answer else []
                first = bool(answer and not read and answer.start and ids[answer.start - 1] == self.lm.tokens.recall)
                self.placed = []
                self.build_inputs(m.text, m.images, recall_first=first,
                                  place=self._again(read[0], ids, memory) if read else None)
                continue
            end = messages[i + 1].start if i + 1 < len(messages) else len(ids)
            shift = len(self.ids) - m.start
            self.ids = self.ids + ids[m.start:end]
            self.memory.update({p + shift: v for p, v in memory.items() if m.start <= p < end})
            self.messages.append(Message("assistant", m.text, [], [*self.placed, *(
                dataclasses.replace(r, position=r.position + shift)
                for r in m.recalls if r.position >= m.start)], m.finish_reason, m.start + shift, m.said))
        self.placed = []

    def _again(self, event: RecallEvent, ids: list[int], memory: dict[int, torch.Tensor]):
        """`build_inputs`'s `place` for a memory read in an earlier prompt: the same tokens and vectors, moved."""
        def place(position: int):
            shift = position - event.position
            span = ids[event.position:event.position + event.length]
            vectors = {p + shift: memory[p] for p in range(event.position, event.position + event.length)}
            return span, vectors, dataclasses.replace(event, position=position)
        return place

    def inputs(self) -> dict:
        input_ids = torch.tensor([self.ids], dtype=torch.long)
        out = {"input_ids": input_ids}
        if self.lm.is_vision:
            pad_id = self.lm.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
            out["mm_token_type_ids"] = (input_ids == pad_id).to(torch.int32)
            if self.pixels:
                out["pixel_values"] = torch.cat([p for p, _ in self.pixels])
                out["image_grid_thw"] = torch.cat([g for _, g in self.pixels])
        return out

    # ----------------------------------------------------------------- one turn

    def stream(
        self,
        text: str,
        images: Sequence[str] = (),
        settings: GenerationSettings = GenerationSettings(),
        recall: RecallSettings = RecallSettings(),
        memory_db=None,
        interrupt_event=None,
        recall_first: bool = False,
    ) -> Iterator[Event]:
        """Add a user message and stream the answer's events; the turn is stored when it ends. With
        `recall_first` a model trained to recall starts its answer with `<recall>`; any other model reads
        the memory at the end of the user's message (its encoder's `placement`). With no memory to read (none
        at `min_score`), nothing is forced: the model answers from what it knows and the result says it missed
        its recall (a bare `<recall>` with nothing after it ended the answer before it began)."""
        context = self.recall(memory_db, recall, text)
        missed, recall_first = recall_first and not context.active, recall_first and context.active
        place = None
        if recall_first and self.lm.encoder.placement == "user" and memory_db.has_values:
            place = memory_now(context, settings)
        self.placed = []
        inputs = self.build_inputs(text, images, recall_first, place)
        yield from self.placed
        yield from self._run(inputs, len(self.ids), settings, context, interrupt_event, missed)

    def say(self, text: str, images: Sequence[str], reply: str, settings: GenerationSettings,
            interrupt_event=None) -> Iterator[Event]:
        """Add a user message and an answer the app gives itself (the reply to a command, which the model is not
        asked to write), streamed as the model's answers are: its tokens (at most `settings.max_new_tokens`, up to a
        stop), then the end of turn. The KV cache still covers a prefix of the conversation; the next turn reads
        the rest."""
        self._settle()
        self.placed = []
        self.build_inputs(text, images)
        yield from self._said(reply, settings, interrupt_event)

    def _said(self, reply: str, settings: GenerationSettings, interrupt_event=None) -> Iterator[Event]:
        prompt_len, tok = len(self.ids), self.lm.tokenizer
        ids = tok(reply, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        reason = "length" if len(ids) > settings.max_new_tokens else "stop"
        ids, detok, said = ids[:settings.max_new_tokens], Detokenizer(tok), []
        for i, t in enumerate(ids):
            if interrupt_event is not None and interrupt_event.is_set():  # (a stop ends it as it ends the model's)
                reason = "interrupted"
                break
            said.append(t)
            yield TokenEvent(0, t, prompt_len + i, detok.push(t))
        ids = said
        yield FinishEvent(0, reason)
        self.ids = self.ids + ids + [tok.eos_token_id]
        text = tok.decode(ids, skip_special_tokens=True)
        self.messages.append(Message("assistant", text, start=prompt_len, finish_reason=reason, said=True))
        yield DoneEvent(GenerationResult(torch.tensor([self.ids]), prompt_len, [reason], [], [dict(self.memory)]))

    def regenerate(self, settings, recall, memory_db=None, interrupt_event=None) -> Iterator[Event]:
        """Drop the last answer and answer the last user message again."""
        if not self.messages or self.messages[-1].role != "assistant":
            raise ValueError("there is no answer to regenerate")
        answer = self.messages.pop()
        self._truncate(answer.start)
        if answer.said:  # the app's own answer to a command (done already): said again, the model is not asked
            yield from self._said(answer.text, settings, interrupt_event)
            return
        self.placed = [r for r in answer.recalls if r.position < answer.start]  # read in the prompt: kept
        yield from self.placed
        context = self.recall(memory_db, recall, self.messages[-1].text if self.messages else "")
        missed = not context.active and bool(self.ids) and self.ids[-1] == self.lm.tokens.recall
        if missed:  # recall first, with no memory to read now: not forced (as `stream`)
            self._truncate(len(self.ids) - 1)
        yield from self._run(self.inputs(), len(self.ids), settings, context, interrupt_event, missed)

    def _truncate(self, length: int) -> None:
        self.ids = self.ids[:length]
        self.memory = {p: v for p, v in self.memory.items() if p < length}
        if self.cache is not None:
            cut_cache(self.cache, length - 1)  # keep the cache short of the last token

    def recall(self, memory_db, settings: RecallSettings, text: str = "") -> Recall:
        """The loop's recall context for a message (`chat.reading.recall_context`)."""
        return recall_context(self.lm, memory_db, settings, text)

    def _run(self, inputs, prompt_len, settings, recall: Recall, interrupt_event,
             missed: bool = False) -> Iterator[Event]:
        """Answer `inputs`; `missed`: recall first was asked with no memory to read (the result says so)."""
        self._settle()
        past = self.cache if self.cache is not None and cache_length(self.cache) < prompt_len else None
        answer = Message("assistant", "", start=prompt_len)
        result: GenerationResult | None = None
        try:
            engine = Engine(self.lm, self.batch, self.prefill_chunk)
            for event in engine.stream(Prompt(inputs, past, self.memory), settings, recall, interrupt_event):
                if isinstance(event, DoneEvent):
                    result = event.result
                    if missed:
                        result.missed_recall = [True]
                yield event
        finally:
            self.cache = None
            if result is not None:  # the turn is stored whole, or not at all
                self.ids = result.sequences[0].tolist()
                opener = self.lm.turn_opener
                if opener is not None and len(self.ids) > prompt_len and self.ids[-1] == opener:
                    self.ids[-1] = self.lm.tokenizer.eos_token_id  # (the answer ended opening a turn: its end)
                self.memory = on_host(result.memory_vectors[0])
                self.cache = result.cache
                answer.text = self.lm.tokenizer.decode(self.ids[prompt_len:], skip_special_tokens=True)
                answer.recalls = [*self.placed, *result.injections]
                answer.finish_reason = result.finish_reasons[0]
                self.messages.append(answer)
            else:  # failed or abandoned before the end: forget the user turn's tokens
                user = self.messages.pop() if self.messages and self.messages[-1].role == "user" else None
                self._truncate(user.start if user else prompt_len)
                self.cache = None


@dataclass(eq=False)
class Session:
    """One browser tab: its conversation, its running request, its bank choice."""

    id: int
    user: str = LOCAL  # whose memory it reads and writes (one local user without a users file)
    conv: Conversation | None = None
    bank_use: str = "shared"  # shared | example | own
    own_bank: MemoryVectorDB | None = None
    own_label: str = ""
    bank_chosen: int = 0  # counts the choices of its bank (an upload, a bank chosen): a write queued before one is
    # refused, not made to the bank it no longer uses (`chat.banks.Banks.write`)
    active: list[Request] = field(default_factory=list)  # the answers it runs or waits for
    last_speed: float | None = None
    last_plot: tuple | None = None  # how the last answer was decoded: ("entropy" | "mixture", data...), see chat.view
    last_note: str = ""  # the same in words, for the status line (the mixture's acceptance rate)
    last_change: Any = None  # the last message's change to its user's memory (`chat.changes.Remembered`), to undo
    lock: threading.Lock = field(default_factory=threading.Lock)  # the conversation; held for a whole turn
    files: Path | None = None  # its own folder: saved conversations, banks, images of loaded conversations
    last_used: float = field(default_factory=time.monotonic)
    expired: float | None = None  # freed for being idle this many seconds (`chat.janitor`): said at its next answer
    lost: bool = False  # its page shows a conversation it never held (the server restarted): said at its next answer

    def __deepcopy__(self, memo: dict) -> Session:
        return self  # a live handle: Gradio's State deep-copies initial values, this one must stay itself

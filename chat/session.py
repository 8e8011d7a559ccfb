"""A conversation across turns: the exact token ids, the injected memory vectors, the KV cache.

The token ids of every turn are kept exactly as the model read or wrote them (never re-tokenized
from text), so a `<|memory_pad|>` recalled in turn 1 is at the same position in turn 3 and gets
its vector again at prefill, as Qwen3-VL places image features. Each new turn appends only the
chat template's text between the last answer and the new generation prompt, so the KV cache of
the previous turn covers the whole prefix and only the new tokens are prefilled.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from chat.models import LoadedModel
from chat.vision import IMAGE_PAD, encode_with_images
from decoding.events import DoneEvent, Event, GenerationResult
from decoding.loop import stream_generate
from decoding.settings import GenerationSettings, RecallSettings

_SENTINEL = "\u2063RECALL-CHAT-ANSWER\u2063"


class TextOnlyModelError(ValueError):
    """Images were attached for a model that reads text only."""


@dataclass
class Message:
    role: str  # "user" | "assistant"
    text: str
    images: list[str] = field(default_factory=list)  # paths
    recalls: list[dict] = field(default_factory=list)  # RecallEvent fields, for assistant turns
    finish_reason: str | None = None
    start: int = 0  # index in `Conversation.ids` where this message's tokens begin


def _content(msg: Message) -> Any:
    if not msg.images:
        return msg.text
    return [{"type": "image"} for _ in msg.images] + [{"type": "text", "text": msg.text}]


class Conversation:
    """State of one chat with one model. Not thread-safe: one request at a time."""

    def __init__(self, lm: LoadedModel, system_prompt: str | None = None):
        self.lm = lm
        self.system_prompt = system_prompt
        self.clear()

    def clear(self) -> None:
        self.messages: list[Message] = []
        self.ids: list[int] = []
        self.memory: dict[int, torch.Tensor] = {}
        self.pixels: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pixel_values, grid [1, 3]) per image
        self.cache = None  # KV cache over self.ids[:-1]

    # ----------------------------------------------------------------- building prompts

    def _template(self, messages: list[dict], generation_prompt: bool) -> str:
        if self.system_prompt:
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return self.lm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _delta_text(self, user: Message) -> str:
        """The template text between the end of the last answer and the new generation prompt."""
        history = [{"role": m.role, "content": _content(m)} for m in self.messages]
        new = {"role": "user", "content": _content(user)}
        if not history:
            return self._template([new], True)
        history[-1] = {"role": history[-1]["role"], "content": _SENTINEL}
        full = self._template(history + [new], True)
        delta = full[full.rindex(_SENTINEL) + len(_SENTINEL):]
        eos = self.lm.tokenizer.eos_token
        if self.ids and eos and self.ids[-1] == self.lm.tokenizer.eos_token_id and delta.startswith(eos):
            delta = delta[len(eos):]  # the answer already ended with the template's end-of-turn token
        return delta

    def build_inputs(self, text: str, images: Sequence[str] = (), recall_first: bool = False) -> dict:
        """Append a user turn; return the model inputs for the whole conversation."""
        if images and not self.lm.is_vision:
            raise TextOnlyModelError(
                f"{self.lm.name} reads text only: the {len(images)} attached image(s) were not sent; "
                "load a vision-language model (Qwen3-VL) to chat about images")
        user = Message("user", text, [str(p) for p in images], start=len(self.ids))
        delta = self._delta_text(user)
        tok = self.lm.tokenizer
        if self.lm.is_vision:
            enc = encode_with_images(tok, self.lm.image_processor, delta, images)
            new_ids = enc["input_ids"][0].tolist()
            grids = enc.get("image_grid_thw")
            if grids is not None:
                counts = grids.prod(-1).tolist()
                for pv, grid in zip(enc["pixel_values"].split(counts), grids):
                    self.pixels.append((pv, grid[None]))
        else:
            new_ids = tok(delta, add_special_tokens=False)["input_ids"]
        if recall_first:
            new_ids = new_ids + [self.lm.tokens.recall]
        self.messages.append(user)
        self.ids = self.ids + new_ids
        return self.inputs()

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
        """Add a user message and stream the answer's events; the turn is stored when it ends."""
        inputs = self.build_inputs(text, images, recall_first)
        prompt_len = len(self.ids)
        yield from self._run(inputs, prompt_len, settings, recall, memory_db, interrupt_event)

    def regenerate(self, settings, recall, memory_db=None, interrupt_event=None) -> Iterator[Event]:
        """Drop the last answer and answer the last user message again."""
        if not self.messages or self.messages[-1].role != "assistant":
            raise ValueError("there is no answer to regenerate")
        answer = self.messages.pop()
        self._truncate(answer.start)
        yield from self._run(self.inputs(), len(self.ids), settings, recall, memory_db, interrupt_event)

    def _truncate(self, length: int) -> None:
        self.ids = self.ids[:length]
        self.memory = {p: v for p, v in self.memory.items() if p < length}
        if self.cache is not None:
            extra = self.cache.get_seq_length() - (length - 1)  # keep the cache short of the last token
            if extra > 0:
                self.cache.crop(-extra)

    def _run(self, inputs, prompt_len, settings, recall, memory_db, interrupt_event) -> Iterator[Event]:
        past = self.cache if self.cache is not None and self.cache.get_seq_length() < prompt_len else None
        answer = Message("assistant", "", start=prompt_len)
        result: GenerationResult | None = None
        try:
            for event in stream_generate(
                self.lm.model, inputs, settings, recall=recall, recall_token_ids=self.lm.tokens.as_dict(),
                memory_db=memory_db, tokenizer=self.lm.tokenizer, interrupt_event=interrupt_event,
                past_key_values=past, memory_vectors=self.memory,
            ):
                if isinstance(event, DoneEvent):
                    result = event.result
                yield event
        finally:
            self.cache = None
            if result is not None:  # the turn is stored whole, or not at all
                self.ids = result.sequences[0].tolist()
                self.memory = result.memory_vectors[0]
                self.cache = result.cache
                answer.text = self.lm.tokenizer.decode(self.ids[prompt_len:], skip_special_tokens=True)
                answer.recalls = [asdict(r) for r in result.injections]
                answer.finish_reason = result.finish_reasons[0]
                self.messages.append(answer)
            else:  # failed or abandoned before the end: forget the user turn's tokens
                user = self.messages.pop() if self.messages and self.messages[-1].role == "user" else None
                self._truncate(user.start if user else prompt_len)
                self.cache = None

    # ----------------------------------------------------------------- saving

    def to_json(self) -> str:
        return json.dumps({
            "format": "recall-chat/conversation-1",
            "model": self.lm.name,
            "system_prompt": self.system_prompt,
            "messages": [asdict(m) for m in self.messages],
            "ids": self.ids,
            "memory": {str(p): _encode_tensor(v) for p, v in self.memory.items()},
        })

    def load_json(self, text: str) -> None:
        """Replace this conversation by a saved one (images are re-read from their paths)."""
        data = json.loads(text)
        if data.get("format") != "recall-chat/conversation-1":
            raise ValueError(f"not a saved recall-chat conversation (format {data.get('format')!r})")
        ids = [int(i) for i in data["ids"]]
        memory = {int(p): _decode_tensor(v) for p, v in data.get("memory", {}).items()}
        hidden = self.lm.hidden_size
        for pos, vec in memory.items():
            if vec.shape != (hidden,):
                raise ValueError(f"saved memory at position {pos} has shape {tuple(vec.shape)}, "
                                 f"the model's hidden size is {hidden}")
            if not 0 <= pos < len(ids) or ids[pos] != self.lm.tokens.memory_pad:
                raise ValueError(f"saved memory position {pos} does not hold <|memory_pad|>")
        messages = [Message(**m) for m in data["messages"]]
        pixels = []
        for m in messages:
            for path in m.images:
                if not self.lm.is_vision:
                    raise TextOnlyModelError(f"the conversation has images but {self.lm.name} reads text only")
                if not Path(path).is_file():
                    raise FileNotFoundError(f"image {path!r} of the saved conversation is missing")
                enc = encode_with_images(self.lm.tokenizer, self.lm.image_processor, IMAGE_PAD, [path])
                pixels.append((enc["pixel_values"], enc["image_grid_thw"]))
        self.clear()
        self.system_prompt = data.get("system_prompt")
        self.messages, self.ids, self.memory, self.pixels = messages, ids, memory, pixels


def _encode_tensor(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t.detach().float().cpu().clone(), buf)
    return base64.b64encode(buf.getvalue()).decode()


def _decode_tensor(s: str) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(s)), weights_only=True, map_location="cpu")

"""What an OpenAI chat request brings, checked: its pydantic schema, the settings it overrides, its messages' text
and images, and the OpenAI-style error that refuses it (`APIError`, with the field it names). The routes that use
them are `chat.openai_api`."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Annotated, Any, Literal, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from chat.config import Config, ConfigError, setting_value
from chat.inputs import check_image, deepest, describe
from chat.worker import Failed, ShuttingDown
from decoding.settings import BEAM_SEARCH

ALIAS = "recall-chat"  # always accepted as the model name
MAX_SEED = 2 ** 64 - 1  # the largest seed a generator takes (torch's: an unsigned 64-bit integer)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    @classmethod
    def of(cls, failed: Failed, body: ChatRequest | None = None) -> APIError:
        """An answer's failure: refused (400, the request asked for what cannot be done: named as `body` sent it),
        the server shutting down (503) or the answer failing (500)."""
        if failed.cause == "refused":  # (the messages, or a setting the model cannot run: its message names it)
            message = failed.api or failed.message
            if message.startswith("messages"):
                return cls(400, message, param="messages")
            return cls(400, message) if body is None else settings_error(message, body)
        if failed.cause == "shutdown":
            return cls.shutting_down(failed.message)
        return cls(500, failed.message, "server_error")

    @classmethod
    def shutting_down(cls, message: str | ShuttingDown) -> APIError:
        return cls(503, str(message), "server_error", code="server_shutting_down")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]  # (developer: OpenAI's newer name for system)
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]


class MemoryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1)


class _NullIsDefault(BaseModel):
    """OpenAI's schema lets a client send null for any optional field (some clients send every field): null is then
    the field's default, for the fields whose default is not null too (`n`, `stream`, `presence_penalty`, ...)."""

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class StreamOptions(_NullIsDefault):
    include_usage: bool = Field(False, strict=True)  # (strict: "yes" is not true)


class ChatRequest(_NullIsDefault):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1, max_length=500)
    # (strict: `true` is not 1.0; NaN and Infinity, which Python's JSON reads, are not numbers here)
    temperature: float | None = Field(None, ge=0, le=2, strict=True, allow_inf_nan=False)
    # (top_p 0: the most likely token alone, as OpenAI and the page)
    top_p: float | None = Field(None, ge=0, le=1, strict=True, allow_inf_nan=False)
    max_tokens: int | None = Field(None, ge=1, strict=True)  # (strict: `true` is not 1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    stop: str | list[str] | None = None
    stream_options: StreamOptions | None = None  # include_usage: a last chunk with the usage
    seed: int | None = Field(None, ge=0, le=MAX_SEED, strict=True)
    stream: bool = Field(False, strict=True)  # (strict: "yes" and 1 are not true)
    n: int = Field(1, ge=1, le=1, strict=True)
    logit_bias: dict[str, Annotated[float, Field(strict=True)]] | None = None  # token id -> -100..100, to its logit
    # extensions (with the `openai` client, pass them in `extra_body`), named as vLLM names them
    top_k: int | None = Field(None, ge=0, strict=True)
    min_p: float | None = Field(None, ge=0, le=1, strict=True, allow_inf_nan=False)
    typical_p: float | None = Field(None, gt=0, le=1, strict=True, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, strict=True, allow_inf_nan=False)
    recall_first: bool = Field(False, strict=True)  # start the answer with <recall> (strict, as `stream`)
    settings: dict[str, Any] = {}  # any `generation.*`, `mixture.*` or `recall.*` setting, by its configuration key
    num_beams: int | None = None  # beam search's settings: passed on so the settings refuse them by name
    num_beam_groups: int | None = None
    diversity_penalty: float | None = None
    # OpenAI's fields this server does not do: refused (400) unless left at what they are when not sent
    presence_penalty: float = 0
    frequency_penalty: float = 0
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    response_format: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if any(not s for s in ([stop] if isinstance(stop, str) else stop or [])):
            raise ValueError(f"expected non-empty strings (an empty one ends every answer at once), got {stop!r}")
        return stop


# OpenAI's fields this server does not do: the values that leave them off (the first is said), what to use instead.
UNSUPPORTED = {"presence_penalty": ((0,), "use repetition_penalty"),
               "frequency_penalty": ((0,), "use repetition_penalty"), "logprobs": ((False,), None),
               "top_logprobs": ((None, 0), None),
               "tools": ((None, []), "the answer's tool calls are not parsed"), "tool_choice": ((None, "none"), None),
               "functions": ((None, []), None), "function_call": ((None, "none"), None),
               "response_format": ((None, {"type": "text"}), None)}
SAMPLING = ("top_p", "top_k", "min_p", "typical_p")  # given without a temperature: they sample


def _param(error: ValidationError) -> str | None:
    """The request field a validation error is about (None: the body as a whole, e.g. not JSON)."""
    loc = deepest(error)["loc"]
    return str(loc[0]) if loc else None


def parts(message: ChatMessage, index: int) -> tuple[str, list[bytes]]:
    """The message's text and its images, each checked to be a readable image of a sane size (`APIError` naming
    the part, as `messages.<i>.content.<j>`, otherwise)."""
    if isinstance(message.content, str):
        return message.content, []
    text, images = [], []
    for k, part in enumerate(message.content):
        if isinstance(part, TextPart):
            text.append(part.text)
            continue
        url, where = part.image_url.url, f"messages.{index}.content.{k}.image_url"
        if not url.startswith("data:image/") or ";base64," not in url:
            raise APIError(400, f"{where}: expected a data:image/...;base64,... URL (nothing is fetched), "
                                f"got {url[:40]!r}", param="messages")
        try:
            raw = base64.b64decode(url.split(",", 1)[1], validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, f"{where}: expected base64 image data, got invalid base64", param="messages") from None
        try:
            images.append(check_image(raw, where))
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
    return "\n".join(text), images


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], raw: bytes) -> M:
    """The request body as `model`; a 400 naming the field (or the body as a whole) otherwise."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise APIError(400, describe(e, "the request body"), param=_param(e)) from None


SERVER_FILES = frozenset({"mixture.target", "mixture.gguf", "mixture.head"})  # settings that name a file


def overrides(body: ChatRequest, cfg: Config) -> dict[str, Any]:
    """The configuration keys the request sets (`chat.config.request_settings` checks their values): its fields,
    then its `settings`; the answer's length is `generation.max_new_tokens` unless the request gives one. A sampling
    field (`top_p`, `top_k`, `min_p`, `typical_p`) sent without `temperature` samples at the configured temperature
    (as OpenAI's default temperature, 1, samples); `temperature: 0` is greedy whatever else is sent."""
    for name, (off, instead) in UNSUPPORTED.items():
        if (value := getattr(body, name)) not in off:
            raise APIError(400, f"{name}: not supported by this server (expected {off[0]!r}), got {value!r}"
                                + (f"; {instead}" if instead else ""), param=name)
    if body.stream_options is not None and not body.stream:  # (as OpenAI answers)
        raise APIError(400, "stream_options: only allowed when stream is true, got stream false",
                       param="stream_options")
    if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
        raise APIError(400, f"max_tokens and max_completion_tokens: expected one of them (or the same value), "
                            f"got {body.max_tokens} and {body.max_completion_tokens}", param="max_tokens")
    gen: dict[str, Any] = {"generation.max_new_tokens": body.max_completion_tokens or body.max_tokens
                           or cfg.generation.max_new_tokens}
    if body.temperature is not None:
        gen.update({"generation.do_sample": body.temperature > 0, "generation.temperature": body.temperature or 1.0})
    implied = {"generation.do_sample": True} if body.temperature is None and any(
        getattr(body, name) is not None for name in SAMPLING) else {}
    for name in (*SAMPLING, "repetition_penalty", "seed", *BEAM_SEARCH):  # (beams: refused by the settings unless off)
        if getattr(body, name) is not None:
            gen[f"generation.{name}"] = getattr(body, name)
    if body.stop:
        gen["generation.stop_strings"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if body.logit_bias:
        gen["generation.sequence_bias"] = [[[_token_id(k)], _bias(k, v)] for k, v in body.logit_bias.items()]
    for key, value in body.settings.items():
        try:
            configured = setting_value(cfg, key)
        except ConfigError as e:
            raise APIError(400, f"settings: {e}", param="settings") from None
        if key in SERVER_FILES and value != configured:  # (a caller loaded any model folder of the server, each kept)
            raise APIError(400, f"settings[{key!r}]: a file of the server, set by its configuration (generation.{key}: "
                                f"{configured!r}), not by a request; got {value!r}", param="settings")
        if key in gen and (key != "generation.max_new_tokens" or body.max_tokens or body.max_completion_tokens):
            raise APIError(400, f"settings: {key!r} is set by a field of the request too; expected one of them",
                           param="settings")
    return {**implied, **gen, **body.settings}


FIELDS = {"sequence_bias": "logit_bias", "stop_strings": "stop", "max_new_tokens": "max_tokens"}  # setting: field


def settings_error(error: ValueError | str, body: ChatRequest) -> APIError:
    """A setting's refusal (its message opens with the field's name: "top_p is 0.0: ...", "sequence_bias: expected
    ...", "mixture alpha is -0.1: ...") as a 400 that names what the request sent: the key of `settings` that set
    it, or its field of the request by the request's name (`logit_bias` for `sequence_bias`, `stop`, `max_tokens`)."""
    message = str(error)
    words = message.split(" ", 2)
    field = words[0].rstrip(":")
    if field == "mixture" and len(words) > 1:  # ("mixture alpha is ...": the mixture's own checks)
        field = words[1].rstrip(":")
    keys = [key for key in body.settings if key.rsplit(".", 1)[-1] == field]
    if len(keys) == 1:
        return APIError(400, f"settings[{keys[0]!r}]: {message}", param="settings")
    name = FIELDS.get(field, field)
    if not keys and getattr(body, name, None) is not None:
        return APIError(400, name + message[len(field):] if message.startswith(field) else message, param=name)
    # a refusal of two settings at once, or of what the backend runs, names the one the request sent in its words
    named = [key for key in body.settings
             if any(re.search(rf"\b{re.escape(part)}\b", message) for part in key.split(".") if part != "generation")]
    return APIError(400, message, param="settings" if named else None)


def _token_id(key: str) -> int:
    if not (key.isascii() and key.isdigit()):  # ("１２" is not token 12)
        raise APIError(400, f"logit_bias: expected token ids as keys (strings of digits), got {key!r}",
                       param="logit_bias")
    return int(key)


def _bias(key: str, value: float) -> float:
    if not -100 <= value <= 100:
        raise APIError(400, f"logit_bias[{key!r}]: expected a bias from -100 to 100, got {value}", param="logit_bias")
    return value

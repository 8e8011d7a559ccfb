"""An OpenAI-compatible HTTP API on the same server and model worker as the page.

    POST /v1/chat/completions   (stream as server-sent events, or one JSON answer)
    GET  /v1/models

Requests are checked with pydantic and refused with OpenAI-style error JSON and status codes
(`chat.openai_request`).
Each request is a fresh session: the messages are its conversation (images as data: URLs, never
fetched), the answer runs on the shared worker, taking turns with everyone else, and the session is
freed at the end. A client that disconnects stops its answer. Recall events travel as an extra
`recall` field in each chunk (and `recalls` in a whole answer), notices about the answer (a memory the
model looked for and found none, turns dropped to fit) as `notice` (`notices`), which standard clients
ignore.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, StreamingResponse
from starlette.routing import Match

from chat.api import ChatService
from chat.config import request_settings
from chat.openai_request import ALIAS, APIError, ChatRequest, MemoryRequest, overrides, parse, parts, settings_error
from chat.changes import Remembered, public
from chat.session import Session
from chat import operations as ops
from chat.users import LOCAL, UsersError
from memory import BankError
from memory.validate import shown
from chat.worker import END, Failed, Notice, ServerFault, ServiceError, ShuttingDown
from chat.worker import Request as WorkerRequest
from decoding.events import DoneEvent, FinishEvent, RecallEvent, TokenEvent

FINISH = {"stop": "stop", "length": "length", "tool_call": "tool_calls", "interrupted": "stop"}

log = logging.getLogger("chat.openai_api")


class OpenAIRoutes:
    """The /v1 routes over a `ChatService`."""

    def __init__(self, service: ChatService):
        self.service = service
        self.router = APIRouter(prefix="/v1")
        self.router.add_api_route("/models", self.models, methods=["GET"])
        self.router.add_api_route("/chat/completions", self.completions, methods=["POST"])
        self.router.add_api_route("/memories", self.list_memories, methods=["GET"])
        self.router.add_api_route("/memories", self.add_memory, methods=["POST"])
        self.router.add_api_route("/memories", self.delete_memories, methods=["DELETE"])
        self.router.add_api_route("/memories/{memory_id}", self.delete_memory, methods=["DELETE"])
        self.router.add_api_route("/{path:path}", self.unknown, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])

    async def unknown(self, request: Request, path: str):
        """Any other /v1 request, in OpenAI's error JSON (FastAPI's own said {"detail": "Not Found"}): a route's path
        with a trailing slash redirected to it (as FastAPI does), 405 naming the methods of a route it has (`Allow`),
        else 404 naming the routes."""
        def methods(scope) -> list[str]:
            return sorted({m for r in self.router.routes[:-1] if r.matches(scope)[0] != Match.NONE for m in r.methods})

        asked = request.url.path
        if asked.endswith("/") and methods({**request.scope, "path": asked.rstrip("/")}):
            return RedirectResponse(str(request.url.replace(path=asked.rstrip("/"))), status_code=307)
        if allowed := methods(request.scope):
            response = APIError(405, f"{request.method} {shown(asked)}: expected {' or '.join(allowed)}",
                                code="method_not_allowed").response()
            response.headers["Allow"] = ", ".join(allowed)
            return response
        return APIError(404, f"{shown(asked)}: no such route; expected /v1/models, /v1/chat/completions, /v1/memories or "
                             "/v1/memories/<id>", code="not_found").response()

    @property
    def model_id(self) -> str:
        lm = self.service.lm
        return lm.name if lm is not None else ALIAS

    async def user_of(self, request: Request) -> str:
        """The user the request's key belongs to (`app.users_file`), or the one local user (checked against
        `app.api_key` when set); 401 otherwise."""
        header = request.headers.get("authorization", "")
        sent = header[7:].strip() if header[:7].lower() == "bearer " else ""
        users = self.service.users
        if users is not None:
            try:
                user = await asyncio.to_thread(users.user_of_key, sent) if sent else None  # scrypt: off the loop
            except UsersError as e:  # (the file changed into one that cannot be read: a bare 500 before; the
                log.error("/v1 refused: %s", e)  # details are the server's: any caller sees this)
                raise APIError(500, "the server's users file cannot be read (its log says why)", "server_error") \
                    from None
        else:
            key = self.service.cfg.app.api_key
            user = LOCAL if key is None or hmac.compare_digest(sent.encode(), key.encode()) else None
        if user is None:
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", "authentication_error",
                           code="invalid_api_key")
        return user

    async def body(self, request: Request) -> bytes:
        """The request's body, at most `memory.max_upload_mb` (a 100 MB body was read and parsed whole); 413 past it,
        read no further."""
        limit = self.service.cfg.memory.max_upload_mb * 2 ** 20

        def over(got: str) -> APIError:
            return APIError(413, f"the request body: expected at most {limit} bytes (memory.max_upload_mb), got {got}")

        told = request.headers.get("content-length", "")
        if told.isascii() and told.isdigit() and int(told) > limit:
            raise over(told)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise over("more")
            chunks.append(chunk)
        return b"".join(chunks)

    async def models(self, request: Request):
        try:
            await self.user_of(request)
        except APIError as e:
            return e.response()
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0,
                                            "owned_by": "recall-chat"}]}

    async def completions(self, request: Request):
        try:
            user = await self.user_of(request)
            body = parse(ChatRequest, await self.body(request))
            await self.loaded()
            if body.model not in (self.model_id, ALIAS):  # (the alias is what /v1/models says while loading)
                raise APIError(404, f"model {body.model!r} does not exist; this server serves {self.model_id!r}",
                               param="model", code="model_not_found")
            session, turn = await asyncio.to_thread(self.start, body, user)  # (its history is read: off the loop)
            if body.stream:
                return StreamingResponse(self.chunks(request, session, turn, body), media_type="text/event-stream")
            return await self.whole(request, session, turn, body)
        except APIError as e:
            return e.response()

    async def loaded(self) -> None:
        """Wait for the model to be loaded (it loads on first use); 503 while the server shuts down, 500 when the
        model cannot be loaded."""
        try:
            await self.service.wait_for(self.service.ready())
        except ShuttingDown as e:
            raise APIError.shutting_down(e) from None
        except ServiceError as e:
            raise APIError(500, str(e), "server_error") from None

    def start(self, body: ChatRequest, user: str):
        """A fresh session of `user` holding the request's conversation, with its answer queued."""
        svc = self.service
        gen = overrides(body, svc.cfg)
        s = svc.new_session(user)
        try:
            try:
                settings, recall = request_settings(svc.cfg, gen)
            except ValueError as e:
                raise settings_error(e, body) from None
            *history, last = body.messages
            if last.role != "user":
                raise APIError(400, f"messages: expected the last message to be from the user, got {last.role!r}",
                               param="messages")
            past = []
            for i, message in enumerate(history):
                text, images = parts(message, i)
                role = "system" if message.role == "developer" else message.role
                if images and role != "user":  # (as OpenAI: a system or assistant message's parts are text)
                    raise APIError(400, f"messages.{i}.content: expected text in a {message.role} message (images go "
                                        f"in user messages), got {len(images)} image(s)", param="messages")
                past.append((role, text, images))
            text, images = parts(last, len(history))
            if not text.strip() and not images:  # (the service's own "type a message" names no field)
                got = (repr(last.content) if last.content else "an empty string") if isinstance(last.content, str) \
                    else "no text and no image"
                raise APIError(400, f"messages.{len(history)}.content: expected the message's text or an image, got "
                               f"{got}", param="messages")
            try:
                return s, svc.chat(s, text, self.files(s, images), settings, recall, body.recall_first, past)
            except ValueError as e:  # (the service's checks of a message: "message: expected at most ...")
                if str(e).startswith("message:"):
                    raise APIError(400, f"messages.{len(history)}.content{str(e)[len('message'):]}",
                                   param="messages") from None
                raise
        except APIError:
            svc.end_session(s)
            raise
        except ShuttingDown as e:
            svc.end_session(s)
            raise APIError.shutting_down(e) from None
        except (ValueError, ServiceError) as e:
            svc.end_session(s)
            if getattr(e, "api", None):
                raise APIError(400, e.api) from None
            raise settings_error(e, body) from None

    # ------------------------------------------------------------------ the caller's own memory

    async def _on_memory(self, request: Request, op, *args: Any, param: str | None = None) -> Any:
        """Run a memory operation for the request's user (waiting for a queued one); its refusal as an `APIError`
        (an id that is not the caller's: 404; a refused request names `param`, the field it sent)."""
        user = await self.user_of(request)
        svc = self.service
        await self.loaded()
        s = svc.new_session(user)
        try:
            value = await asyncio.to_thread(svc.run, op, s, *args)
            return await svc.wait_for(value) if isinstance(value, WorkerRequest) else value
        except KeyError as e:
            raise APIError(404, str(e.args[0]), code="memory_not_found") from None
        except ShuttingDown as e:
            raise APIError.shutting_down(e) from None
        except (BankError, ServerFault) as e:  # (the server's memory file cannot be read: not the request's fault)
            raise APIError(500, str(e), "server_error") from None
        except (ValueError, ServiceError) as e:
            raise APIError(400, str(e), param=param) from None
        finally:
            await asyncio.to_thread(svc.end_session, s)

    async def list_memories(self, request: Request):
        try:
            return {"object": "list", "data": await self._on_memory(request, ops.my_memories)}
        except APIError as e:
            return e.response()

    async def add_memory(self, request: Request):
        try:
            body = parse(MemoryRequest, await self.body(request))
            done = await self._on_memory(request, ops.remember, body.text, param="text")
            if done.written:
                return JSONResponse(dict(public(done.written[0]), object="memory",
                                         superseded=[public(e) for e in done.superseded]), status_code=201)
            return JSONResponse({"object": "memory", "text": body.text, "duplicate": True, "note": done.note})
        except APIError as e:
            return e.response()

    async def delete_memory(self, request: Request, memory_id: str):
        try:
            gone = await self._on_memory(request, ops.forget_memories, [memory_id])
            return {"id": gone[0]["id"], "object": "memory", "deleted": True}
        except APIError as e:
            return e.response()

    async def delete_memories(self, request: Request):
        try:
            return {"object": "list", "deleted": await self._on_memory(request, ops.forget_all_memories)}
        except APIError as e:
            return e.response()

    @staticmethod
    def files(s: Session, images: list[bytes]) -> list[str]:
        """The message's images (checked) as files of the session's folder."""
        paths = []
        for raw in images:
            path = s.files / f"api-{uuid.uuid4().hex}.png"
            path.write_bytes(raw)
            paths.append(str(path))
        return paths

    async def events(self, request: Request, session: Session, turn) -> AsyncIterator[Any]:
        """The answer's events; a disconnected client stops it (asked at least every half second, while tokens
        flow too: a whole answer's client sees nothing until the end); the session is freed at the end."""
        req, asked = turn.request, time.monotonic()
        try:
            while (event := await self.service.next_event(req, 0.5)) is not END:
                if event is None or time.monotonic() - asked >= 0.5:
                    asked = time.monotonic()
                    if await request.is_disconnected():
                        return
                    if event is None:
                        continue
                yield event
        finally:
            if not req.done.is_set():
                self.service.withdraw(req)
            await asyncio.to_thread(self.service.end_session, session)  # (it waits for the answer's end: a client
            # gone mid-answer held every other caller of this event loop until then)

    async def chunks(self, request: Request, session: Session, turn, body: ChatRequest) -> AsyncIterator[str]:
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: dict | None, finish: str | None = None, **extra) -> str:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
            data = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_id,
                    "choices": choices, **extra}
            return f"data: {json.dumps(data)}\n\n"

        yield chunk({"role": "assistant", "content": ""})
        text, finish = StopText(body.stop), None  # the finish chunk goes last (a notice can follow the answer's end)
        failed, tokens, prompt = False, 0, 0
        async for event in self.events(request, session, turn):
            if failed:
                continue
            if isinstance(event, DoneEvent):
                prompt = event.result.prompt_length
            elif isinstance(event, TokenEvent):
                tokens += 1
                if event.text and (out := text.push(event.text)):
                    yield chunk({"content": out})
            elif isinstance(event, RecallEvent):
                yield chunk({}, recall=_recall(event))
            elif isinstance(event, Notice):
                yield chunk({}, notice=event.text)
            elif isinstance(event, Remembered):
                yield chunk({}, **_memory_changes(event), **({"notice": event.note} if event.note else {}))
            elif isinstance(event, FinishEvent):
                if out := text.finish():
                    yield chunk({"content": out})
                finish = chunk({}, FINISH[event.reason])
            elif isinstance(event, Failed):  # (then the answer has ended: what follows, a finish, is not sent)
                failed = True
                yield f"data: {json.dumps(APIError.of(event, body).body())}\n\n"
        if finish is not None and not failed:
            yield finish
            if body.stream_options is not None and body.stream_options.include_usage:  # (OpenAI: no choices)
                yield chunk(None, usage=_usage(prompt, tokens))
        yield "data: [DONE]\n\n"

    async def whole(self, request: Request, session: Session, turn, body: ChatRequest) -> JSONResponse:
        text, recalls, notices, reason, tokens, prompt = StopText(body.stop), [], [], "stop", 0, 0
        changes: dict[str, list] = {"remembered": [], "forgotten": []}
        async for event in self.events(request, session, turn):
            if isinstance(event, DoneEvent):
                prompt = event.result.prompt_length
            elif isinstance(event, TokenEvent):
                text.push(event.text)
                tokens += 1
            elif isinstance(event, RecallEvent):
                recalls.append(_recall(event))
            elif isinstance(event, Notice):
                notices.append(event.text)
            elif isinstance(event, Remembered):
                for name, entries in _memory_changes(event).items():
                    changes[name] += entries
                notices += [event.note] if event.note else []  # ("Nothing to forget: ...": the page's status says it)
            elif isinstance(event, FinishEvent):
                reason = FINISH[event.reason]
            elif isinstance(event, Failed):
                raise APIError.of(event, body)
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_id, "recalls": recalls, "notices": notices, **changes,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text.all()},
                         "finish_reason": reason}],
            "usage": _usage(prompt, tokens)})


class StopText:
    """The answer's text without its stop sequence, as OpenAI returns it: text that might be the start
    of a stop sequence is held back until it is known not to be one."""

    def __init__(self, stop: str | list[str] | None):
        self.stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.text, self.sent, self.done = "", 0, False

    def push(self, delta: str) -> str:
        if self.done:
            return ""
        self.text += delta
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.done = self.text[:min(hits)], True
            return self._send(len(self.text))
        hold = max((len(s) - 1 for s in self.stops), default=0)
        return self._send(max(self.sent, len(self.text) - hold))

    def finish(self) -> str:
        return self._send(len(self.text))

    def all(self) -> str:
        return self.text

    def _send(self, upto: int) -> str:
        out, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return out


def _memory_changes(event: Remembered) -> dict[str, list[dict]]:
    """A turn's changes to its author's memory as the API carries them: `remembered` and `forgotten` {id, text}."""
    return {"remembered": [public(e) for e in event.written], "forgotten": [public(e) for e in event.forgotten]}


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _recall(event: RecallEvent) -> dict:
    return {"position": event.position, "slots": event.length, "score": round(event.score, 6),
            "memory_index": event.memory_index, "text": event.text, "source": event.source}


def routes(service: ChatService) -> list:
    """The /v1 routes, for the FastAPI app the server is made with (Gradio's own: one server, one port), so
    that they are in place before the port opens."""
    return list(OpenAIRoutes(service).router.routes)

"""The page's event handlers: each asks the service (`chat.api.ChatService`) and renders what comes back with
`chat.view` as Gradio component updates. Nothing here decides anything."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from collections.abc import Sequence
from pathlib import Path

import gradio as gr

from chat import operations as ops
from chat.api import ChatService, Turn
from chat.inputs import ImageRefused
from chat.session import Session
from chat.users import LOCAL, UsersError
from chat.state import MessageState, SessionState
from chat.view import (
    TurnView, about_table, answer_figure, bank_sample, bank_summary, chat_messages, found_table, inline_text, recall_table,
    status_line,
)
from chat.worker import ServiceError
from page import controls

MEMORY_COLOR = "#f59e0b"
STOP_WINDOW_S = 5.0  # an answer withdrawn this recently was stopped by the same click (its event's cancel)


def _warn(e: Exception) -> str:
    gr.Warning(str(e))
    return f"⚠ {e}"


def _highlight(segments: list) -> gr.HighlightedText:
    return gr.HighlightedText(segments, color_map={label: MEMORY_COLOR for _, label in segments if label})


def _view(state: SessionState, messages: Sequence[MessageState], live: TurnView | None, note: str) -> tuple:
    """chatbot, highlight, recall log, status: the session's messages, and the answer being written."""
    shown = chat_messages(messages)
    if live is not None and not live.done:
        shown.append({"role": "assistant", "content": inline_text(live.segments) or "…"})
    return (shown, _highlight(live.segments if live else []), recall_table(messages, live),
            status_line(state, note or (live.state if live else "")))


def owned(fn):
    """An event handler over a session (its parameter `s`) that runs only for the login that opened the session
    (`Handlers.bind`, before anything of it runs; its `request` is Gradio's). Every event with the session as an input
    has one: a crafted session hash of another login's page is refused."""
    sig = inspect.signature(fn)
    if not {"s", "request"} <= sig.parameters.keys():
        raise TypeError(f"{fn.__name__}: a handler over a session takes `s` and `request: gr.Request`")

    def check(self, args, kwargs):
        given = sig.bind_partial(self, *args, **kwargs).arguments
        self.bind(given["s"], given.get("request"))

    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def handler(self, *args, **kwargs):
            check(self, args, kwargs)
            async for update in fn(self, *args, **kwargs):
                yield update
    elif inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def handler(self, *args, **kwargs):
            check(self, args, kwargs)
            return await fn(self, *args, **kwargs)
    else:
        @functools.wraps(fn)
        def handler(self, *args, **kwargs):
            check(self, args, kwargs)
            return fn(self, *args, **kwargs)
    handler.owned = True
    return handler


class Handlers:
    """The page's event handlers, over one service."""

    def __init__(self, service: ChatService):
        self.service = service
        self.cfg = service.cfg
        self.pages: dict[str, Session] = {}  # open pages (session hash) -> their session, to free it on close

    def render(self, s: Session, note: str = "") -> tuple:
        """chatbot, highlight, recall log, status of the session as it is."""
        state = self.service.state(s)
        return _view(state, state.messages, None, note)

    async def follow(self, s: Session, turn: Turn):
        notes = recalls = 0
        async for update in self.service.follow(turn):
            view = update.view
            for note in view.notices[notes:]:
                gr.Warning(note)
            notes = len(view.notices)
            if view.done:
                state = self.service.state(s)
                chatbot, answer, log, status = _view(state, state.messages, view, "")
            else:
                chatbot, answer, log, status = _view(turn.before, turn.shown, view, "")
            fresh = len(view.recalls) != recalls or view.done or view.ahead is not None
            recalls = len(view.recalls)
            plot = gr.skip()
            if view.done:  # how the answer was decoded (layer entropy, or the mixture's α*), once it is complete
                plot = gr.Plot(answer_figure(state.plot), visible=state.plot is not None)
            yield chatbot, answer, log if fresh else gr.skip(), status, plot  # the log changes only with a recall

    def bind(self, s: Session, request: gr.Request | None) -> None:
        """With a users file, a session is the login's that opened it (`owned`): an event of another login, whose
        request names another user's session (Gradio keys its state by a session hash the client sends), is
        refused, and a user removed since their login is told to log in again (`page.logins` ends the login)."""
        users = self.service.users
        if users is None or request is None:  # (None: a call from another handler, already checked)
            return
        name = request.username
        try:
            known = users.names()
        except UsersError as e:
            raise gr.Error(str(e)) from None
        if not name or name not in known:  # (removed since the login: `recall-users`)
            raise gr.Error(f"the user {name!r} is no longer on this server: log in again")
        if s.user == LOCAL:  # (never a user's name with a users file: `chat.users.check_name`)
            s.user = name
        elif s.user != name:
            raise gr.Error(f"this page's session is another login's, not {name!r}'s: reload the page")

    @owned
    async def chat(self, message: dict | None, recall_first: bool, s: Session, request: gr.Request = None,
                   **values):
        text, shown = (message or {}).get("text", ""), values.pop("shown", None)
        if shown and s.expired is None and not self.service.state(s).messages:
            s.lost = True  # (a restart: the page shows a conversation its new session never held; said with the answer)
        try:
            settings, recall = controls.settings(self.cfg, values)
            turn = self.service.chat(s, text, (message or {}).get("files", []), settings, recall, recall_first)
        except ImageRefused as e:  # the images leave the message (else each later send is refused again); its text
            note = f"{_warn(e)} (the images were taken out of the message; its text is kept)"  # stays
            yield *self.render(s, note), gr.skip(), gr.MultimodalTextbox(value={"text": text, "files": []})
            return
        except ValueError as e:
            yield *self.render(s, _warn(e)), gr.skip(), gr.skip()
            return
        cleared = False
        async for update in self.follow(s, turn):
            yield *update, (gr.skip() if cleared else gr.MultimodalTextbox(value=None))
            cleared = True

    @owned
    async def regenerate(self, s: Session, request: gr.Request = None, **values):
        try:
            turn = self.service.regenerate(s, *controls.settings(self.cfg, values))
        except ValueError as e:
            yield *self.render(s, _warn(e)), gr.skip()
            return
        async for update in self.follow(s, turn):
            yield update

    @owned
    async def stop(self, s: Session, request: gr.Request = None) -> str:
        stopped = self.service.stop(s)
        if not stopped:  # the Stop button also cancels the answer's event, whose end withdraws it (`follow`): that
            now = time.perf_counter()  # may come first, and it is this click's stop all the same
            stopped = [r for r in s.active if r.stop_requested is not None and now - r.stop_requested < STOP_WINDOW_S]
        for req in stopped:
            with contextlib.suppress(ValueError):  # a failed request is stopped too
                await self.service.wait_for(req)  # within one decoding step
        note = f"stopped after {stopped[-1].steps} tokens" if stopped else "nothing to stop"
        return status_line(self.service.state(s), note)

    def status(self, s: Session, note: str = "") -> str:
        return status_line(self.service.state(s), note)

    @owned
    def clear(self, s: Session, request: gr.Request = None) -> tuple:
        self.service.run(ops.clear, s)
        return *self.render(s, "cleared"), None

    @owned
    def save_conversation(self, s: Session, request: gr.Request = None) -> tuple[str | None, str]:
        try:
            return str(self.service.run(ops.save_conversation, s)), self.status(s, "conversation saved")
        except ValueError as e:
            return None, self.status(s, _warn(e))

    @owned
    def load_conversation(self, path: str, s: Session, request: gr.Request = None) -> tuple:
        try:
            self.service.run(ops.load_conversation, s, path)
            return self.render(s, "conversation loaded")
        except ValueError as e:
            return self.render(s, _warn(e))
        finally:
            Path(path).unlink(missing_ok=True)  # the upload's copy in Gradio's cache: read, then gone

    # ----------------------------------------------------------------- memory banks

    def bank_view(self, s: Session, note: str = "") -> tuple:
        """bank summary, its first memories, status, which bank (none chosen while there is no bank: "shared" was
        shown chosen with no shared bank)."""
        state = self.service.state(s, details=True)
        return (bank_summary(state.bank), bank_sample(state.bank), status_line(state, note),
                state.bank.use if state.bank and state.bank.size is not None else None)

    async def _bank_job(self, s: Session, make_request, done: str) -> tuple[tuple, bool]:
        try:
            result = await self.service.wait_for(make_request())
            return self.bank_view(s, done.format(result=result)), True
        except ValueError as e:
            return self.bank_view(s, _warn(e)), False

    @owned
    async def build_example(self, s: Session, request: gr.Request = None,
                            progress=gr.Progress(track_tqdm=True)) -> tuple:
        out, _ = await self._bank_job(s, lambda: self.service.run(ops.build_example_bank, s),
                                      "example bank ready: {result} memories; ask about Port Avel")
        return out

    @owned
    async def write_memories(self, text: str, images: list[str] | None, s: Session, request: gr.Request = None,
                             progress=gr.Progress(track_tqdm=True)) -> tuple:
        out, ok = await self._bank_job(s, lambda: self.service.run(ops.write_memories, s, text, images or []),
                                       "wrote {result}")
        return (*out, "", None) if ok else (*out, gr.skip(), gr.skip())  # written: empty the inputs

    @owned
    async def delete_memories(self, ids: str, s: Session, request: gr.Request = None) -> tuple:
        out, _ = await self._bank_job(s, lambda: self.service.run(ops.delete_memories, s, ids),
                                      "deleted; {result} memories left")
        return out

    @owned
    def upload_bank(self, path: str | None, s: Session, request: gr.Request = None) -> tuple:
        """The bank's view, and the upload box emptied (a refused file stayed, as if loaded; a loaded one left a link
        to the upload's copy, deleted here: a 403)."""
        if not path:
            return *self.bank_view(s), gr.skip()
        try:
            return *self.bank_view(s, self.service.run(ops.upload_bank, s, path)), None
        except ValueError as e:
            return *self.bank_view(s, _warn(e)), None
        finally:
            Path(path).unlink(missing_ok=True)  # the upload's copy in Gradio's cache: the bank lives in memory

    @owned
    def use_bank(self, which: str, s: Session, request: gr.Request = None) -> tuple:
        try:
            self.service.run(ops.use_bank, s, which)
            return self.bank_view(s, f"using the {which} bank")
        except ValueError as e:
            return self.bank_view(s, _warn(e))

    @owned
    def find_memories(self, query: str, top_k: int, s: Session, request: gr.Request = None) -> tuple:
        try:
            return found_table(self.service.run(ops.find_memories, s, query, top_k)), self.status(s)
        except ValueError as e:
            return gr.skip(), self.status(s, _warn(e))

    @owned
    def download_bank(self, fmt: str, s: Session, request: gr.Request = None) -> tuple[str | None, str]:
        try:
            return str(self.service.run(ops.download_bank, s, fmt)), self.status(s, "bank saved: download it below")
        except ValueError as e:
            return None, self.status(s, _warn(e))

    # ----------------------------------------------------------------- about you: the user's own memory

    @owned
    def about_view(self, s: Session, query: str = "", note: str = "", request: gr.Request = None) -> tuple:
        """how many memories, the list (those containing `query`), status."""
        try:
            entries = self.service.run(ops.my_memories, s)
        except ValueError as e:
            entries, note = [], _warn(e)
        who = "" if s.user == "local" else f" ({s.user})"
        count = (f"**About you{who}**: {len(entries)} {'memory' if len(entries) == 1 else 'memories'}, written when "
                 "you say \"remember that ...\" or below.")
        return count, about_table(entries, query), self.status(s, note)

    async def _about_job(self, s: Session, query: str, make_request, done) -> tuple:
        # the list is read off the event loop: with replicas it is a call to the session's replica
        try:
            result = await self.service.wait_for(make_request())
            return await asyncio.to_thread(self.about_view, s, query, done(result))
        except ValueError as e:
            return await asyncio.to_thread(self.about_view, s, query, _warn(e))

    @owned
    def change_row(self, s: Session, request: gr.Request = None) -> tuple:
        """Under the conversation: what the last message wrote to (or forgot from) the user's memory, and Undo."""
        change = self.service.state(s).change
        return gr.Markdown(change, visible=bool(change)), gr.Button(visible=bool(change))

    @owned
    async def undo_change(self, query: str, s: Session, request: gr.Request = None) -> tuple:
        about = await self._about_job(s, query, lambda: self.service.run(ops.undo_memory_change, s),
                                      lambda r: ("Undone: " if r.removed or r.restored else "") + r.describe())
        return *about, *self.change_row(s)

    @owned
    def about_list(self, s: Session, query: str = "", request: gr.Request = None) -> tuple:
        """how many memories and the list (after a page load, or an answer that may have written one)."""
        return self.about_view(s, query, request=request)[:2]

    @owned
    async def remember(self, text: str, query: str, s: Session, request: gr.Request = None) -> tuple:
        return await self._about_job(s, query, lambda: self.service.run(ops.remember, s, text, "page"),
                                     lambda r: r.describe())

    @owned
    async def edit_memory(self, memory_id: str, text: str, query: str, s: Session, request: gr.Request = None) -> tuple:
        return await self._about_job(s, query, lambda: self.service.run(ops.edit_memory, s, memory_id.strip(), text),
                                     lambda r: r.describe())

    @owned
    def forget_memories(self, ids: str, query: str, s: Session, request: gr.Request = None) -> tuple:
        try:
            gone = self.service.run(ops.forget_memories, s, [i for i in ids.replace(",", " ").split() if i])
            return self.about_view(s, query, "Forgot: " + " · ".join(e["text"] for e in gone))
        except KeyError as e:
            return self.about_view(s, query, _warn(ServiceError(e.args[0])))
        except ValueError as e:
            return self.about_view(s, query, _warn(e))

    @owned
    def forget_everything(self, query: str, s: Session, request: gr.Request = None) -> tuple:
        try:
            return self.about_view(s, query, f"forgot all {self.service.run(ops.forget_all_memories, s)} memories")
        except ValueError as e:
            return self.about_view(s, query, _warn(e))

    @owned
    def export_memories(self, s: Session, request: gr.Request = None) -> tuple[str | None, str]:
        try:
            return str(self.service.run(ops.export_memories, s)), self.status(s, "your memories: download them below")
        except ValueError as e:
            return None, self.status(s, _warn(e))

    @owned
    async def import_memories(self, path: str | None, query: str, s: Session, request: gr.Request = None) -> tuple:
        if not path:
            return await asyncio.to_thread(self.about_view, s, query)
        return await self._about_job(s, query, lambda: self.service.run(ops.import_memories, s, path),
                                     lambda imported: imported.describe())

    def unload(self, request: gr.Request) -> None:
        """The page closed: free its session now (API clients are freed after the idle time to live). With a users
        file, only its own login's close does (Gradio's heartbeat, whose end calls this, checks no login: another
        client sending the session's hash ended it)."""
        s = self.pages.get(request.session_hash)
        if s is None or (self.service.users is not None and s.user not in (LOCAL, request.username)):
            return
        self.pages.pop(request.session_hash, None)
        self.service.end_session(s)

    @owned
    async def on_load(self, s: Session, request: gr.Request, progress=gr.Progress(track_tqdm=True)) -> tuple:
        self.pages[request.session_hash] = s
        note = ""
        try:
            if self.service.lm is None:
                await self.service.wait_for(self.service.ready())
            await asyncio.to_thread(self.service.run, ops.refresh, s)  # (with replicas: the state comes back)
        except ServiceError as e:
            note = _warn(e)
        return self.bank_view(s, note)


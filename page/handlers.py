"""The page's event handlers: each asks the service (`chat.api.ChatService`) and renders what comes back with
`chat.view` as Gradio component updates. Nothing here decides anything."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

import gradio as gr

from chat import operations as ops
from chat.api import ChatService, Turn
from chat.inputs import ImageRefused
from chat.session import Session
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
        """With a users file, the session is its login's: every event that reads or writes a memory says whose,
        so a tab's answers are never another user's whatever Gradio does with its state."""
        if self.service.users is not None and request is not None and request.username:
            if request.username not in self.service.users.names():  # (removed since the login: `recall-users`)
                raise gr.Error(f"the user {request.username!r} is no longer on this server: log in again")
            s.user = request.username

    async def chat(self, message: dict | None, recall_first: bool, s: Session, request: gr.Request = None,
                   **values):
        self.bind(s, request)
        text = (message or {}).get("text", "")
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

    async def regenerate(self, s: Session, request: gr.Request = None, **values):
        self.bind(s, request)
        try:
            turn = self.service.regenerate(s, *controls.settings(self.cfg, values))
        except ValueError as e:
            yield *self.render(s, _warn(e)), gr.skip()
            return
        async for update in self.follow(s, turn):
            yield update

    async def stop(self, s: Session) -> str:
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

    def clear(self, s: Session) -> tuple:
        self.service.run(ops.clear, s)
        return *self.render(s, "cleared"), None

    def save_conversation(self, s: Session) -> tuple[str | None, str]:
        try:
            return str(self.service.run(ops.save_conversation, s)), self.status(s, "conversation saved")
        except ValueError as e:
            return None, self.status(s, _warn(e))

    def load_conversation(self, path: str, s: Session) -> tuple:
        try:
            self.service.run(ops.load_conversation, s, path)
            return self.render(s, "conversation loaded")
        except ValueError as e:
            return self.render(s, _warn(e))
        finally:
            Path(path).unlink(missing_ok=True)  # the upload's copy in Gradio's cache: read, then gone

    # ----------------------------------------------------------------- memory banks

    def bank_view(self, s: Session, note: str = "") -> tuple:
        """bank summary, its first memories, status, which bank."""
        state = self.service.state(s, details=True)
        return (bank_summary(state.bank), bank_sample(state.bank), status_line(state, note),
                state.bank.use if state.bank else None)

    async def _bank_job(self, s: Session, make_request, done: str) -> tuple[tuple, bool]:
        try:
            result = await self.service.wait_for(make_request())
            return self.bank_view(s, done.format(result=result)), True
        except ValueError as e:
            return self.bank_view(s, _warn(e)), False

    async def build_example(self, s: Session, progress=gr.Progress(track_tqdm=True)) -> tuple:
        out, _ = await self._bank_job(s, lambda: self.service.run(ops.build_example_bank, s),
                                      "example bank ready: {result} memories; ask about Port Avel")
        return out

    async def write_memories(self, text: str, images: list[str] | None, s: Session,
                             progress=gr.Progress(track_tqdm=True)) -> tuple:
        out, ok = await self._bank_job(s, lambda: self.service.run(ops.write_memories, s, text, images or []),
                                       "wrote {result}")
        return (*out, "", None) if ok else (*out, gr.skip(), gr.skip())  # written: empty the inputs

    async def delete_memories(self, ids: str, s: Session) -> tuple:
        out, _ = await self._bank_job(s, lambda: self.service.run(ops.delete_memories, s, ids),
                                      "deleted; {result} memories left")
        return out

    def upload_bank(self, path: str | None, s: Session) -> tuple:
        """The bank's view, and the upload box emptied when the file was refused (it stayed, as if loaded)."""
        if not path:
            return *self.bank_view(s), gr.skip()
        try:
            return *self.bank_view(s, self.service.run(ops.upload_bank, s, path)), gr.skip()
        except ValueError as e:
            return *self.bank_view(s, _warn(e)), None
        finally:
            Path(path).unlink(missing_ok=True)  # the upload's copy in Gradio's cache: the bank lives in memory

    def use_bank(self, which: str, s: Session) -> tuple:
        try:
            self.service.run(ops.use_bank, s, which)
            return self.bank_view(s, f"using the {which} bank")
        except ValueError as e:
            return self.bank_view(s, _warn(e))

    def find_memories(self, query: str, top_k: int, s: Session) -> tuple:
        try:
            return found_table(self.service.run(ops.find_memories, s, query, top_k)), self.status(s)
        except ValueError as e:
            return gr.skip(), self.status(s, _warn(e))

    def download_bank(self, fmt: str, s: Session) -> tuple[str | None, str]:
        try:
            return str(self.service.run(ops.download_bank, s, fmt)), self.status(s, "bank saved: download it below")
        except ValueError as e:
            return None, self.status(s, _warn(e))

    # ----------------------------------------------------------------- about you: the user's own memory

    def about_view(self, s: Session, query: str = "", note: str = "", request: gr.Request = None) -> tuple:
        """how many memories, the list (those containing `query`), status."""
        self.bind(s, request)
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

    def change_row(self, s: Session) -> tuple:
        """Under the conversation: what the last message wrote to (or forgot from) the user's memory, and Undo."""
        change = self.service.state(s).change
        return gr.Markdown(change, visible=bool(change)), gr.Button(visible=bool(change))

    async def undo_change(self, query: str, s: Session, request: gr.Request = None) -> tuple:
        self.bind(s, request)
        about = await self._about_job(s, query, lambda: self.service.run(ops.undo_memory_change, s),
                                      lambda r: "Undone: " + r.describe())
        return *about, *self.change_row(s)

    def about_list(self, s: Session, query: str = "", request: gr.Request = None) -> tuple:
        """how many memories and the list (after a page load, or an answer that may have written one)."""
        return self.about_view(s, query, request=request)[:2]

    async def remember(self, text: str, query: str, s: Session, request: gr.Request = None) -> tuple:
        self.bind(s, request)
        return await self._about_job(s, query, lambda: self.service.run(ops.remember, s, text, "page"),
                                     lambda r: r.describe())

    async def edit_memory(self, memory_id: str, text: str, query: str, s: Session, request: gr.Request = None) -> tuple:
        self.bind(s, request)
        return await self._about_job(s, query, lambda: self.service.run(ops.edit_memory, s, memory_id.strip(), text),
                                     lambda r: r.describe())

    def forget_memories(self, ids: str, query: str, s: Session, request: gr.Request = None) -> tuple:
        self.bind(s, request)
        try:
            gone = self.service.run(ops.forget_memories, s, [i for i in ids.replace(",", " ").split() if i])
            return self.about_view(s, query, "Forgot: " + " · ".join(e["text"] for e in gone))
        except KeyError as e:
            return self.about_view(s, query, _warn(ServiceError(e.args[0])))
        except ValueError as e:
            return self.about_view(s, query, _warn(e))

    def forget_everything(self, query: str, s: Session, request: gr.Request = None) -> tuple:
        self.bind(s, request)
        try:
            return self.about_view(s, query, f"forgot all {self.service.run(ops.forget_all_memories, s)} memories")
        except ValueError as e:
            return self.about_view(s, query, _warn(e))

    def export_memories(self, s: Session, request: gr.Request = None) -> tuple[str | None, str]:
        self.bind(s, request)
        try:
            return str(self.service.run(ops.export_memories, s)), self.status(s, "your memories: download them below")
        except ValueError as e:
            return None, self.status(s, _warn(e))

    async def import_memories(self, path: str | None, query: str, s: Session, request: gr.Request = None) -> tuple:
        self.bind(s, request)
        if not path:
            return await asyncio.to_thread(self.about_view, s, query)
        return await self._about_job(s, query, lambda: self.service.run(ops.import_memories, s, path),
                                     lambda imported: imported.describe())

    def unload(self, request: gr.Request) -> None:
        """The page closed: free its session now (API clients are freed after the idle time to live)."""
        s = self.pages.pop(request.session_hash, None)
        if s is not None:
            self.service.end_session(s)

    async def on_load(self, s: Session, request: gr.Request, progress=gr.Progress(track_tqdm=True)) -> tuple:
        self.pages[request.session_hash] = s
        self.bind(s, request)
        note = ""
        try:
            if self.service.lm is None:
                await self.service.wait_for(self.service.ready())
            await asyncio.to_thread(self.service.run, ops.refresh, s)  # (with replicas: the state comes back)
        except ServiceError as e:
            note = _warn(e)
        return self.bank_view(s, note)


"""Gradio's logins held to the users file: a name removed and added again (another password, perhaps another
person) does not inherit the logins made before. (A removed user's login still names them: every event over their
session then says they are no longer on the server, `page.handlers.Handlers.bind`.)"""

from __future__ import annotations

import logging
import time

import gradio as gr

from chat.users import Users, UsersError

log = logging.getLogger("page.logins")


class Logins(dict):
    """Gradio's login tokens (`App.tokens`: token -> user name, the one place Gradio resolves a request's user),
    each with the time it was made: a token older than its user (added again since) or than their password is no
    login (dropped)."""

    def __init__(self, users: Users):
        super().__init__()
        self.users = users
        self.made: dict[str, float] = {}

    def __setitem__(self, token: str, name: str) -> None:
        self.made[token] = time.time()
        super().__setitem__(token, name)

    def get(self, token, default=None):
        name = super().get(token)
        try:
            stale = name is not None and self.users.stale_login(name, self.made.get(token, 0.0))
        except UsersError as e:  # (a users file broken while the server runs: no one is logged in, not a bare 500)
            log.error("logins refused: %s", e)
            return default
        if stale:
            del self[token]
            name = None
        return default if name is None else name

    def __delitem__(self, token: str) -> None:  # (Gradio's logout too)
        super().__delitem__(token)
        self.made.pop(token, None)


def hold(demo: gr.Blocks, users: Users | None) -> None:
    """Once `demo` is launched: its logins checked against `users` at every request."""
    if users is not None:
        demo.server_app.tokens = Logins(users)

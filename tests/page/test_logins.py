"""With a users file, a page's session is the login's that opened it, through the user's own path (a Gradio client
that logs in, on a real server): another login that sends its session hash is refused by every event, and a name
removed and added again (another password) does not inherit the logins made before."""

from __future__ import annotations

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from chat import users
from page.layout import build_demo
from test_app import serve

PASSWORDS = {"ada": "ada-password", "bob": "bob-password", "carol": "carol-password"}


@pytest.fixture
def users_file(tmp_path):
    path = tmp_path / "users.json"
    for name, password in PASSWORDS.items():
        users.add(path, name, password)
    return path


def login(url: str, name: str, password: str | None = None) -> Client:
    return Client(url, auth=(name, password or PASSWORDS[name]), verbose=False)


def say(client: Client, text: str):
    return client.predict({"text": text, "files": []}, False, api_name="/chat")


def test_every_event_over_a_session_checks_its_login(tiny_llama, users_file):
    """(Before, only the memory events did, and they took the session over: `s.user` became the caller.)"""
    with serve(tiny_llama, f"app.users_file={users_file}") as server:
        demo = build_demo(server.service)
        session = next(b for b in demo.blocks.values() if type(b).__name__ == "State")
        over_session = [f for f in demo.fns.values() if session in f.inputs]
        assert len(over_session) > 20
        assert [f.name for f in over_session if not getattr(f.fn, "owned", False)] == []


def test_another_login_with_a_users_session_hash_is_refused(tiny_llama, users_file, tmp_path):
    """(bob, sending ada's session hash, saved her conversation with her recalled memories, and his Undo put back
    the memory she had just forgotten into his own memory.)"""
    with serve(tiny_llama, f"app.users_file={users_file}", f"memory.user_dir={tmp_path / 'mem'}") as server:
        svc = server.service
        ada = login(server.url, "ada")
        say(ada, "Remember that my sister is called Lena.")
        say(ada, "Forget about my sister.")
        (session,) = [s for s in svc.sessions.values() if s.user == "ada"]
        before = (list(session.conv.ids), session.last_change)
        assert before[1] is not None and before[1].forgotten

        bob = login(server.url, "bob")
        bob.session_hash = ada.session_hash
        for api_name, args in [("/save_conversation", ()), ("/undo_memory_change", ("",)), ("/clear", ()),
                               ("/export_memories", ()), ("/stop", ()), ("/regenerate", ()),
                               ("/chat", ({"text": "What is my sister's name?", "files": []}, False)),
                               ("/use_bank", ("shared",)), ("/find_memories", ("sister", 3))]:
            with pytest.raises(AppError, match="this page's session is another login's, not 'bob''s"):
                bob.predict(*args, api_name=api_name)
        assert (list(session.conv.ids), session.last_change) == before and session.user == "ada"
        assert svc.people.of(tiny_llama, "bob").entries() == []  # nothing of ada's came to bob
        say(ada, "Hello again.")  # ada's page goes on
        assert session.conv.messages[-2].text == "Hello again."


def test_a_name_removed_and_added_again_does_not_inherit_the_logins_before(tiny_llama, users_file, tmp_path):
    """(carol's page, logged in before `recall-users remove carol` and `add carol` with a new password, went on as
    the new carol and read what she told the server.)"""
    with serve(tiny_llama, f"app.users_file={users_file}", f"memory.user_dir={tmp_path / 'mem'}") as server:
        old = login(server.url, "carol")
        say(old, "Hello.")
        users.remove(users_file, "carol")
        with pytest.raises(AppError, match="the user 'carol' is no longer on this server: log in again"):
            say(old, "Hello?")
        users.add(users_file, "carol", "a-new-password")
        new = login(server.url, "carol", "a-new-password")
        say(new, "Remember that my bank PIN is 4711.")
        with pytest.raises(Exception, match="401|Unauthorized|Not authenticated"):  # (the login is gone)
            say(old, "What is my bank PIN?")
        with pytest.raises(Exception):  # the old password is no login either
            login(server.url, "carol")
        say(new, "Hello again.")  # the new login goes on


def test_a_users_file_broken_while_the_server_runs_is_said_not_a_bare_500(tiny_llama, users_file):
    """(A users file edited into one that cannot be read answered every key and login with "Internal Server Error".)"""
    import httpx

    key = users.rotate_key(users_file, "ada")
    with serve(tiny_llama, f"app.users_file={users_file}") as server:
        assert httpx.get(server.url + "v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        users_file.write_text('{"users": {"ada": "x"}}')
        answer = httpx.get(server.url + "v1/models", headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 500 and "the server's users file cannot be read (its log says why)" in answer.text
        with pytest.raises(Exception):  # no one logs in (logged: the file cannot be read)
            login(server.url, "bob")


def test_a_broken_users_file_logs_everyone_out_and_another_logins_page_close_ends_nothing(tiny_llama, users_file):
    """(A review found: with the users file broken, Gradio's own routes answered a logged-in browser with bare 500s,
    `Logins.get` raising; and Gradio's heartbeat, which checks no login, let another client end a user's session
    by closing a heartbeat with its hash.)"""
    from types import SimpleNamespace

    from page.handlers import Handlers
    from page.logins import Logins

    logins = Logins(users.Users(users_file))
    logins["t"] = "ada"
    assert logins.get("t") == "ada"
    text = users_file.read_text()
    users_file.write_text('{"users": {"ada": "x"}}')
    assert logins.get("t") is None  # (logged, not raised)
    users_file.write_text(text)
    del logins["t"]
    assert logins.made == {}  # (a logout forgets the token's time)

    with serve(tiny_llama, f"app.users_file={users_file}") as server:
        h = Handlers(server.service)
        s = server.service.new_session()
        s.user = "ada"
        h.pages["hash-of-ada"] = s
        h.unload(SimpleNamespace(session_hash="hash-of-ada", username="bob"))
        assert s.id in server.service.sessions and h.pages["hash-of-ada"] is s
        h.unload(SimpleNamespace(session_hash="hash-of-ada", username="ada"))
        assert s.id not in server.service.sessions and "hash-of-ada" not in h.pages

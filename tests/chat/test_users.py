"""The users file and `recall-users`: hashes only, keys that find their user, the command's own output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chat import users
from chat.users import Users, UsersError

ROOT = Path(__file__).resolve().parents[2]


def cli(path: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chat.users", "--file", str(path), *args], input=stdin,
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_the_command_adds_a_user_whose_key_is_the_last_word_and_stores_only_hashes(tmp_path):
    path = tmp_path / "users.json"
    done = cli(path, "add", "ada", "--password-stdin", stdin="correct horse\n")
    assert done.returncode == 0, done.stderr
    key = done.stdout.strip().splitlines()[-1].split()[-1]
    assert key.startswith("rc-")
    text = path.read_text()
    assert key not in text and "correct horse" not in text  # neither is stored, only their hashes
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    store = Users(path)
    assert store.user_of_key(key) == "ada"
    assert store.check_password("ada", "correct horse")
    assert not store.check_password("ada", "correct horsf")
    assert not store.check_password("bob", "correct horse")
    assert store.user_of_key(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
    assert store.user_of_key("rc-000000000000-" + "x" * 43) is None
    assert store.user_of_key("") is None

    listed = cli(path, "list")
    assert listed.returncode == 0 and listed.stdout.split()[0] == "ada"
    again = cli(path, "add", "ada", "--password-stdin", stdin="another one\n")
    assert again.returncode == 1 and "already exists" in again.stderr


def test_a_rotated_key_replaces_the_old_one_in_a_running_server(tmp_path):
    path = tmp_path / "users.json"
    old = users.add(path, "ada", "password1")
    store = Users(path)  # the server's view, opened before the rotation
    assert store.user_of_key(old) == "ada"
    rotated = cli(path, "rotate-key", "ada")
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.split()[-1]
    assert store.user_of_key(old) is None  # the file changed: the remembered check is dropped
    assert store.user_of_key(new) == "ada"
    assert cli(path, "remove", "ada").returncode == 0
    assert store.user_of_key(new) is None and store.names() == []


def test_two_users_have_their_own_keys(tmp_path):
    path = tmp_path / "users.json"
    a, b = users.add(path, "ada", "password1"), users.add(path, "bob", "password2")
    store = Users(path)
    assert (store.user_of_key(a), store.user_of_key(b)) == ("ada", "bob")
    assert store.names() == ["ada", "bob"]


@pytest.mark.parametrize("name,password,expected", [
    ("", "password1", "user name"), ("../etc", "password1", "user name"), ("ada", "short", "at least 8"),
    ("local", "password1", "the one user of a server without a users file"),  # (it read what was written then)
])
def test_bad_names_and_passwords_are_refused_by_name(tmp_path, name, password, expected):
    with pytest.raises(UsersError, match=expected):
        users.add(tmp_path / "users.json", name, password)
    assert not (tmp_path / "users.json").exists()  # nothing half-made


def test_a_file_that_is_not_a_users_file_is_named(tmp_path):
    path = tmp_path / "users.json"
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(UsersError, match="expected a users file written by recall-users"):
        Users(path)
    with pytest.raises(UsersError, match="found none"):
        Users(tmp_path / "missing.json")


def test_a_password_piped_without_password_stdin_is_refused_by_name(tmp_path):
    """`echo pw | recall-users add NAME` (no --password-stdin) ended in getpass's termios error traceback."""
    done = cli(tmp_path / "users.json", "add", "ada", stdin="secret-password\n")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "stdin is not one: pass --password-stdin" in done.stderr and not (tmp_path / "users.json").exists()


@pytest.mark.parametrize("entry,time", [("x", None), ({"password": "x"}, None), (None, "yesterday")])
def test_a_file_with_an_entry_recall_users_did_not_write_is_refused_naming_the_user(tmp_path, entry, time):
    """(`{"users": {"ada": "x"}}` was taken: `add` wrote beside it, the server started, and every API key, the
    valid ones too, was a 500; `list` was a traceback.)"""
    path = tmp_path / "users.json"
    users.add(path, "bob", "password1")
    data = json.loads(path.read_text())
    data["users"]["ada"] = entry if entry is not None else dict(data["users"]["bob"], created=time)
    path.write_text(json.dumps(data))
    with pytest.raises(UsersError, match="the entry of user 'ada' is not one recall-users writes"):
        Users(path)
    with pytest.raises(UsersError, match="the entry of user 'ada'"):
        users.add(path, "zed", "password2")
    done = cli(path, "list")
    assert done.returncode == 1 and "Traceback" not in done.stderr and "the entry of user 'ada'" in done.stderr


def test_a_users_file_that_is_a_folder_is_named_and_the_file_is_never_readable_by_others(tmp_path, monkeypatch):
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(UsersError, match="expected a users file, got a folder"):
        Users(tmp_path / "dir.json")
    done = cli(tmp_path / "dir.json", "list")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    path = tmp_path / "users.json"
    users.add(path, "ada", "password1")
    modes = set()
    real = os.replace

    def replace(src, dst):  # (the temporary was 0644 until after the rename)
        modes.add(os.stat(src).st_mode & 0o777)
        real(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    users.rotate_key(path, "ada")
    assert modes == {0o600} and os.stat(path).st_mode & 0o777 == 0o600


def test_a_password_that_is_not_utf8_and_a_missing_file_are_refused_without_a_trace(tmp_path):
    """(Bytes that are not UTF-8 on stdin ended in a UnicodeEncodeError traceback; `remove` and `rotate-key` on no
    file made its folder and lock file, then said "no user".)"""
    path = tmp_path / "people" / "users.json"
    done = subprocess.run([sys.executable, "-m", "chat.users", "--file", str(path), "add", "bob", "--password-stdin"],
                          input=b"pass\xffword1\n", capture_output=True, cwd=ROOT, timeout=120)
    assert done.returncode == 1 and b"Traceback" not in done.stderr and b"expected UTF-8" in done.stderr
    for command in (["remove", "x"], ["rotate-key", "x"]):
        done = cli(path, *command)
        assert done.returncode == 1 and "no users file at" in done.stderr
    assert not (tmp_path / "people").exists()


def test_a_new_password_keeps_the_user_and_ends_the_logins_before_it(tmp_path):
    """(A review found the only way to change a password, remove then add, made another user: the server moved their
    memories aside.)"""
    path = tmp_path / "users.json"
    key = users.add(path, "ada", "password1")
    store = Users(path)
    created = store.created("ada")
    before = time.time()
    time.sleep(0.01)
    done = cli(path, "passwd", "ada", "--password-stdin", stdin="password2\n")
    assert done.returncode == 0 and "new password for ada" in done.stdout
    assert store.created("ada") == created and store.user_of_key(key) == "ada"  # (the same user, the same key)
    assert store.check_password("ada", "password2") and not store.check_password("ada", "password1")
    assert store.stale_login("ada", before) and not store.stale_login("ada", time.time())
    assert cli(path, "passwd", "zed", "--password-stdin", stdin="password3\n").returncode == 1


@pytest.mark.parametrize("name", ["../escape", "x/../bob", "bob/", "", "local"])
def test_a_file_with_a_name_recall_users_would_not_take_is_refused_naming_it(tmp_path, name):
    """(A hostile probe edited "../probeA_escape" into a users file by hand: its key made a memory folder outside
    memory.user_dir.) A name is read as `add` takes one."""
    path = tmp_path / "users.json"
    users.add(path, "bob", "password1")
    data = json.loads(path.read_text())
    data["users"][name] = data["users"]["bob"]
    path.write_text(json.dumps(data))
    with pytest.raises(UsersError, match=r"expected a users file written by recall-users, got something else \((a user "
                                         r"name is 1-64 letters|'local' is the one user)"):
        Users(path)

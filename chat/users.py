"""People: the users file (`app.users_file`) and the `recall-users` command that keeps it.

The file is JSON: for each user a scrypt hash of the password and of the API key, never either itself.
Hashing is OpenSSL's scrypt (`hashlib.scrypt`, n=2**14, r=8, p=1: RFC 7914's interactive setting, ~16 MB and
~40 ms a check). An API key is `rc-<key id>-<secret>`: the id finds its user, the secret is checked against the
hash in constant time; a key checked once is remembered (its SHA-256) for the life of the process, so `/v1`
pays scrypt once a key, not once a request. Writes are atomic and take a lock: two `recall-users` at once
cannot lose a user.

    recall-users --file users.json add NAME [--password-stdin]   # the API key is the last word printed
    recall-users --file users.json passwd NAME [--password-stdin]   # a new password, the same user
    recall-users --file users.json rotate-key NAME | remove NAME | list
"""

from __future__ import annotations

import argparse
import fcntl
import getpass
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from memory.files import atomic_write

log = logging.getLogger("chat.users")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
LOCAL = "local"  # the one user of a server without a users file
SCRYPT = {"n": 2 ** 14, "r": 8, "p": 1}
MIN_PASSWORD = 8


class UsersError(ValueError):
    """A users file that cannot be read, or a request it cannot serve (the message says which)."""


def _hash(secret: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(secret.encode(), salt=salt, n=n, r=r, p=p, maxmem=64 * 2 ** 20, dklen=32)


def _stored(secret: str) -> dict:
    salt = secrets.token_bytes(16)
    return {"scrypt": SCRYPT, "salt": salt.hex(), "hash": _hash(secret, salt, **SCRYPT).hex()}


def _matches(secret: str, stored: dict) -> bool:
    digest = _hash(secret, bytes.fromhex(stored["salt"]), **stored["scrypt"])
    return hmac.compare_digest(digest, bytes.fromhex(stored["hash"]))


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise UsersError(f"a user name is 1-64 letters, digits, '_', '.', '@' or '-' (starting with a letter or "
                         f"digit), got {name!r}")
    if name == LOCAL:  # (the memories written while the server ran without logins are LOCAL's)
        raise UsersError(f"{LOCAL!r} is the one user of a server without a users file: choose another name")
    return name


def _check_entry(name: str, entry) -> None:
    """`ValueError` naming the user whose entry recall-users did not write (one such entry made every key a 500)."""
    def hashed(part) -> bool:
        return isinstance(part, dict) and isinstance(part.get("scrypt"), dict) and all(
            isinstance(part.get(k), str) and re.fullmatch(r"[0-9a-f]+", part[k]) for k in ("salt", "hash"))

    ok = (isinstance(entry, dict) and hashed(entry.get("password")) and hashed(entry.get("key"))
          and isinstance(entry["key"].get("id"), str)
          and isinstance(entry.get("created", 0.0), (int, float)) and not isinstance(entry.get("created"), bool))
    if not ok:
        raise ValueError(f"the entry of user {name!r} is not one recall-users writes (a password and a key hash, "
                         "a time)")


@dataclass(frozen=True)
class User:
    name: str
    created: float


class Users:
    """The users of a server, read from its users file (re-read when the file changes: `recall-users` run while
    the server runs takes effect at once). Thread-safe."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._known: dict[str, str] = {}  # SHA-256 of a key checked once -> its user (cleared on any change)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._data: dict = {}
        self._read()

    # ------------------------------------------------------------------ reading

    def _read(self) -> dict:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            raise UsersError(f"app.users_file: expected a users file at {str(self.path)!r} (create it with "
                             f"recall-users --file {self.path} add NAME), found none") from None
        except OSError as e:
            raise UsersError(f"app.users_file {str(self.path)!r} cannot be read: {e.strerror or e}") from None
        stamp = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            if stamp != self._stamp:
                try:
                    data = json.loads(self.path.read_text())
                    if not isinstance(data, dict) or not isinstance(data.get("users"), dict):
                        raise ValueError("no 'users' object")
                    for name, entry in data["users"].items():
                        check_name(name)  # (a name edited in by hand, "../x", was a folder outside memory.user_dir)
                        _check_entry(name, entry)
                except IsADirectoryError:
                    raise UsersError(f"app.users_file {str(self.path)!r}: expected a users file, got a folder") \
                        from None
                except OSError as e:
                    raise UsersError(f"app.users_file {str(self.path)!r} cannot be read: {e.strerror or e}") \
                        from None
                except (ValueError, AttributeError) as e:
                    raise UsersError(f"{self.path}: expected a users file written by recall-users, got "
                                     f"something else ({e})") from None
                self._data, self._stamp, self._known = data, stamp, {}
            return self._data

    def names(self) -> list[str]:
        return sorted(self._read()["users"])

    def list(self) -> list[User]:
        users = self._read()["users"]
        return [User(name, users[name].get("created", 0.0)) for name in sorted(users)]

    def created(self, name: str) -> float | None:
        """When the user `name` now was added (a name removed and added again is another user), or None."""
        entry = self._read()["users"].get(name)
        return None if entry is None else float(entry.get("created", 0.0))

    def stale_login(self, name: str, made: float) -> bool:
        """Whether a login of `name` made at `made` no longer holds: the user now was added after it (removed and
        added again: another user, perhaps another person), or their password changed since (`passwd`)."""
        entry = self._read()["users"].get(name)
        return entry is not None and max(entry.get("created", 0.0), entry.get("password_set", 0.0)) > made

    def check_password(self, name: str, password: str) -> bool:
        """Whether `password` is `name`'s (Gradio's `auth` callback: a users file that cannot be read now lets no one
        in, and is logged; it was a bare 500)."""
        try:
            entry = self._read()["users"].get(name)
        except UsersError as e:
            log.error("login of %r refused: %s", name, e)
            return False
        return entry is not None and isinstance(password, str) and _matches(password, entry["password"])

    def user_of_key(self, key: str) -> str | None:
        """The user whose API key `key` is, or None."""
        users = self._read()["users"]
        fingerprint = hashlib.sha256(key.encode()).hexdigest()
        with self._lock:
            known = self._known.get(fingerprint)
        if known is not None:
            return known if known in users else None
        m = re.fullmatch(r"rc-([0-9a-f]{12})-([A-Za-z0-9_-]{20,})", key or "")
        if m is None:
            return None
        for name, entry in users.items():
            if hmac.compare_digest(entry["key"]["id"], m[1]) and _matches(key, entry["key"]):
                with self._lock:
                    self._known[fingerprint] = name
                return name
        return None

    # ------------------------------------------------------------------ writing (the CLI)

    @classmethod
    @contextmanager
    def editing(cls, path: str | os.PathLike) -> Iterator[dict]:
        """The file's data to change in place, under an exclusive lock, written back atomically (mode 0600)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f".{path.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = cls(path)._read() if path.exists() else {"version": 1, "users": {}}
            yield data
            atomic_write(path, lambda fh: fh.write(json.dumps(data, indent=1).encode()), mode=0o600)  # (never 0644)


def _check_password(password: str) -> None:
    if not isinstance(password, str) or len(password) < MIN_PASSWORD:
        raise UsersError(f"a password has at least {MIN_PASSWORD} characters, got {len(password or '')}")
    try:
        password.encode()
    except UnicodeEncodeError:  # (bytes piped in that are not UTF-8: a traceback before)
        raise UsersError("a password is text: expected UTF-8, got bytes that are not") from None


def new_key() -> tuple[str, dict]:
    """A new API key and what is stored of it."""
    key_id = secrets.token_hex(6)
    key = f"rc-{key_id}-{secrets.token_urlsafe(32)}"
    return key, dict(_stored(key), id=key_id)


def add(path: str | os.PathLike, name: str, password: str) -> str:
    """Add a user; their new API key."""
    check_name(name)
    _check_password(password)
    key, stored_key = new_key()
    with Users.editing(path) as data:
        if name in data["users"]:
            raise UsersError(f"user {name!r} already exists (rotate-key gives a new key, passwd a new password)")
        data["users"][name] = {"password": _stored(password), "key": stored_key, "created": time.time()}
    return key


def set_password(path: str | os.PathLike, name: str, password: str) -> None:
    """A new password for `name`, the same user (their memories stay theirs; the logins made before end)."""
    _existing(path)
    _check_password(password)
    with Users.editing(path) as data:
        if name not in data["users"]:
            raise UsersError(f"no user {name!r} in {path}")
        data["users"][name].update(password=_stored(password), password_set=time.time())


def rotate_key(path: str | os.PathLike, name: str) -> str:
    """A new API key for `name` (the old one stops working)."""
    _existing(path)
    key, stored_key = new_key()
    with Users.editing(path) as data:
        if name not in data["users"]:
            raise UsersError(f"no user {name!r} in {path}")
        data["users"][name]["key"] = stored_key
    return key


def _existing(path: str | os.PathLike) -> None:
    if not Path(path).is_file():  # (editing would make its folder and lock first)
        raise UsersError(f"no users file at {str(path)!r} (recall-users --file {path} add NAME makes it)")


def remove(path: str | os.PathLike, name: str) -> None:
    _existing(path)
    with Users.editing(path) as data:
        if data["users"].pop(name, None) is None:
            raise UsersError(f"no user {name!r} in {path}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recall-users", description="Keep the users file of a recall chat server "
                                     "(app.users_file): names, password and API key hashes.")
    parser.add_argument("--file", required=True, help="the users file (created by the first add)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command, what in (("add", "add a user; prints their API key last"),
                          ("passwd", "a user's new password (their memories stay theirs; logins made before end)")):
        p = sub.add_parser(command, help=what)
        p.add_argument("name")
        p.add_argument("--password-stdin", action="store_true", help="read the password from the first line of "
                       "stdin (otherwise it is asked for)")
    sub.add_parser("remove", help="remove a user").add_argument("name")
    sub.add_parser("rotate-key", help="give a user a new API key; prints it last").add_argument("name")
    sub.add_parser("list", help="the users, one a line")
    args = parser.parse_args(argv)
    try:
        if args.command in ("add", "passwd"):
            if args.password_stdin:
                password = sys.stdin.readline().rstrip("\r\n")
            elif not sys.stdin.isatty():  # (getpass would end in a termios error or EOFError)
                raise UsersError("the password is asked on a terminal, and stdin is not one: pass --password-stdin "
                                 "to read it from the first line of stdin")
            else:
                password = getpass.getpass(f"password for {args.name}: ")
                if getpass.getpass("again: ") != password:
                    raise UsersError("the two passwords differ")
            if args.command == "passwd":
                set_password(args.file, args.name, password)
                print(f"new password for {args.name}; the logins made before it end at their next action")
            else:
                print(f"added {args.name}; API key (shown once): {add(args.file, args.name, password)}")
        elif args.command == "rotate-key":
            print(f"new API key for {args.name} (shown once): {rotate_key(args.file, args.name)}")
        elif args.command == "remove":
            remove(args.file, args.name)
            print(f"removed {args.name}: their open pages are logged out at their next action; their memories stay "
                  f"in memory.user_dir/{args.name} until you delete that folder (a user added later with this name "
                  f"starts with none: the server moves it aside to {args.name}+removed-<time>, unless it was written "
                  "before this server kept owners; with memory.store: milvus they stay in the collection, and such a "
                  "user would read them)")
        else:
            for user in Users(args.file).list():
                print(f"{user.name}\t{time.strftime('%Y-%m-%d %H:%M', time.localtime(user.created))}")
    except UsersError as e:
        print(f"recall-users: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

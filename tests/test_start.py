"""The app as an operator starts it: a bank built with the CLI and loaded by `app.py --bank` (larger than the
upload limit, which is for files strangers send), asked through the `openai` client on the default backend;
a start-up bank that cannot be loaded stops the start with its reason."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from training.facts import make_facts

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "assets" / "example_memories.txt"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def app(*args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, port


def serving(proc: subprocess.Popen, port: int, timeout: float = 600) -> bool:
    """Wait until the server answers /health (True) or the process ends (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the app neither started nor stopped")


def test_a_cli_built_bank_over_the_upload_limit_loads_at_start_and_answers(tmp_path):
    texts = EXAMPLE.read_text().splitlines() + [f.text for f in make_facts(800, "eval", seed=29)]
    (tmp_path / "facts.txt").write_text("\n".join(texts) + "\n")
    bank = tmp_path / "bank.safetensors"
    built = subprocess.run([sys.executable, "-m", "chat.bankcli", "build", str(tmp_path / "facts.txt"), str(bank)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    assert bank.stat().st_size > 2 ** 20  # over the 1 MB upload limit set below
    proc, port = app("--bank", str(bank), "--set", "memory.max_upload_mb=1", "--set", "generation.max_new_tokens=32")
    try:
        assert serving(proc, port), proc.stdout.read()
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        out = api.chat.completions.create(model="recall-chat", temperature=0, messages=[
            {"role": "user", "content": "Who keeps the lighthouse of Port Avel?"}])
        recall = out.model_extra["recalls"][0]
        assert recall["text"] == "Mira Castellan is the lighthouse keeper of Port Avel."
        assert "Mira Castellan" in out.choices[0].message.content
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.parametrize("what, says", [
    ("bytes", "broken.safetensors: expected a safetensors file, got other bytes (starting b'\\x00"),
    ("folder", "broken.safetensors: expected a safetensors memory bank file, got a folder")])  # (a traceback before)
def test_a_start_up_bank_that_cannot_be_loaded_stops_the_start(tmp_path, what, says):
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x00" * 64) if what == "bytes" else broken.mkdir()
    proc, port = app("--bank", str(broken))
    try:
        assert not serving(proc, port)  # it never opened its port
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert f"recall-chat: memory.bank '{broken}' cannot be loaded: {says}" in out and "Traceback" not in out, out


def test_a_port_in_use_or_a_host_that_does_not_resolve_stops_the_start_in_one_line():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, "app.py", "--port", str(port)], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"recall-chat: cannot listen on 127.0.0.1:{port} (Address already in use): another program holds the " \
           "port" in done.stderr and "choose another --port (app.port)" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "app.py", "--host", "999.1.1.1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1 and "recall-chat: --host '999.1.1.1' (app.host): expected an address of this " \
           "machine, got a name that does not resolve" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "app.py", "--port", "0"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "port is 0; allowed: 1..65535" in done.stderr, done.stderr


def test_every_command_the_readme_names_is_installed_and_runs():
    """`.venv/bin/NAME` in the README is a command the setup installs (`recall-users` was named and missing)."""
    import re

    named = set(re.findall(r"\.venv/bin/([a-z][a-z-]*)", (ROOT / "README.md").read_text()))
    assert {"python", "recall-memory", "recall-users"} <= named
    bin_dir = Path(sys.executable).parent
    for name in sorted(named - {"python", "pip"}):
        done = subprocess.run([str(bin_dir / name), "--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "usage" in done.stdout.lower(), (name, done.stdout, done.stderr)

"""The page in a real browser: Debian's headless Chromium driven by Playwright.

A tiny random Qwen3-VL (slowed to ~40 tokens/s so a person could press stop) serves a page; the
test uploads a bank, attaches an image, watches the answer stream, stops it, sees the memory
marker, and saves a screenshot to `artifacts/browser.png`. Every request the page makes must go
to the local server.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch

from chat.service import EXAMPLE_IMAGES
from memory import MemoryVectorDB
from models.modeling import backbone_and_head
from conftest import make_tiny_qwen3vl
from test_app import serve

playwright = pytest.importorskip("playwright.sync_api")

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
MAX_NEW_TOKENS = 400


@pytest.fixture(scope="module")
def vl_page_server(smollm2_dir):
    lm = make_tiny_qwen3vl(smollm2_dir)
    hook = backbone_and_head(lm.model)[0].register_forward_hook(lambda *_: time.sleep(0.025))
    # (no end of sequence before the Stop: a random model's early EOS had ended an answer before its Stop)
    with serve(lm, f"generation.max_new_tokens={MAX_NEW_TOKENS}", f"generation.min_new_tokens={MAX_NEW_TOKENS - 1}") \
            as server:
        yield server
    hook.remove()


@pytest.fixture
def page(tmp_path):
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's chromium at /usr/bin/chromium")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1150})
        page.set_default_timeout(60_000)
        page.requests, page.events = [], []
        page.on("request", lambda r: page.requests.append(r.url))
        page.on("requestfailed", lambda r: page.events.append(f"request failed: {r.method} {r.url}: {r.failure}"))
        page.on("console", lambda m: page.events.append(f"console {m.type}: {m.text}"))
        page.on("pageerror", lambda e: page.events.append(f"page error: {e}"))
        yield page
        browser.close()


def opened(page, url: str | None, model: str) -> None:
    """Open the page (or, after a login, wait for it): its status line names the model once its load event has
    run. A page that never says so fails with what the page, the browser and the server were doing."""
    if url:
        page.goto(url)
    try:
        page.wait_for_function(f"document.querySelector('#status')?.innerText.includes({model!r})")
    except playwright.TimeoutError:
        raise AssertionError(f"the page never named the model {model!r}:\n{diagnosis(page)}") from None


def diagnosis(page) -> str:
    """What a timed-out page shows (status, error toasts), what the browser logged and asked for, whether the
    server answers, and where every thread of this process stands (a handler stuck on a lock shows here)."""
    parts = [f"status: {page.inner_text('#status')!r}" if page.locator("#status").count() else "no #status",
             f"toasts: {[t.inner_text() for t in page.locator('.toast-body').all()]!r}",
             "browser: " + "\n  ".join(page.events[-40:]), "requests: " + "\n  ".join(page.requests[-40:])]
    try:
        with urllib.request.urlopen(urlparse(page.url)._replace(path="/health").geturl(), timeout=10) as r:
            parts.append(f"/health: {r.status} {r.read(500)!r}")
    except OSError as e:
        parts.append(f"/health: {e!r}")
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        parts.append(f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)[-8:]))
    return "\n".join(parts)


def bot_text(page) -> str:
    bots = page.locator("#chatbot .bot")
    return bots.last.inner_text() if bots.count() else ""


def stop(page) -> None:
    """Click Stop until the status says the answer stopped (on a loaded CI machine a click was lost, the first's once
    and the second's once: the status never said stopped); three tries."""
    for attempt in range(3):
        page.locator("#message .stop-button").click()
        try:
            page.wait_for_function("document.querySelector('#status').innerText.includes('stopped after')",
                                   timeout=15_000)
            return
        except playwright.TimeoutError:
            assert attempt < 2, page.inner_text("#status")


def test_chat_with_an_image_stream_stop_upload_and_recall(page, vl_page_server, tmp_path):
    service = vl_page_server.service
    opened(page, vl_page_server.url, "tiny-qwen3vl")

    # upload a bank (64 = the tiny model's hidden size)
    bank = MemoryVectorDB(64)
    bank.add(torch.randn(3, 64), ["Mira keeps the red lighthouse.", "Biscuit is a grey cat.", "The ferry leaves at 7."])
    bank.save(tmp_path / "mira.pt")
    page.locator("#bank-upload input[type=file]").set_input_files(str(tmp_path / "mira.pt"))
    page.wait_for_function("document.querySelector('#bank-info').innerText.includes('your upload mira.pt')")
    assert "3 memories" in page.inner_text("#bank-info")

    # recall first, a message with an image
    page.locator("#recall-first input[type=checkbox]").check()
    page.locator("#message textarea").fill("What is in this picture?")
    page.locator("#message input[type=file]").set_input_files(str(EXAMPLE_IMAGES[0]))
    page.wait_for_selector("#message img")  # the thumbnail of the attached image
    page.locator("#message [data-testid=submit-button]").click()

    # it streams: the answer grows while the status says it is generating
    page.wait_for_function("document.querySelector('#status').innerText.includes('generating')")
    first = len(bot_text(page))
    page.wait_for_function(f"(() => {{ const b = document.querySelectorAll('#chatbot .bot');"
                           f" return b.length && b[b.length - 1].innerText.length > {first + 20}; }})()")
    req = next((r for r in service.worker.running if r.kind == "chat"), None)
    assert req is not None and not req.done.is_set()

    # stop: the server-side loop ends, the partial answer stays
    stop(page)
    assert req.done.wait(30) and req.reason == "interrupted" and req.steps < MAX_NEW_TOKENS
    page.wait_for_function("document.querySelector('#chatbot').innerText.includes('(stopped)')")

    # the recall: a memory marker at the start of the answer, highlighted with its score, and in the log
    answer = page.inner_text("#answer")
    assert re.search(r"⟨memory #\d: (Mira keeps|Biscuit is|The ferry)", answer), answer
    assert re.search(r"memory -?0\.\d\d", answer, re.IGNORECASE), answer  # the label (shown upper-case)
    assert page.locator("#recall-log tbody tr").count() == 1
    assert page.locator("#chatbot .user img").count() == 1  # the attached image is in the history

    # the next message works normally
    page.locator("#message textarea").fill("And the cat?")
    page.locator("#message textarea").press("Enter")
    # (Stop once the second answer streams, as the first: a click while the page is still between the two
    # events can land on the first event's button, and the 400-token answer then ends by its length)
    page.wait_for_function("(() => { const b = document.querySelectorAll('#chatbot .bot');"
                           " return b.length >= 2 && b[1].innerText.length > 20; })()")
    stop(page)

    # a file that is not an image: refused by name and taken out of the message, whose text stays (it stayed
    # attached before, and every later send was refused again)
    (tmp_path / "fake.png").write_bytes(b"not an image, just text")
    page.locator("#message textarea").fill("What is this?")
    page.locator("#message input[type=file]").set_input_files(str(tmp_path / "fake.png"))
    page.wait_for_selector("#message img")  # (attached: its preview)
    page.locator("#message [data-testid=submit-button]").click()
    page.wait_for_function("document.querySelector('#status').innerText.includes('taken out of the message')")
    assert "fake.png: expected a PNG or JPEG image" in page.inner_text("#status")
    page.wait_for_function("!document.querySelector('#message img')")  # (taken out)
    assert page.locator("#message textarea").input_value() == "What is this?"

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser.png"), full_page=True)
    status, chat_text = page.inner_text("#status"), page.inner_text("#chatbot")
    assert "tiny-qwen3vl" in status and "bank: 3 memories (own)" in status and "tokens/s" in status
    assert "What is in this picture?" in chat_text and "And the cat?" in chat_text
    assert chat_text.count("(stopped)") == 2

    hosts = {urlparse(u).netloc for u in page.requests if not u.startswith(("data:", "blob:"))}
    assert hosts == {urlparse(vl_page_server.url).netloc}, hosts


def test_first_minute_with_the_trained_model(page, default_lm):
    """The README's first minute as the app starts by default (the embedded SmolLM2 with its recall adapter, on
    llama.cpp): build the example bank, ask about Port Avel without "recall first"; the model recalls by itself,
    the memory it picks is the fact that answers the question, and both answers are read from that memory."""
    with serve(default_lm, "generation.max_new_tokens=32") as server:
        opened(page, server.url, "SmolLM2")
        page.locator("#build-example").click()
        page.wait_for_function("document.querySelector('#bank-info').innerText.includes('36 memories')")
        for question, memory, value in [
                ("Who keeps the lighthouse of Port Avel?", "Mira Castellan is the lighthouse keeper", "Mira Castellan"),
                ("When does the ferry to Lune Island leave?", "The ferry to Lune Island leaves at seven", "seven")]:
            answer = ask(page, question)  # recalled without being asked to, the memory that answers it:
            assert re.search(r"⟨memory #\d+: " + memory, answer), answer
            if value is not None:  # the words after the memory marker are the model's own: read from the memory
                assert value in answer[answer.index("⟩") + 1:], answer
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "first_minute.png"), full_page=True)
        # on llama.cpp, layer decoding and the mixture are greyed out and say why (they only answered a warning)
        page.get_by_role("tab", name="Decoding").click()
        assert page.locator("#entropy-mode").get_by_label("trough").is_disabled()
        assert "this server runs llama.cpp" in page.inner_text("#entropy-mode")
        page.get_by_role("tab", name="Mixture").click()
        assert page.locator("#mixture-on input").is_disabled()
        # more processors: a stop string ends the answer where the model writes it; guidance is greyed out here
        page.get_by_role("tab", name="Decoding").click()
        page.get_by_text("More processors").click()
        assert page.locator("#guidance-scale input[type=range]").is_disabled()
        page.locator("#stop-strings textarea").fill("Castellan")
        answer = ask(page, "Who keeps the lighthouse of Port Avel?")
        assert answer[answer.index("⟩") + 1:].rstrip().endswith("Castellan"), answer
        # the chatbot's own trash icon clears the conversation on the server too (it emptied the page alone, and the
        # next message read the old turns again), as the Conversation tab's Clear does
        page.locator('#chatbot button[aria-label="Clear"]').click()
        page.wait_for_function("document.querySelector('#status').innerText.includes('cleared')")
        assert all(not server.service.state(s).messages for s in list(server.service.sessions.values()))


def test_entropy_and_mixture_pictures_show_in_the_page(page, smollm2):
    """Layer decoding (seed 002) draws entropy over layers; the mixture (seed 003) draws α* per token and
    the status line shows the speculative draft's acceptance."""
    with serve(smollm2, "generation.max_new_tokens=8") as server:
        opened(page, server.url, "SmolLM2")
        page.get_by_role("tab", name="Decoding").click()
        assert page.input_value("#seed textarea") == ""  # (a Number box showed, and sent, seed 0: `seed: null`)
        page.locator("#entropy-mode").get_by_label("trough").check()
        page.locator("#message textarea").fill("Name a colour.")
        page.locator("#message textarea").press("Enter")
        page.wait_for_selector("#decoding-plot img", state="visible")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "entropy.png"), full_page=True)
        page.locator("#entropy-mode").get_by_label("off").check()
        page.get_by_role("tab", name="Mixture").click()
        assert page.locator("#mixture-alpha input[type=range]").is_disabled()  # α automatic: no fixed weight
        page.locator("#mixture-alpha-auto input[type=checkbox]").uncheck()
        page.wait_for_function("!document.querySelector('#mixture-alpha input[type=range]').disabled")
        page.locator("#mixture-alpha-auto input[type=checkbox]").check()
        page.locator("#mixture-on input[type=checkbox]").check()
        page.locator("#message textarea").fill("And another one?")
        page.locator("#message textarea").press("Enter")
        # drawn speculatively (the configured draft: llama.cpp on the embedded GGUF)
        page.wait_for_function("document.querySelector('#status').innerText.includes('tokens per verify')")
        page.wait_for_selector("#decoding-plot img", state="visible")
        page.screenshot(path=str(ARTIFACTS / "mixture.png"), full_page=True)


def login(page, url: str, name: str, password: str) -> None:
    page.goto(url)
    page.get_by_label("username").fill(name)
    page.get_by_label("password").fill(password)
    page.get_by_role("button", name="Login").click()
    opened(page, None, "SmolLM2")


def say(page, text: str, until: str) -> str:
    """Send a message; the status line once the status shows `until` and done."""
    page.locator("#message textarea").fill(text)
    page.locator("#message textarea").press("Enter")
    page.wait_for_function(f"document.querySelector('#status').innerText.includes({until!r}) && "
                           "document.querySelector('#status').innerText.includes('done')")
    return page.inner_text("#status")


def ask(page, question: str) -> str:
    """Ask in a new conversation; the last answer as the page shows it (memory markers included)."""
    page.get_by_role("tab", name="Conversation").click()
    page.locator("#clear").click()
    page.wait_for_function("document.querySelectorAll('#chatbot .bot').length === 0")
    page.locator("#message textarea").fill(question)
    page.locator("#message textarea").press("Enter")
    page.wait_for_function("document.querySelectorAll('#chatbot .bot').length > 0 && "
                           "document.querySelector('#status').innerText.includes('done')")
    return page.inner_text("#answer")


def test_a_person_is_remembered_across_a_restart_and_sees_only_their_own(page, default_lm, tmp_path):
    """Log in, tell three things in one conversation (each "Remembered: ...", one undone and told again), restart the
    server, ask in new conversations, see, edit and delete the memories in "About you"; ask about something never
    told and hear "you haven't told me"; another user sees none of them."""
    from chat import users

    path = tmp_path / "users.json"
    users.add(path, "ada", "ada-password")
    users.add(path, "bob", "bob-password")
    overrides = ("generation.max_new_tokens=40", f"app.users_file={path}", f"memory.user_dir={tmp_path / 'mem'}")
    told = {"My dog is a beagle called Pocket.": "The user's dog is a beagle called Pocket.",
            "My sister is called Lena.": "The user's sister is called Lena.",
            "I live in Porto.": "The user lives in Porto."}
    with serve(default_lm, *overrides) as server:
        login(page, server.url, "ada", "ada-password")
        for fact, memory in told.items():  # told as one tells a friend: the write decision keeps them
            say(page, fact, f"Remembered: {memory}")
            page.wait_for_function(f"document.querySelector('#change-note')?.innerText?.includes({memory!r})")
        page.locator("#undo-change").click()  # the last one undone: gone from "About you"; told again
        page.wait_for_function("document.querySelector('#status').innerText.includes('Undone')")
        page.get_by_role("tab", name="Memory").click()
        page.wait_for_function("document.querySelector('#about-info').innerText.includes('2 memories')")
        page.wait_for_function("document.querySelector('#about-list')?.innerText?.includes('Pocket')")  # (rendered)
        assert "Porto" not in page.inner_text("#about-list")
        page.get_by_role("tab", name="Conversation").click()
        say(page, "I live in Porto.", "Remembered: The user lives in Porto.")
    with serve(default_lm, *overrides) as server:  # a restart; a new page, new conversations
        login(page, server.url, "ada", "ada-password")
        for question, value in [("What is my dog's name?", "Pocket"), ("What is my sister's name?", "Lena"),
                                ("Where do I live?", "Porto")]:
            answer = ask(page, question)
            assert "⟨memory" in answer and value in answer[answer.index("⟩") + 1:], (answer, page.inner_text("#status"))
        never = ask(page, "What am I allergic to?")  # never told, and none of her memories is close to it
        assert "haven't told me" in never and "⟨memory" not in never, never
        page.get_by_role("tab", name="Memory").click()
        page.wait_for_function("document.querySelector('#about-info').innerText.includes('3 memories')")
        # (the table renders after the count: CI once read it with its headers only)
        page.wait_for_function(f"(() => {{ const t = document.querySelector('#about-list')?.innerText || ''; "
                               f"return {json.dumps(list(told.values()))}.every(m => t.includes(m)); }})()")
        listed = page.inner_text("#about-list")
        assert all(memory in listed for memory in told.values()), listed
        sister = re.search(r"(m-[0-9a-f]{12})\s+\S+ \S+\s+The user's sister", listed)[1]
        page.locator("#about-ids textarea").fill(sister)  # edit: the sister is called Lina
        page.locator("#about-text textarea").fill("My sister is called Lina.")
        page.locator("#about-edit").click()
        page.wait_for_function("document.querySelector('#about-list').innerText.includes('called Lina')")
        assert "called Lena" not in page.inner_text("#about-list")
        dog = re.search(r"(m-[0-9a-f]{12})\s+\S+ \S+\s+The user's dog", page.inner_text("#about-list"))[1]
        page.locator("#about-ids textarea").fill(dog)
        page.locator("#about-delete").click()
        page.wait_for_function("document.querySelector('#about-info').innerText.includes('2 memories')")
        page.wait_for_function("!document.querySelector('#about-list')?.innerText?.includes('Pocket')")  # (rendered)
        assert "Pocket" not in page.inner_text("#about-list") and "Lina" in page.inner_text("#about-list")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "about_you.png"), full_page=True)

        page.context.clear_cookies()  # bob, on the same server
        login(page, server.url, "bob", "bob-password")
        page.get_by_role("tab", name="Memory").click()
        page.wait_for_function("document.querySelector('#about-info').innerText.includes('0 memories')")
        page.get_by_role("tab", name="Conversation").click()
        page.locator("#message textarea").fill("What is my sister's name?")
        page.locator("#message textarea").press("Enter")
        page.wait_for_function("document.querySelectorAll('#chatbot .bot').length > 0 && "
                               "document.querySelector('#status').innerText.includes('done')")
        assert "Lena" not in page.inner_text("#chatbot") and "haven't told me" in page.inner_text("#chatbot")

        users.remove(path, "bob")  # bob's open page: its next message is refused, and nothing of it is written
        page.locator("#message textarea").fill("My brother is called Tom.")
        page.locator("#message textarea").press("Enter")
        page.get_by_text("the user 'bob' is no longer on this server: log in again").first.wait_for()
        assert not (tmp_path / "mem" / "bob").exists() or "Tom" not in "".join(
            p.read_text(errors="ignore") for p in (tmp_path / "mem" / "bob").rglob("*") if p.is_file())


def test_an_idle_page_says_its_conversation_was_let_go(page, smollm2):
    """The janitor frees what an idle page's session holds; in a browser the next message said nothing (Gradio's own
    state time to live had replaced the session with an empty one) and was answered without the earlier turns."""
    with serve(smollm2, "app.session_ttl_s=2", "generation.max_new_tokens=4") as server:
        opened(page, server.url, "SmolLM2")
        for text, bots in (("My name is Oda.", 1), ("What is my name?", 2)):
            if bots == 2:  # (idle past the time to live: the janitor frees the session)
                deadline = time.monotonic() + 30
                while server.service.sessions and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert not server.service.sessions
            page.locator("#message textarea").fill(text)
            page.locator("#message textarea").press("Enter")
            page.wait_for_function(f"document.querySelectorAll('#chatbot .bot').length >= {min(bots, 1)} && "
                                   "document.querySelector('#status').innerText.includes('done')")
        page.wait_for_function("document.querySelector('#status').innerText.includes('this page was idle for')")
        assert "its conversation and its bank were let go" in page.inner_text("#status")

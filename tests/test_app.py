"""The app through its HTTP API: gradio_client against real servers (SmolLM2; a tiny Qwen3-VL for images)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

import app
from chat.config import load_config
from chat.service import ASSETS, Service
from page import controls as page_controls
from page.handlers import MEMORY_COLOR
from page.layout import build_demo
from memory import MemoryVectorDB
from models.modeling import adapter_merged
from conftest import make_tiny_qwen3vl
from tests_helpers import Evil, bank_file

pytestmark = pytest.mark.slow

STATUS = 3  # chat outputs: chatbot, highlight, recall log, status, box


def launch(demo, service) -> int:
    """Start on a free port (Gradio scans from 7860 and skips ports taken meanwhile); return it."""
    app.launch(demo, service, server_port=None, prevent_thread_lock=True, quiet=True)
    return demo.server_port


@contextmanager
def serve(lm, *overrides: str):
    memories = tempfile.mkdtemp(prefix="recall-chat-users-")  # each server its own users' memories (unless given)
    cfg = load_config(overrides=["generation.max_new_tokens=12", f"memory.user_dir={memories}", *overrides],
                      environ={})
    service = Service(cfg, lm)
    demo = build_demo(service)
    port = launch(demo, service)
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}/", service=service, cfg=cfg)
    finally:
        demo.close()
        service.close()


@pytest.fixture(scope="module")
def server(smollm2):
    with serve(smollm2) as s:
        yield s


@pytest.fixture(scope="module")
def vl_server(smollm2_dir):
    with serve(make_tiny_qwen3vl(smollm2_dir)) as s:
        yield s


@pytest.fixture
def client(server, tmp_path):
    return Client(server.url, verbose=False, download_files=str(tmp_path))


def test_help_prints_the_usage_and_nothing_else():
    """A plain start is quiet: importing the project prints nothing of torchao or torch (transformers
    imports torchao whenever it is installed; models/quantize.py drops what that import logs)."""
    done = subprocess.run([sys.executable, "app.py", "--help"], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0 and done.stdout.startswith("usage: recall-chat")
    assert done.stderr == ""


def message(text: str, *files) -> dict:
    return {"text": text, "files": [handle_file(str(f)) for f in files]}


def chat(client: Client, text: str, *files, **settings):
    return client.submit(message=message(text, *files), seed=None, **settings, api_name="/chat")


def last_text(outputs) -> str:
    """The text of the newest chat-window message."""
    content = outputs[0][-1]["content"]
    return "".join(part.get("text", "") for part in content)


def running_request(service: Service, label: str, timeout: float = 60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for req in list(service.worker.running):
            if req.label == label:
                return req
        time.sleep(0.005)
    raise AssertionError(f"no request {label!r} ran")


def test_the_controls_offer_what_the_server_accepts_and_alpha_has_its_own_switch():
    cfg = load_config(overrides=["app.max_new_tokens_cap=300"], environ={})
    controls = {**page_controls.settings_tab(cfg, "Decoding"), **page_controls.settings_tab(cfg, "Mixture")}
    assert (controls["max_new_tokens"].minimum, controls["max_new_tokens"].maximum) == (1, 300)
    assert controls["mixture_alpha_auto"].value is True and not controls["mixture_alpha"].interactive
    assert (controls["mixture_alpha"].minimum, controls["mixture_alpha"].maximum) == (0, 1)
    page = {name: c.value for name, c in controls.items()}
    assert page_controls.settings(cfg, page)[0].mixture.alpha == "auto"
    fixed = page_controls.settings(cfg, {**page, "mixture_alpha_auto": False, "mixture_alpha": 0.3})[0]
    assert fixed.mixture.alpha == 0.3


def test_module_level_demo_and_command_line():
    import gradio as gr

    assert isinstance(app.demo, gr.Blocks)
    _, cfg = app.parse_args(["--port", "7999", "--set", "generation.temperature=0.3", "--bank", "b.pt"])
    assert (cfg.app.port, cfg.generation.temperature, cfg.memory.bank) == (7999, 0.3, "b.pt")
    with pytest.raises(SystemExit):
        app.parse_args(["--set", "generation.top_p=7"])


def test_answers_stream_in_several_updates(client):
    job = chat(client, "Tell me about lighthouses.", max_new_tokens=16)
    outputs = list(job)
    texts = [last_text(o) for o in outputs if o[0] and o[0][-1]["role"] == "assistant"]
    growing = [t for t in texts if t and t != "…"]
    assert len(set(growing)) >= 3, texts  # several partial answers, not one final blob
    assert all(len(a) <= len(b) for a, b in zip(growing, growing[1:]))
    assert "done (max new tokens, or the time limit)" in outputs[-1][STATUS] and "tokens/s" in outputs[-1][STATUS]
    assert outputs[-1][0][0] == {"role": "user", "metadata": None, "options": None,
                                 "content": [{"text": "Tell me about lighthouses.", "type": "text"}]}


def test_health_names_the_in_process_model_and_the_bank_store(server):
    import json
    import urllib.request

    with urllib.request.urlopen(server.url + "health", timeout=60) as response:
        health = json.loads(response.read())
    (replica,) = health["replicas"]
    assert replica["replica"] == "in-process" and replica["alive"] is True and replica["model"]
    assert replica["vision"] is False
    assert health["bank"]["store"] == "faiss"


def test_the_port_opens_with_the_api_in_place(monkeypatch, tmp_path):
    """/v1 and /health are made with Gradio's app, before its port opens: the first request the port takes finds
    them (they were once added after `launch` had opened it, and a client polling from the start got 404s)."""
    import gradio.http_server
    import httpx

    real, first = gradio.http_server.start_server, {}

    def start_server(app, **kw):  # the first requests, as soon as the port is open
        started = real(app=app, **kw)
        for path in ("/v1/models", "/health"):
            first[path] = httpx.get(f"http://127.0.0.1:{started[1]}{path}", timeout=60).status_code
        return started

    monkeypatch.setattr(gradio.http_server, "start_server", start_server)
    service = Service(load_config(overrides=[f"memory.user_dir={tmp_path}"], environ={}))  # (its model unloaded)
    demo = build_demo(service)
    try:
        launch(demo, service)
        assert first == {"/v1/models": 200, "/health": 200}
    finally:
        app.close(demo, service)


def test_sigterm_ends_every_open_answer_with_a_last_event(tmp_path):
    """SIGTERM while API answers stream (the default app, llama.cpp): each stream gets an error event (the server
    is shutting down) and [DONE], a whole answer a 503, then the server exits 0 with no traceback. (The worker's
    waiters were once shut down under the open streams: one ended cleanly, another broke off mid-body, and the
    log showed "cannot schedule new futures after shutdown".)"""
    import signal
    import threading

    import httpx
    from test_start import free_port, serving

    port = free_port()
    proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port), "--set", f"memory.user_dir={tmp_path}"],
                            cwd=Path(__file__).parents[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, got = f"http://127.0.0.1:{port}", {}
    ask = {"model": "recall-chat", "max_tokens": 1024,
           "messages": [{"role": "user", "content": "Write a very long essay about ships."}]}
    streaming = [threading.Event(), threading.Event()]

    def stream(i):
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json={**ask, "stream": True}, timeout=120) as r:
                lines = []
                for line in r.iter_lines():
                    if line.strip():
                        lines.append(line)
                    if '"content": "' in line and '"content": ""' not in line:
                        streaming[i].set()
                got[i] = lines
        except Exception as e:  # noqa: BLE001 - what the test reports
            got[i] = f"{type(e).__name__}: {e}"
        finally:
            streaming[i].set()

    def whole():
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json=ask, timeout=120)
            got["whole"] = (r.status_code, r.json())
        except Exception as e:  # noqa: BLE001
            got["whole"] = f"{type(e).__name__}: {e}"

    try:
        assert serving(proc, port, timeout=300), proc.stdout.read()
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)] + [threading.Thread(target=whole)]
        for t in threads:
            t.start()
        assert all(e.wait(120) for e in streaming)
        deadline = time.monotonic() + 60  # the whole answer runs too
        while httpx.get(f"{url}/health", timeout=30).json()["replicas"][0]["running"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert "Traceback" not in log and "cannot schedule" not in log, log[-3000:]
    for i in range(2):
        assert isinstance(got[i], list), got[i]
        assert got[i][-1] == "data: [DONE]" and not any("finish_reason\": \"" in line for line in got[i])
        error = json.loads(got[i][-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
    assert got["whole"][0] == 503 and got["whole"][1]["error"]["code"] == "server_shutting_down", got["whole"]


def test_cancel_stops_the_server_side_loop(client, server):
    label = "Write a very long essay about the sea."
    job = chat(client, label, max_new_tokens=400)
    req = running_request(server.service, label)
    for out in job:
        if "generating…" in out[STATUS] and req.steps >= 3:
            break
    cancelled = time.perf_counter()
    job.cancel()
    assert req.done.wait(60)
    latency = req.finished - cancelled
    print(f"\ncancel -> worker finished: {latency * 1000:.0f} ms, {req.steps} of 400 tokens generated")
    assert req.reason == "interrupted" and req.stop_requested is not None
    assert req.steps < 100  # far fewer than max_new_tokens: the loop itself stopped
    # the next message works normally, after the kept partial answer
    final = list(chat(client, "Thanks.", max_new_tokens=4))[-1]
    assert "done" in final[STATUS]
    assert [m["role"] for m in final[0]] == ["user", "assistant"] * 2
    assert last_text((final[0][:2],)).endswith("_(stopped)_")


def test_two_sessions_share_the_model_and_one_stop_stops_only_its_own(server, tmp_path):
    a = Client(server.url, verbose=False, download_files=str(tmp_path))
    b = Client(server.url, verbose=False, download_files=str(tmp_path))
    job_a = chat(a, "Session A: describe the ocean at length.", max_new_tokens=300)
    req_a = running_request(server.service, "Session A: describe the ocean at length.")
    final_b = list(chat(b, "Session B: say hello.", max_new_tokens=6))[-1]
    assert "done" in final_b[STATUS] and last_text(final_b)  # b got its whole answer while a was writing
    assert not req_a.done.is_set()
    assert "stopped after" in a.predict(api_name="/stop")
    job_a.result(timeout=120)
    assert req_a.reason == "interrupted" and "stopped after" in job_a.outputs()[-1][STATUS]
    reasons = {r.label: r.reason for r in server.service.worker.history}
    assert reasons["Session B: say hello."] in ("length", "stop")
    assert "nothing to stop" in b.predict(api_name="/stop")


def test_invalid_settings_show_the_engine_message(client):
    out = client.predict(message=message("hi"), seed=None, negative_prompt="a rude reply", api_name="/chat")
    assert "⚠ negative_prompt is 'a rude reply'" in out[STATUS] and "Traceback" not in out[STATUS]
    with pytest.raises(AppError, match="Value 0.0 is less than minimum value 0.05"):  # the slider's own range,
        client.predict(message=message("hi"), seed=None, do_sample=True, temperature=0.0, api_name="/chat")
    out = client.predict(message=message("hi"), seed=-1, api_name="/chat")
    assert "⚠ seed is -1" in out[STATUS]




def test_with_no_bank_no_bank_is_shown_chosen(client, tmp_path):
    """(A probe: "Use bank" showed "shared" chosen on a server with no shared bank.)"""
    md, _, status, use = client.predict("shared", api_name="/use_bank")
    assert "bank: none" in status and use is None, (md, status, use)
    good = bank_file(tmp_path / "good.pt", 576)
    *_, use, _ = client.predict(handle_file(str(good)), api_name="/upload_bank")
    assert use == "own"


def test_bank_upload_and_bad_uploads_leave_the_bank_untouched(client, tmp_path):
    good = bank_file(tmp_path / "good.pt", 576)
    md, sample, status, _, kept = client.predict(handle_file(str(good)), api_name="/upload_bank")
    assert "your upload good.pt" in md and "**3** memories" in md and "576-d" in md
    assert kept is None  # (the box held a link to the upload's deleted copy: a 403)
    assert [row[1] for row in sample["data"]] == ["fact 0", "fact 1", "fact 2"]
    marker = tmp_path / "pwned"
    torch.save({"embeddings": Evil(marker)}, tmp_path / "payload.pt")
    (tmp_path / "corrupt.pt").write_bytes(b"\x00" + os.urandom(4096))  # (not a zip's or a pickle's start)
    bad = {bank_file(tmp_path / "small.pt", 64): "expected vectors of dimension 576, got dimension 64",
           tmp_path / "payload.pt": "corrupt or refused", tmp_path / "corrupt.pt":
               "expected a PyTorch .pt file, got other bytes"}
    for path, expected in bad.items():
        md, _, status, use, box = client.predict(handle_file(str(path)), api_name="/upload_bank")
        assert status.count("⚠") == 1 and expected in status and "current bank is kept" in status
        assert box is None  # (the refused file left the upload box: it stayed there, as if loaded)
        assert "your upload good.pt" in md and "**3** memories" in md and use == "own"
    assert not marker.exists()


def test_write_memories_and_find_them_by_text(client, server):
    md, _, status, _, text_box, _ = client.predict(
        "Mira's boat is called the Heron.\nThe ferry leaves at seven.\nOda bakes saffron bread.", None,
        api_name="/write_memories")
    assert "**3** memories" in md and "your own bank" in md and text_box == ""
    # (the bank's keys come from the key encoder, trained on questions: 0.98 for this one against 0.36 for the
    # ferry; a bare fragment such as "name of the boat" ties the two, 0.48 and 0.49, where stock MiniLM gave 0.55 / 0.39)
    found, status = client.predict("What is Mira's boat called?", 2, api_name="/find_memories")
    assert found["headers"] == ["memory", "similarity", "text"] and found["data"][0][2].startswith("Mira's boat")
    md, *_ = client.predict("0", api_name="/delete_memories")
    assert "**2** memories" in md
    path, status = client.predict(".pt", api_name="/download_bank")
    assert len(MemoryVectorDB.load(path)) == 2
    # written in the session's own folder (freed with it; it stayed in the server's until the server ended)
    (session,) = [x for x in server.service.sessions.values() if x.own_bank is not None and len(x.own_bank) == 2]
    assert [p.name for p in session.files.glob("memory-bank-*")] == ["memory-bank-2.pt"]
    assert not list(server.service.files.glob("memory-bank-*"))


def test_example_bank_and_recall_first_show_a_highlighted_memory(client):
    md, _, status, use = client.predict(api_name="/build_example_bank")
    assert "example bank" in md and "**36** memories" in md and use == "example"
    out = client.predict(message=message("Who keeps the lighthouse of Port Avel?"), seed=None, recall_first=True,
                         max_new_tokens=8, api_name="/chat")
    chatbot, highlight, log = out[0], out[1], out[2]
    first = highlight["value"][0]
    assert first["token"].startswith("⟨memory #") and first["class_or_confidence"].startswith("memory 0.")
    assert highlight["color_map"] == {first["class_or_confidence"]: MEMORY_COLOR}
    assert log["headers"] == ["turn", "position", "slots", "score", "memory", "text"] and len(log["data"]) == 1
    assert log["data"][0][5] in (ASSETS / "example_memories.txt").read_text()
    assert last_text((chatbot,)).startswith("`⟨memory #")


def test_save_and_load_a_conversation(server, tmp_path):
    a = Client(server.url, verbose=False, download_files=str(tmp_path))
    list(chat(a, "Remember the word heron.", max_new_tokens=4))
    path, status = a.predict(api_name="/save_conversation")
    assert path.endswith(".json") and "conversation saved" in status
    b = Client(server.url, verbose=False, download_files=str(tmp_path / "b"))
    chatbot, _, _, status = b.predict(handle_file(path), api_name="/load_conversation")
    assert "conversation loaded" in status and chatbot[0]["content"][0]["text"] == "Remember the word heron."
    chatbot, _, _, status, _ = b.predict(seed=None, max_new_tokens=4, api_name="/regenerate")
    assert len(chatbot) == 2 and "done" in status
    chatbot, _, _, status, _ = b.predict(api_name="/clear")
    assert chatbot == [] and "cleared" in status


def test_an_image_for_a_text_only_model_gets_a_notice(client, small_image):
    out = list(chat(client, "What colour is this?", small_image, max_new_tokens=4))[-1]
    assert "reads text only" in out[STATUS] and "answering the text alone" in out[STATUS]
    assert [m["role"] for m in out[0]] == ["user", "assistant"]


def test_a_vision_model_sees_the_attached_image(vl_server, tmp_path, small_image):
    c = Client(vl_server.url, verbose=False, download_files=str(tmp_path))
    outputs = list(chat(c, "What is in this picture?", small_image, max_new_tokens=6))
    final = outputs[-1]
    assert "done" in final[STATUS] and "⚠" not in final[STATUS]
    user = final[0][0]["content"]
    assert user[0]["type"] == "file" and user[0]["file"].endswith(".png")
    assert user[1]["text"] == "What is in this picture?"
    assert vl_server.service.worker.history[-1].steps >= 1
    md, *_ = c.predict("", [handle_file(str(small_image))], api_name="/write_memories")
    assert "**1** memories" in md and "64-d" in md


def _examples(url: str) -> list[str]:
    """The texts of the page's "Try" examples, as the browser receives them."""
    import json
    import urllib.request

    with urllib.request.urlopen(url + "config", timeout=60) as response:
        config = json.loads(response.read())
    (examples,) = [c for c in config["components"] if c.get("type") == "dataset"]
    return [sample[0]["text"] for sample in examples["props"]["samples"]]


def test_the_image_example_is_offered_only_by_a_model_that_reads_images(server, vl_server):
    assert "What does this picture show?" not in _examples(server.url)
    assert "What does this picture show?" in _examples(vl_server.url)
    assert "Who keeps the lighthouse of Port Avel?" in _examples(server.url)


def test_a_page_load_copies_no_model_parameters(server, monkeypatch):
    """Gradio deep-copies the page config on every page load: no prop may reach the model."""
    import urllib.request

    copies = []
    original = torch.nn.Parameter.__deepcopy__
    monkeypatch.setattr(torch.nn.Parameter, "__deepcopy__",
                        lambda self, memo: copies.append(self.shape) or original(self, memo))
    for _ in range(3):
        with urllib.request.urlopen(server.url, timeout=30) as page:
            assert page.status == 200 and b"recall chat" in page.read()
        with urllib.request.urlopen(server.url + "config", timeout=30) as config:
            assert config.status == 200
    assert copies == [], f"a page load deep-copied {len(copies)} model parameters"


def test_entropy_decoding_draws_its_picture_when_the_answer_ends(client, server):
    outputs = list(chat(client, "Name a colour.", max_new_tokens=6, entropy_decoding="trough"))
    assert all(o[4] == {"__type__": "update"} for o in outputs[:-1])  # nothing drawn while it streams
    plot = outputs[-1][4]
    assert plot["visible"] is True and plot["value"]["type"] == "matplotlib"
    assert plot["value"]["plot"].startswith("data:image/")
    assert "done" in outputs[-1][STATUS]
    out = client.predict(message=message("Again."), seed=None, max_new_tokens=3, entropy_decoding="off",
                         api_name="/chat")
    assert out[4]["visible"] is False  # a plain answer has no entropy picture
    with pytest.raises(Exception, match="'sideways'.* not in the list of choices"):  # Gradio checks the radio
        client.predict(message=message("hi"), seed=None, entropy_decoding="sideways", api_name="/chat")
    healthy = client.predict(message=message("hi"), seed=None, max_new_tokens=2, api_name="/chat")
    assert "done" in healthy[STATUS]


def test_mixture_answers_from_q_star_and_draws_alpha(client, server):
    """The Mixture tab: q* of the model with its recall adapter (θ) and its base (t), drawn speculatively
    (the configured draft: llama.cpp on the embedded GGUF)."""
    assert server.service.lm.model.peft_config  # the embedded model comes with its adapter
    outputs = list(chat(client, "Name a colour.", max_new_tokens=8, mixture=True, mixture_speculative=True,
                        mixture_gamma=3))
    final = outputs[-1]
    assert "done" in final[STATUS] and "q*: acceptance" in final[STATUS]
    assert ("gguf", None) in server.service.lm._targets  # drafted by llama.cpp
    assert final[4]["visible"] is True and final[4]["value"]["plot"].startswith("data:image/")
    assert last_text(final)
    fixed = client.predict(message=message("And another?"), seed=None, max_new_tokens=4, mixture=True,
                           mixture_alpha_auto=False, mixture_alpha=1.0, mixture_speculative=False, api_name="/chat")
    assert "q*: direct" in fixed[STATUS]
    fixed_sessions = [x for x in server.service.sessions.values() if x.last_note == "q*: direct"]
    alphas = [a for a in fixed_sessions[0].last_plot[1] if a == a]  # (nan at a memory position)
    assert len(fixed_sessions) == 1 and alphas and all(a == 1.0 for a in alphas)  # α fixed at 1: π_θ alone
    clash = client.predict(message=message("hi"), seed=None, mixture=True, entropy_decoding="trough",
                           api_name="/chat")
    assert "mixture enabled is True with entropy_decoding='trough'" in clash[STATUS]
    plain = client.predict(message=message("hi"), seed=None, max_new_tokens=2, api_name="/chat")
    assert "done" in plain[STATUS] and "q*" not in plain[STATUS] and plain[4]["visible"] is False
    assert adapter_merged(server.service.lm.model)  # the mixture mixed with a base copy: θ stayed merged


def test_about_you_lists_edits_deletes_exports_and_imports_your_memories(client, tmp_path):
    client.predict("", api_name="/forget_all_memories")
    md, table, status = client.predict("my dog is a beagle called Pocket", "", api_name="/remember")
    assert "Remembered: The user's dog is a beagle called Pocket." in status and "**About you**: 1 memory," in md
    client.predict("I live in Porto", "", api_name="/remember")
    md, table, status = client.predict("I live in Porto", "", api_name="/remember")  # the same again: kept once
    assert "Already remembered" in status and "2 memories" in md
    assert [row[2] for row in table["data"]] == ["The user lives in Porto.", "The user's dog is a beagle called Pocket."]
    porto, dog = (row[0] for row in table["data"])
    _, found, _ = client.predict("porto", api_name="/my_memories")  # the search box
    assert [row[0] for row in found["data"]] == [porto]

    _, table, status = client.predict(porto, "I live in Lisbon", "", api_name="/edit_memory")
    assert [row[2] for row in table["data"]][0] == "The user lives in Lisbon." and porto not in status
    assert porto not in [row[0] for row in table["data"]] and len(table["data"]) == 2
    _, table, status = client.predict("m-000000000000", "", api_name="/forget_memories")
    assert "no such memory of yours" in status and len(table["data"]) == 2  # nothing deleted
    _, table, status = client.predict(" ", "", api_name="/forget_memories")  # (it said "Forgot:" and nothing)
    assert "expected the id(s) of the memories to forget" in status and len(table["data"]) == 2

    path, _ = client.predict(api_name="/export_memories")
    exported = json.loads(Path(path).read_text())
    assert sorted(m["text"] for m in exported["memories"]) == ["The user lives in Lisbon.",
                                                               "The user's dog is a beagle called Pocket."]
    _, table, status = client.predict(dog, "", api_name="/forget_memories")
    assert [row[2] for row in table["data"]] == ["The user lives in Lisbon."]
    md, table, status = client.predict(handle_file(path), "", api_name="/import_memories")
    assert "imported 1 new memories" in status and len(table["data"]) == 2  # Lisbon was there: written once
    bad = tmp_path / "bad.json"
    bad.write_text('{"memories": [1, 2]}')
    md, table, status = client.predict(handle_file(str(bad)), "", api_name="/import_memories")
    assert "expected" in status and "nothing was written" in status and len(table["data"]) == 2
    assert "got memory 1 as 1;" in status  # (every shape said "got something else")
    md, table, status = client.predict("", api_name="/forget_all_memories")
    assert "forgot all 2 memories" in status and table["data"] in ([], [["", "", ""]])


def test_an_undo_that_changes_nothing_is_not_called_undone(client):
    """(A probe: an undo whose change had been taken back by hand said "Undone: Nothing to undo: ...".)"""
    client.predict("", api_name="/forget_all_memories")
    _, table, _ = client.predict("I live in Porto", "", api_name="/remember")
    porto = table["data"][0][0]
    _, table, _ = client.predict(porto, "I live in Lisbon", "", api_name="/edit_memory")  # the change to undo
    client.predict(table["data"][0][0], "", api_name="/forget_memories")  # what it wrote, deleted by hand
    client.predict("I live in Porto", "", api_name="/remember")  # and what it replaced, told again
    _, table, status, *_ = client.predict("", api_name="/undo_memory_change")
    assert "Not restored, already remembered: The user lives in Porto." in status and "Undone" not in status, status
    assert [row[2] for row in table["data"]] == ["The user lives in Porto."]
    client.predict("", api_name="/forget_all_memories")


def test_ctrl_c_while_starting_ends_with_a_line_not_a_traceback(monkeypatch):
    """(Ctrl-C while the model loaded, or while `recall-memory build` encoded, printed a KeyboardInterrupt
    traceback.)"""
    from chat import bankcli

    def interrupted(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr(app.signal, "signal", lambda *_: None)  # (this process keeps its own SIGTERM)
    monkeypatch.setattr(app, "check_listen", lambda *_: None)
    monkeypatch.setattr(app, "make_service", interrupted)
    with pytest.raises(SystemExit, match="recall-chat: interrupted while starting; nothing was started"):
        app.main(["--port", "7999"])
    monkeypatch.setattr(bankcli, "cmd_show", interrupted)
    assert bankcli.main(["show", "x.pt"]) == 130

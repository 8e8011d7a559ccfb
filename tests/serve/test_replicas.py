"""Two model replicas of a tiny model on a real local Ray Serve (num_cpus=2), the shared bank in real
milvus-lite, people in a users file: answers equal the in-process ones, sessions stick, stop, recall, each user's own
memory, a killed replica, errors."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from pathlib import Path

import httpx
import pytest
import torch

from chat import users

ray = pytest.importorskip("ray")
pytest.importorskip("pymilvus")
openai = pytest.importorskip("openai")

from gradio_client import Client, handle_file  # noqa: E402

import app  # noqa: E402
from chat import operations as ops  # noqa: E402
from chat.config import load_config  # noqa: E402
from chat.service import Service  # noqa: E402
from chat.view import TurnView, chat_messages, recall_table  # noqa: E402
from chat.worker import Notice  # noqa: E402
from memory.milvus import StoreError  # noqa: E402
from conftest import make_tiny_llama  # noqa: E402
from decoding.events import FinishEvent, RecallEvent, TokenEvent  # noqa: E402
from decoding.settings import GenerationSettings, RecallSettings  # noqa: E402
from replica_loaders import broken_model  # noqa: E402
from page.layout import build_demo  # noqa: E402
from serve.cluster import ServeError, start_replicas  # noqa: E402
from serve.front import RemoteService  # noqa: E402
from tests_helpers import drain, result  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
GREEDY = GenerationSettings(max_new_tokens=8)  # (the page and /v1 use the config's: `svc.cfg.generation`)
OFF = RecallSettings(enabled=False)
QUESTIONS = ["Hello there", "What is a comet?", "Tell me about bread.", "Why do cats purr?"]
PEOPLE = ("cy", "ada", "bob")  # cy: the page's and the API's user where answers are compared with the in-process ones


def config(tmp, *more: str):
    # answers take turns on each model (app.batching=false): a random tiny model's logits are near ties, which
    # the float rounding of another batch composition can flip; what is compared here is the routing
    return load_config(overrides=["generation.max_new_tokens=8", "model.compile=false", "app.batching=false",
                                  "serve.replicas=2",
                                  "serve.replica_cpus=1", "memory.store=milvus", f"memory.milvus_uri={tmp}/bank.db",
                                  *more], environ={})


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), str(TESTS / "serve")]),
        "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, str]:
    """The users file of `front`: each person's API key (their password: "<name>-password")."""
    path = tmp_path_factory.mktemp("people") / "users.json"
    return {"path": str(path), **{name: users.add(path, name, f"{name}-password") for name in PEOPLE}}


def page(url: str, name: str = "cy") -> Client:
    return Client(url, auth=(name, f"{name}-password"), verbose=False)


def api(url: str, keys: dict, name: str = "cy") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "v1", api_key=keys[name], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def front(cluster, smollm2_dir, tmp_path_factory, keys):
    """The page and /v1 over two replicas of the tiny model (seed 0), the bank in milvus-lite, people logging in."""
    cfg = config(tmp_path_factory.mktemp("front"), f"app.users_file={keys['path']}")
    loader = functools.partial(make_tiny_llama, str(smollm2_dir))  # seed 0: the weights of `tiny_llama`
    service = RemoteService(cfg, loader=loader)
    demo = build_demo(service)
    app.launch(demo, service, server_port=None, prevent_thread_lock=True, quiet=True)
    yield service, f"http://127.0.0.1:{demo.server_port}/"
    demo.close()
    service.close()


@pytest.fixture(scope="module")
def local(tiny_llama, tmp_path_factory):
    """The same model in process: the answers to match."""
    svc = Service(config(tmp_path_factory.mktemp("local"), "serve.replicas=1", "memory.store=faiss"), tiny_llama)
    yield svc
    svc.close()


@contextlib.contextmanager
def replica_threads():
    """Torch threads as a replica has them (serve.replica_cpus=1): another thread count sums in another
    order, and a random tiny model's logits are near ties that rounding can flip."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def local_answers(svc: Service, turns: list[str]) -> list[dict]:
    s = svc.new_session()
    with replica_threads():
        for text in turns:
            result(svc.chat(s, text, [], svc.cfg.generation, OFF).request)
    messages = chat_messages(svc.state(s).messages)
    svc.end_session(s)
    return messages


def text_of(message: dict) -> str:
    """A message's text as the page shows it (the chat window drops whitespace at the ends)."""
    content = message["content"]
    return (content if isinstance(content, str) else "".join(
        p if isinstance(p, str) else p.get("text", "") for p in content)).strip()


def page_chat(client: Client, text: str) -> list:
    return client.submit(message={"text": text, "files": []}, seed=None, recall_enabled=False,
                         api_name="/chat").result()[0]


def test_sessions_get_the_in_process_answers_and_stay_on_one_replica(front, local, keys):
    service, url = front
    before = service.health()["replicas"]  # listed before any session reached them
    assert len(before) == 2 and all(r["alive"] and r["sessions"] == 0 for r in before)
    clients = [page(url) for _ in QUESTIONS]
    jobs = [c.submit(message={"text": q, "files": []}, seed=None, recall_enabled=False, api_name="/chat")
            for c, q in zip(clients, QUESTIONS)]  # four sessions at once
    outputs = [job.result() for job in jobs]
    firsts = [out[0] for out in outputs]
    assert all("2 replicas" in out[3] for out in outputs)  # the status line
    seconds = [page_chat(c, "And then?") for c in clients]
    for q, first, second in zip(QUESTIONS, firsts, seconds):
        want = [text_of(m) for m in local_answers(local, [q, "And then?"])]
        assert text_of(first[-1]) == want[1]
        assert [text_of(m) for m in second] == want
    page_sessions = [v for v in service.served_by.values() if len(v) >= 2]
    assert len(page_sessions) == 4 and all(len(set(v)) == 1 for v in page_sessions)

    client = api(url, keys)
    want = local_answers(local, ["Hello there", "And then?"])
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": want[1]["content"]},
               {"role": "user", "content": "And then?"}]
    whole = client.chat.completions.create(model="recall-chat", messages=history, max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="recall-chat", messages=history, max_tokens=8, temperature=0, stream=True) if c.choices)
    # the API's history is text: the in-process server given the same messages
    s = local.new_session()
    local.add_history(s, [("user", "Hello there", []), ("assistant", want[1]["content"], [])], "And then?",
                      local.cfg.generation)
    with replica_threads():
        result(local.chat(s, "And then?", [], local.cfg.generation, OFF).request)
    assert whole.choices[0].message.content == streamed == s.conv.messages[-1].text


def test_each_user_reads_and_writes_only_their_own_memory_on_the_replicas(front, keys):
    """/v1 with each person's key: the replicas list, recall and delete that person's memories alone (they shared one
    memory, the local user's: bob listed ada's, was answered from them, and deleted them)."""
    _, url = front

    def call(method: str, name: str, path: str = "", **kw) -> httpx.Response:
        return httpx.request(method, url + "v1/memories" + path, headers={"Authorization": f"Bearer {keys[name]}"},
                             timeout=120, **kw)

    def mine(name: str) -> list[str]:
        return [m["text"] for m in call("GET", name).json()["data"]]

    for name in ("ada", "bob"):
        call("DELETE", name)
    told = {"ada": "The user's sister is called Lena.", "bob": "The user's dog is called Rex."}
    ids = {}
    for name, text in told.items():
        added = call("POST", name, json={"text": text})
        assert added.status_code == 201, added.text
        ids[name] = added.json()["id"]
    for _ in range(3):  # each call a new session, routed by its id to either replica
        assert mine("ada") == [told["ada"]] and mine("bob") == [told["bob"]]

    # the shared bank is empty here (the next test writes to it): what an answer recalls is the asker's own memory
    question = {"role": "user", "content": "What is my sister's name?"}
    for name in ("ada", "bob"):
        answer = api(url, keys, name).chat.completions.create(
            model="recall-chat", messages=[question], max_tokens=4, temperature=0, extra_body={"recall_first": True})
        assert [(r["text"], r["source"]) for r in answer.model_extra["recalls"]] == [(told[name], "yours")], name
    told_in_chat = api(url, keys, "bob").chat.completions.create(
        model="recall-chat", max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": "Remember that my cat is called Tom."}])
    assert [m["text"] for m in told_in_chat.model_extra["remembered"]] == ["The user's cat is called Tom."]
    bobs = mine("bob")  # (the tiny model's encoder may read Tom's memory as a newer value of Rex's: superseded)
    assert mine("ada") == [told["ada"]] and "The user's cat is called Tom." in bobs

    gone = call("DELETE", "bob", f"/{ids['ada']}")
    assert gone.status_code == 404 and "no such memory of yours" in gone.text
    assert call("DELETE", "ada").json()["deleted"] == 1
    assert mine("ada") == [] and mine("bob") == bobs


def sessions_on_two_replicas(service: RemoteService):
    """Two sessions that Ray Serve routes to different replicas (a bank call tells where each one went)."""
    first = service.new_session()
    service.run(ops.use_bank, first, "shared")
    while True:
        other = service.new_session()
        service.run(ops.use_bank, other, "shared")
        if service.served_by[other.id][-1] != service.served_by[first.id][-1]:
            return first, other


def test_a_memory_written_through_one_replica_is_recalled_through_the_other(front, keys):
    service, url = front
    writer, reader = sessions_on_two_replicas(service)
    (i,) = result(service.run(ops.write_memories, writer, "The ferry to Lune Island leaves at seven."))
    turn = service.chat(reader, "When does the ferry leave?", [], GREEDY, RecallSettings(top_k=1), recall_first=True)
    recalls = [e for e in drain(turn.request) if isinstance(e, RecallEvent)]
    assert recalls and recalls[0].memory_index == i and recalls[0].text.startswith("The ferry")
    assert service.served_by[reader.id][-1] != service.served_by[writer.id][-1]
    assert recall_table(service.state(reader).messages)["memory"].tolist() == [i]
    health = httpx.get(url + "health", timeout=60).json()
    assert health["bank"]["store"] == "milvus" and health["bank"]["size"] >= 1
    assert health["wanted"] == 2 and sum(r["alive"] for r in health["replicas"]) == 2
    answer = api(url, keys).chat.completions.create(model="recall-chat", max_tokens=4,
                                                    messages=[{"role": "user", "content": "The ferry?"}],
                                                    extra_body={"recall_first": True})
    assert answer.model_extra["recalls"][0]["memory_index"] == i


def test_about_you_on_the_replicas_remembers_edits_imports_and_undoes(front, keys, tmp_path):
    """The page's "About you" with replicas: its answers came back as a Gradio error (a sync replica call on the
    event loop) although the change was made; and they are the logged-in person's memories."""
    _, url = front
    ada, bob = page(url, "ada"), page(url, "bob")
    for person in (ada, bob):
        person.predict("", api_name="/forget_all_memories")
    count, table, status = ada.predict("My cat is called Whiskers.", "", api_name="/remember")
    assert "(ada)**: 1 memory," in count and "⚠" not in status, (count, status)
    ((memory_id, _, text),) = table["data"]
    assert text == "The user's cat is called Whiskers."

    count, table, status = ada.predict(memory_id, "My cat is called Felix.", "", api_name="/edit_memory")
    assert [row[2] for row in table["data"]] == ["The user's cat is called Felix."] and "⚠" not in status, status
    count, table, status, *_ = ada.predict("", api_name="/undo_memory_change")
    assert "Undone" in status and [row[2] for row in table["data"]] == [text], (status, table)

    texts = tmp_path / "texts.json"
    texts.write_text('["My sister is called Lena."]')
    count, table, status = ada.predict(handle_file(str(texts)), "", api_name="/import_memories")
    shown = sorted(row[2] for row in table["data"])
    assert "imported 1 new" in status and "The user's sister is called Lena." in shown, (count, status)
    assert f"(ada)**: {len(shown)} memories" in count

    count, table, _ = bob.predict("", api_name="/my_memories")
    assert "(bob)**: 0 memories" in count and not table["data"], (count, table)
    listed = httpx.get(url + "v1/memories", headers={"Authorization": f"Bearer {keys['ada']}"}, timeout=120).json()
    assert sorted(m["text"] for m in listed["data"]) == shown  # the page's memories are ada's, as /v1 has them


def test_a_stop_reaches_the_replica(front):
    service, _ = front
    s = service.new_session()
    turn = service.chat(s, "Write about the sea.", [], GenerationSettings(max_new_tokens=400, min_new_tokens=400), OFF)
    view = TurnView()
    while view.tokens < 3:
        view.apply(turn.request.events.get(timeout=120))
    stopped = service.stop(s)
    assert stopped == [turn.request]
    events = drain(turn.request)
    assert [e.reason for e in events if isinstance(e, FinishEvent)] == ["interrupted"]
    assert turn.request.reason == "interrupted" and turn.request.steps < 400
    assert chat_messages(service.state(s).messages)[-1]["content"].endswith("_(stopped)_")  # the stopped answer is kept


def test_a_killed_replica_costs_nothing_the_user_saw(front, local):
    service, _ = front
    s = service.new_session()
    result(service.chat(s, "Tell me about bread.", [], service.cfg.generation, OFF).request)
    victim = service.served_by[s.id][-1]
    actor = ray.get_actor(victim, namespace="serve")
    ray.kill(actor, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):  # (the kill is asynchronous: in CI the replica once took the
        for _ in range(600):  # next message and wrote tokens, then died: "send it again", as for any answer cut)
            ray.get(actor.__ray_ready__.remote(), timeout=10)
            time.sleep(0.1)
    turn = service.chat(s, "And then?", [], service.cfg.generation, OFF)
    events = drain(turn.request, timeout=300)
    assert turn.request.error is None
    assert any(isinstance(e, Notice) and "rebuilt" in e.text for e in events)
    assert service.served_by[s.id][-1] != victim
    assert chat_messages(service.state(s).messages) == local_answers(local, ["Tell me about bread.", "And then?"])


def test_a_replica_that_cannot_load_its_model_says_which_and_why(cluster, tmp_path):
    # no CPU reserved: the two replicas of `front` hold the test cluster's two
    cfg = config(tmp_path, "serve.replicas=1", "serve.replica_cpus=0", "memory.store=faiss")
    with pytest.raises(ServeError, match=r"could not load its model.*no weights in /nowhere"):
        start_replicas(cfg, broken_model, name="recall-chat-broken")


def test_an_unreachable_store_stops_the_start_naming_it(tmp_path):
    with pytest.raises(StoreError, match=r"memory.milvus_uri='http://127.0.0.1:9'.*unreachable"):
        RemoteService(config(tmp_path, "memory.milvus_uri=http://127.0.0.1:9"))


def test_a_replica_that_dies_mid_answer_is_said_in_one_line(front, monkeypatch):
    """(The page showed all of Ray's report: pid, node address, actor id, advice on memory.) The answer fails with
    one line, "send it again"; the rest is in the log."""
    service, _ = front
    report = ("The actor died unexpectedly before finishing this task.\n\tclass_name: ServeReplica:recall-chat\n"
              "\tactor_id: 3f2a\n\tpid: 4242\n\tip: 10.0.0.7\nThe actor is dead because its worker process has died.")

    class Dying:  # the session's replica: a token, then its process is gone
        def options(self, **_):
            return self

        @property
        def call(self):
            return self

        def remote(self, *_):
            yield TokenEvent(row=0, token_id=1, position=5, text="Bread")
            raise ray.exceptions.RayActorError(error_msg=report)

    s = service.new_session()
    monkeypatch.setattr(service, "handle", Dying())
    turn = service.chat(s, "Tell me about bread.", [], service.cfg.generation, OFF)
    drain(turn.request, timeout=60)
    assert turn.request.error == ("the model replica writing this answer stopped; the conversation is as it was "
                                  "before this message: send it again (The actor died unexpectedly before finishing "
                                  "this task.)")


def test_a_refused_memory_is_the_callers_400_on_the_replicas_too(front, keys):
    """(A review found a text the replica refused, "What is my name?", answered 500 server_error: the replica sent
    its refusal as a failure of the server's.)"""
    _, url = front
    sent = httpx.post(url + "v1/memories", json={"text": "What is my name?"},
                      headers={"Authorization": f"Bearer {keys['ada']}"}, timeout=120)
    assert sent.status_code == 400 and "got a question" in sent.json()["error"]["message"]

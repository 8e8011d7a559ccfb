"""Two model replicas of a tiny model on a real local Ray Serve (num_cpus=2), the shared bank in real
milvus-lite: answers equal the in-process ones, sessions stick, stop, recall, a killed replica, errors."""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import httpx
import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("pymilvus")
openai = pytest.importorskip("openai")

from gradio_client import Client  # noqa: E402

import app  # noqa: E402
from chat import operations as ops  # noqa: E402
from chat.config import load_config  # noqa: E402
from chat.service import Service  # noqa: E402
from chat.view import TurnView, chat_messages, recall_table  # noqa: E402
from chat.worker import Notice  # noqa: E402
from memory.milvus import StoreError  # noqa: E402
from conftest import make_tiny_llama  # noqa: E402
from decoding.events import FinishEvent, RecallEvent  # noqa: E402
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
def front(cluster, smollm2_dir, tmp_path_factory):
    """The page and /v1 over two replicas of the tiny model (seed 0), the bank in milvus-lite."""
    cfg = config(tmp_path_factory.mktemp("front"))
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


def test_sessions_get_the_in_process_answers_and_stay_on_one_replica(front, local):
    service, url = front
    before = service.health()["replicas"]  # listed before any session reached them
    assert len(before) == 2 and all(r["alive"] and r["sessions"] == 0 for r in before)
    clients = [Client(url, verbose=False) for _ in QUESTIONS]
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

    api = openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0, timeout=120)
    want = local_answers(local, ["Hello there", "And then?"])
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": want[1]["content"]},
               {"role": "user", "content": "And then?"}]
    whole = api.chat.completions.create(model="recall-chat", messages=history, max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model="recall-chat", messages=history, max_tokens=8, temperature=0, stream=True) if c.choices)
    # the API's history is text: the in-process server given the same messages
    s = local.new_session()
    local.add_history(s, "user", "Hello there")
    local.add_history(s, "assistant", want[1]["content"])
    with replica_threads():
        result(local.chat(s, "And then?", [], local.cfg.generation, OFF).request)
    assert whole.choices[0].message.content == streamed == s.conv.messages[-1].text


def sessions_on_two_replicas(service: RemoteService):
    """Two sessions that Ray Serve routes to different replicas (a bank call tells where each one went)."""
    first = service.new_session()
    service.run(ops.use_bank, first, "shared")
    while True:
        other = service.new_session()
        service.run(ops.use_bank, other, "shared")
        if service.served_by[other.id][-1] != service.served_by[first.id][-1]:
            return first, other


def test_a_memory_written_through_one_replica_is_recalled_through_the_other(front):
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
    api = openai.OpenAI(base_url=url + "v1", api_key="unused", max_retries=0, timeout=120)
    answer = api.chat.completions.create(model="recall-chat", messages=[{"role": "user", "content": "The ferry?"}],
                                         max_tokens=4, extra_body={"recall_first": True})
    assert answer.model_extra["recalls"][0]["memory_index"] == i


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
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
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

"""The shared bank in a real Milvus (milvus-lite served over http, as the replicas reach it): written through
the app, kept across a restart of the app, and a store that goes away fails that recall by name while the
session and the other sessions go on."""

from __future__ import annotations

import pytest
from milvus_lite.server_manager import server_manager_instance

from chat.config import load_config
from chat.service import Service
from chat.view import bank_summary, status_line
from decoding.events import RecallEvent
from decoding.settings import GenerationSettings, RecallSettings
from memory.milvus import StoreError
from tests_helpers import drain, result

SHORT = GenerationSettings(max_new_tokens=4)


def test_the_shared_bank_in_milvus_survives_a_restart_and_a_lost_store_is_named(tiny_llama, tmp_path):
    path = str(tmp_path / "bank.db")
    uri = server_manager_instance.start_and_get_uri(path)
    cfg = load_config(overrides=["model.compile=false", "memory.store=milvus", f"memory.milvus_uri={uri}"],
                      environ={})
    svc = Service(cfg, tiny_llama)
    try:
        (i,) = result(svc.banks.write(svc.new_session(), "The ferry to Lune Island leaves at seven."))
    finally:
        svc.close()

    svc = Service(cfg, tiny_llama)  # the app again: the collection still holds the memory
    try:
        s, other = svc.new_session(), svc.new_session()
        turn = svc.chat(s, "When does the ferry leave?", [], SHORT, RecallSettings(top_k=1), recall_first=True)
        recalls = [e for e in drain(turn.request) if isinstance(e, RecallEvent)]
        assert [r.memory_index for r in recalls] == [i] and recalls[0].text.startswith("The ferry")
        assert svc.health()["bank"] == {"store": "milvus", "size": 1}

        server_manager_instance.release_server(path)  # the store goes away
        turn = svc.chat(s, "And when does it come back?", [], SHORT, RecallSettings(top_k=1), recall_first=True)
        drain(turn.request)
        assert turn.request.error is not None
        assert turn.request.error.startswith(f"the memory store at memory.milvus_uri={uri!r} failed")
        assert "unreachable" in str(svc.health()["bank"]["size"])
        assert "bank: unreachable (shared)" in status_line(svc.state(s))  # the page goes on rendering
        assert f"memory.milvus_uri={uri!r}" in bank_summary(svc.state(s, details=True).bank)
        # the session and the others go on (without recall)
        result(svc.chat(s, "Hello", [], SHORT, RecallSettings(enabled=False)).request)
        result(svc.chat(other, "Hello", [], SHORT, RecallSettings(enabled=False)).request)
    finally:
        svc.close()


def test_a_store_that_is_not_there_stops_the_start_naming_it(tiny_llama):
    cfg = load_config(overrides=["memory.store=milvus", "memory.milvus_uri=http://127.0.0.1:9"], environ={})
    with pytest.raises(StoreError, match=r"memory.milvus_uri='http://127.0.0.1:9' is unreachable"):
        Service(cfg, tiny_llama)

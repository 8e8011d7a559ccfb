"""The bank in Milvus (real milvus-lite): same search as FAISS, values whole, persistent, errors named."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
import torch

from memory import BankCheck, BankError, MemoryVectorDB
from memory.milvus import MilvusBank, StoreError, StoreLayout, load_into


@pytest.fixture
def uri(tmp_path):
    return str(tmp_path / "bank.db")


def test_topk_matches_faiss_exact_search_over_10k(uri):
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((10_000, 384)).astype(np.float32)
    store = MilvusBank.open(uri, "m", create=StoreLayout(384))
    ids = store.add(keys, [f"fact {i}" for i in range(len(keys))])
    assert len(store) == 10_000
    unit = keys / np.linalg.norm(keys, axis=1, keepdims=True)
    flat = faiss.IndexFlatIP(384)
    flat.add(unit)
    queries = rng.standard_normal((5, 384)).astype(np.float32)
    want_scores, want_rows = flat.search(queries / np.linalg.norm(queries, axis=1, keepdims=True), 10)
    for q, ws, wr in zip(queries, want_scores, want_rows):
        scores, got = store.topk(torch.from_numpy(q), 10)
        assert got.tolist() == [ids[r] for r in wr]
        np.testing.assert_allclose(scores.numpy(), ws, atol=1e-5)
    assert store.text(ids[7]) == "fact 7"


def test_values_read_back_as_the_file_bank_holds_them(uri):
    rng = np.random.default_rng(1)
    keys = torch.from_numpy(rng.standard_normal((4, 16)).astype(np.float32))
    values = [torch.from_numpy(rng.standard_normal((k, 8)).astype(np.float32)) for k in (1, 3, 2, 5)]
    db = MemoryVectorDB(16, value_dim=8, value_dtype="float16")
    db.add(keys, ["a", "b", "c", "d"], [None, {"tag": 1}, None, None], values)
    db.info = {"encoder": "enc-1", "values": "tokens"}
    store = load_into(db, uri, "kv")
    assert store.has_values and store.value_dim == 8 and store.dim == 16 and len(store) == 4
    ids = [e["index"] for e in store.entries(0, 10)]
    assert [e["slots"] for e in store.entries(0, 10)] == [1, 3, 2, 5]
    for row, i in enumerate(ids):
        assert torch.equal(store.values(i), db.values(row))  # float16 numbers, exactly
    scores, got = store.topk(keys[2], 1)
    memory = store.memory(int(got[0]), float(scores[0]))
    assert memory.text == "c" and memory.slots == 2 and store.metadata(ids[1]) == {"tag": 1}
    assert store.remove([ids[0], ids[3]]) == 2
    with pytest.raises(KeyError, match="not in the bank"):
        store.remove([ids[0]])
    back = store.to_bank()
    assert back.info == {"encoder": "enc-1", "values": "tokens"} and len(back) == 2
    assert torch.equal(back.values(1), db.values(2))


def test_token_values_live_in_the_memorys_own_row(uri):
    rng = np.random.default_rng(2)
    keys = torch.from_numpy(rng.standard_normal((3, 16)).astype(np.float32))
    db = MemoryVectorDB(16, token_values=True)
    db.add(keys, ["a", "b", "c"], values=[torch.tensor([5, 6]), torch.tensor([7, 8, 9, 10]), torch.tensor([11])])
    db.info = {"encoder": "enc-1", "values": "tokens"}
    store = load_into(db, uri, "tok")
    assert store.token_values and store.has_values and store.value_dim is None
    assert not store._client.has_collection("tok_values")  # one row a memory: no second collection
    ids = [e["index"] for e in store.entries(0, 10)]
    for row, i in enumerate(ids):
        assert torch.equal(store.values(i), db.values(row))
    assert store.bytes_per_memory() == pytest.approx(4 * 16 + 8 * 7 / 3)
    reopened = MilvusBank.open(uri, "tok", check=BankCheck(dim=576, key_dim=16, encoder="enc-1"))
    assert reopened.token_values and torch.equal(reopened.memory(ids[1], 0.9).values, torch.tensor([7, 8, 9, 10]))
    assert reopened.remove([ids[0]]) == 2
    back = reopened.to_bank()
    assert back.token_values and torch.equal(back.values(1), torch.tensor([11]))
    with pytest.raises(BankError, match=r"as token ids \[k\]"):
        reopened.add(keys[:1], values=[torch.ones(2, 8)])


def test_a_memory_written_by_one_client_is_found_by_another_and_survives_a_restart(uri):
    from milvus_lite.server_manager import server_manager_instance

    first = MilvusBank.open(uri, "shared", create=StoreLayout(8))
    shared_uri = server_manager_instance.start_and_get_uri(uri)  # what a second process connects to
    second = MilvusBank.open(shared_uri, "shared")
    (i,) = first.add(torch.eye(8)[3:4], ["written by the first"])
    scores, ids = second.topk(torch.eye(8)[3], 1)
    assert ids.tolist() == [i] and second.text(i) == "written by the first"
    first.close()
    second.close()
    server_manager_instance.release_server(uri)  # the app stops
    again = MilvusBank.open(uri, "shared")
    assert len(again) == 1 and again.text(i) == "written by the first"


def test_missing_and_unreachable_stores_are_named(uri):
    with pytest.raises(StoreError, match="expected a collection, found none"):
        MilvusBank.open(uri, "nothing-here")
    with pytest.raises(StoreError, match=r"memory.milvus_uri='http://127.0.0.1:9'.*unreachable"):
        MilvusBank.open("http://127.0.0.1:9", "m")


def test_a_store_that_goes_away_later_fails_the_call_with_a_named_error(uri):
    from milvus_lite.server_manager import server_manager_instance

    MilvusBank.open(uri, "m", create=StoreLayout(8)).add(torch.eye(8), None)
    remote = MilvusBank.open(server_manager_instance.start_and_get_uri(uri), "m")
    server_manager_instance.release_server(uri)
    with pytest.raises(StoreError, match="memory.milvus_uri='http://127.0.0.1:.*failed to search"):
        remote.topk(torch.eye(8)[0], 1)


def test_checks_as_for_files(uri):
    store = MilvusBank.open(uri, "m", create=StoreLayout(8, value_dim=4, info={"encoder": "enc-1"}))
    with pytest.raises(BankError, match="expected values for every memory"):
        store.add(torch.randn(2, 8))
    with pytest.raises(BankError, match="dimension 8"):
        store.add(torch.randn(2, 5), values=[torch.randn(1, 4)] * 2)
    with pytest.raises(BankError, match="written by 'enc-1'"):
        MilvusBank.open(uri, "m", check=BankCheck(encoder="enc-2"))
    with pytest.raises(BankError, match="dimension 6"):
        MilvusBank.open(uri, "m", check=BankCheck(dim=6))
    with pytest.raises(StoreError, match="already has a collection"):
        load_into(MemoryVectorDB(8), uri, "m")


def test_the_cli_loads_a_file_into_a_collection_and_exports_it(tmp_path, uri, capsys):
    from chat.bankcli import main

    db = MemoryVectorDB(8, value_dim=4, value_dtype="float16")
    db.add(torch.randn(3, 8), ["a", "b", "c"], values=[torch.randn(2, 4), torch.randn(1, 4), torch.randn(3, 4)])
    db.info = {"encoder": "enc-1"}
    db.save(tmp_path / "in.pt")
    assert main(["load", str(tmp_path / "in.pt"), uri, "--collection", "kv"]) == 0
    assert "loaded 3 memories" in capsys.readouterr().out
    assert main(["load", str(tmp_path / "in.pt"), uri, "--collection", "kv"]) == 2
    assert "already has a collection" in capsys.readouterr().err
    assert main(["export", uri, str(tmp_path / "out.pt"), "--collection", "kv"]) == 0
    back = MemoryVectorDB.load(tmp_path / "out.pt")
    assert back.info == {"encoder": "enc-1"} and [back.text(i) for i in range(3)] == ["a", "b", "c"]
    assert all(torch.equal(back.values(i), db.values(i)) for i in range(3))
    assert main(["export", "http://127.0.0.1:9", str(tmp_path / "x.pt")]) == 2
    assert "unreachable" in capsys.readouterr().err


def test_a_store_another_process_holds_is_named_with_its_cause_and_no_traceback(uri, capfd):
    """(`recall-memory export` while the app held the Milvus Lite file printed Milvus Lite's traceback, then "is
    unreachable: Open local milvus failed".) The cause is the message, once."""
    import subprocess
    import sys

    MilvusBank.open(uri, "m", create=StoreLayout(8)).add(torch.eye(8), None)
    from milvus_lite.server_manager import server_manager_instance

    server_manager_instance.release_server(uri)  # (this process lets the file go; another takes it)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from pymilvus import MilvusClient; "
                               f"c = MilvusClient({uri!r}); print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        capfd.readouterr()
        with pytest.raises(StoreError, match=r"is unreachable: another process holds the lock on '.*bank.db'"):
            MilvusBank.open(uri, "m")
        assert "Traceback" not in capfd.readouterr().err
    finally:
        holder.communicate("", timeout=60)
    assert len(MilvusBank.open(uri, "m")) == 8  # (free again: the filter is gone, and nothing was lost)


def test_a_load_is_all_or_nothing_and_the_next_one_takes_its_place(tmp_path, uri, monkeypatch):
    """(A `recall-memory load` killed part way left a collection of its first pages that exported as a whole bank,
    and refused the next load: "already has a collection".)"""
    db = MemoryVectorDB(8, value_dim=4, value_dtype="float16")
    db.add(torch.randn(5, 8), list("abcde"), values=[torch.randn(2, 4) for _ in range(5)])
    monkeypatch.setattr("memory.milvus._PAGE", 2)
    added = MilvusBank.add

    def dies_on_the_second_page(self, *args, **kwargs):
        if self._calls_made:
            raise KeyboardInterrupt  # (a kill, part way)
        self._calls_made = True
        return added(self, *args, **kwargs)
    monkeypatch.setattr(MilvusBank, "_calls_made", False, raising=False)
    monkeypatch.setattr(MilvusBank, "add", dies_on_the_second_page)
    with pytest.raises(KeyboardInterrupt):
        load_into(db, uri, "kv")
    client = MilvusBank.connect(uri)
    assert not client.has_collection("kv") and not client.has_collection("kv_values")
    client.close()
    monkeypatch.setattr(MilvusBank, "add", added)
    store = load_into(db, uri, "kv")  # (what the killed load left is dropped)
    assert len(store) == 5 and sorted(store.text(e["index"]) for e in store.entries(0, 10)) == list("abcde")
    assert sorted(MilvusBank.connect(uri).list_collections()) == ["kv", "kv_values"]


def test_an_export_of_nothing_never_writes_over_a_bank(tmp_path, uri, capsys):
    """(An empty collection was saved over the bank file there, then "error: min() arg is an empty sequence"; a
    mistyped path made an empty milvus-lite file.)"""
    from chat.bankcli import main

    good = MemoryVectorDB(8)
    good.add(torch.randn(2, 8), ["a", "b"])
    good.save(tmp_path / "good.pt")
    before = (tmp_path / "good.pt").read_bytes()
    MilvusBank.open(uri, "empty", create=StoreLayout(8)).close()
    assert main(["export", uri, str(tmp_path / "good.pt"), "--collection", "empty"]) == 2
    assert "holds no memories: nothing to export" in capsys.readouterr().err
    assert (tmp_path / "good.pt").read_bytes() == before
    assert main(["export", str(tmp_path / "typo.db"), str(tmp_path / "x.pt")]) == 2
    assert "expected a milvus-lite file or http://host:19530, got nothing there" in capsys.readouterr().err
    assert not (tmp_path / "typo.db").exists() and not (tmp_path / "x.pt").exists()


def test_a_collection_name_the_app_would_refuse_is_refused_by_the_cli(tmp_path, uri, capsys):
    from chat.bankcli import main

    db = MemoryVectorDB(8)
    db.add(torch.randn(2, 8), ["a", "b"])
    db.save(tmp_path / "in.pt")
    with pytest.raises(SystemExit):
        main(["load", str(tmp_path / "in.pt"), uri, "--collection", "bad name"])
    assert "as memory.milvus_collection takes, got 'bad name'" in capsys.readouterr().err


def test_a_load_never_drops_a_bank_named_like_its_values(uri):
    """(A review found a load of "team" dropped a collection "team_values" as a leftover: it may be a bank.)"""
    db = MemoryVectorDB(8)
    db.add(torch.randn(2, 8), ["a", "b"])
    load_into(db, uri, "team_values")
    with pytest.raises(StoreError, match="a collection team_values is there already"):
        load_into(db, uri, "team")
    assert len(MilvusBank.open(uri, "team_values")) == 2

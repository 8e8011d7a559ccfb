"""Every person's memories in one Milvus collection (real milvus-lite): each search is filtered by user inside
Milvus, never after it; history is kept and never recalled; values are whole; names cannot inject a filter.
(The rules every personal store shares are tested on both stores in test_personal.py.)"""

from __future__ import annotations

import pytest
import torch

from memory.milvus import MilvusBank, StoreError, StoreLayout
from memory.personal import Similar
from memory.personal_milvus import MilvusPersonal, open_people, user_filter

DIM = 16
KEEP_ALL = Similar(duplicate=1.0, supersede=0.9999)  # near copies are all kept


def key(*weights: float) -> torch.Tensor:
    v = torch.zeros(1, DIM)
    v[0, :len(weights)] = torch.tensor(weights)
    return v


class Recording:
    """A Milvus client that notes every call it passes on: (method, collection, its filter)."""

    def __init__(self, client):
        self._client, self.calls = client, []

    def __getattr__(self, name):
        fn = getattr(self._client, name)
        if name not in ("search", "query", "get", "delete", "upsert", "insert"):
            return fn

        def call(collection, *args, **kwargs):
            self.calls.append((name, collection, kwargs.get("filter")))
            return fn(collection, *args, **kwargs)
        return call


@pytest.fixture
def client(tmp_path):
    client = Recording(MilvusBank.connect(str(tmp_path / "people.db")))
    yield client
    client.close()


def people(client, layout=StoreLayout(DIM)):
    return open_people("people.db", "people", layout, client=client)


def test_a_search_never_finds_another_users_memory_however_close(client):
    store = people(client)
    ada, bob = MilvusPersonal(store, "ada"), MilvusPersonal(store, "bob")
    bob.add(key(1, 0, 0), None, "The user's dog is called Rex.")  # exactly the question's key
    for i in range(3, 15):  # and many more that fit far better than ada's (cosine 0.999)
        bob.add(key(1, *[0.05 * (j == i) for j in range(1, DIM)]), None, f"The user's pet {i} is a dog.",
                similar=KEEP_ALL)
    mine, _ = ada.add(key(0.2, 1, 0), None, "The user's cat is called Mia.")
    client.calls.clear()

    scores, ids = ada.bank.topk(key(1, 0, 0), 1)  # k=1: the best match over the collection is bob's
    assert ids.tolist() == [ada.entries()[0]["index"]] and float(scores[0]) < 0.5
    assert ada.bank.memory(int(ids[0]), float(scores[0])).text == "The user's cat is called Mia."
    assert [e["id"] for e in ada.entries()] == [mine["id"]] and len(ada) == 1
    searches = [c for c in client.calls if c[0] == "search"]
    assert searches == [("search", "people", '(user == "ada" and live == true)')]  # the filter goes to Milvus
    reads = [c for c in client.calls if c[1] == "people" and c[0] != "search"]
    assert reads and all('user == "ada"' in c[2] for c in reads)  # every read of ada's is filtered too
    assert len(bob) == 13

    # bob's ids are not ada's to read, delete or change, through her memory or her view of the bank
    bobs = bob.entries()[0]
    with pytest.raises(KeyError):
        ada.remove([bobs["id"]])
    with pytest.raises(KeyError, match="not in the bank"):
        ada.bank.remove([bobs["index"]])
    with pytest.raises(KeyError):
        ada.bank.memory(bobs["index"], 1.0)
    assert ada.clear() == 1 and len(bob) == 13


def test_history_is_kept_and_never_recalled(client):
    mine = MilvusPersonal(people(client), "ada")
    old, _ = mine.add(key(1, 0, 0), None, "The user's dog is called Rex.", source="chat")
    new, gone = mine.add(key(1, 0.5, 0), None, "The user's dog is called Pocket.")
    assert [g["id"] for g in gone] == [old["id"]]
    scores, ids = mine.bank.topk(key(1, 0, 0), None)  # all of hers: the superseded one is not among them
    assert [mine.bank.text(int(i)) for i in ids] == ["The user's dog is called Pocket."]
    (past,) = mine.history
    assert past["text"] == "The user's dog is called Rex." and past["source"] == "chat"
    assert past["superseded_by"] == new["id"] and past["id"] == old["id"]
    assert mine.clear() == 1 and mine.history == [] and len(client.query("people", filter="id >= 0")) == 0


def test_values_are_whole_in_a_persons_view(client):
    layout = StoreLayout(DIM, value_dim=8)
    mine = MilvusPersonal(people(client, layout), "ada")
    values = torch.randn(3, 8)
    mine.add(key(1), values, "The user lives in Porto.")
    scores, ids = mine.bank.topk(key(1), 1)
    memory = mine.bank.memory(int(ids[0]), float(scores[0]))
    assert memory.slots == 3 and torch.allclose(memory.values, values)
    assert mine.clear() == 1 and client.query("people_values", filter="id >= 0", output_fields=["id"]) == []


@pytest.mark.parametrize("name", ['bob" or user != "', "ada\\", "", "a" * 65, "a b"])
def test_a_name_that_a_filter_could_read_as_syntax_is_refused(name):
    with pytest.raises(ValueError, match="user: expected a name"):
        user_filter(name)


def test_a_bank_that_is_not_a_collection_of_people_is_refused(client):
    MilvusBank.open("people.db", "people", create=StoreLayout(DIM), client=client)
    with pytest.raises(StoreError, match="expected a collection of people's memories"):
        people(client)


def test_one_users_writes_from_two_replicas_at_once_all_succeed(client):
    """Two replicas are two processes, each with its own lock: one user's newer values written through both at once
    (8 at a time) all succeed. (A write failed when the other had retired, between its search and its update, the
    older value it was retiring, "memory ids [224] are not in the bank", or had retired a memory its search found
    before the read of its text, a bare KeyError; the API said 400 and the memory was written all the same.) Both
    may stay recalled until the next change (Milvus has no transactions); the newest is the one read."""
    import threading

    store = people(client)
    replicas = [MilvusPersonal(store, "bob") for _ in range(2)]  # (each its own lock, as in two processes)
    replicas[0].add(key(1), None, "The user's desk number is 9000.")
    failures, start = [], threading.Barrier(8)

    def write(i: int) -> None:
        start.wait()
        try:
            replicas[i % 2].add(key(1), None, f"The user's desk number is {9001 + i}.")
        except Exception as e:  # noqa: BLE001 - what the test counts
            failures.append(repr(e))

    for _ in range(3):
        threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    assert failures == []
    newest = replicas[0].add(key(1), None, "The user's desk number is 7777.")[0]  # the next change settles it
    assert [e["text"] for e in replicas[1].entries()] == ["The user's desk number is 7777."]
    assert newest["text"] == "The user's desk number is 7777."

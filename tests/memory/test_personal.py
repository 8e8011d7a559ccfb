"""A person's memories in their own file, or in a Milvus collection of everyone's (the same rules: duplicates,
supersede and history, deletes by id, restarts); a file under `kill -9`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memory import MemoryVectorDB
from memory.milvus import MilvusBank, StoreLayout
from memory.personal import Joined, Newest, PersonalMemory, Similar, Undone, newer_value, twin
from memory.personal_milvus import MilvusPersonal, open_people

ROOT = Path(__file__).resolve().parents[2]
DIM = 16


def key(*weights: float) -> torch.Tensor:
    """A key [1, DIM] mixing the first basis vectors with `weights` (cosines are easy to set)."""
    v = torch.zeros(1, DIM)
    v[0, :len(weights)] = torch.tensor(weights)
    return v


def empty() -> MemoryVectorDB:
    return MemoryVectorDB(DIM)


@pytest.fixture(params=["file", "milvus"])
def stores(request, tmp_path):
    """`open(user)`: a person's memory in the store; `open(user, restart=True)`: the same after a restart (a new
    client of the same Milvus file)."""
    if request.param == "file":
        yield lambda user, restart=False: PersonalMemory(tmp_path / f"{user}.safetensors")
        return
    uri, clients = str(tmp_path / "people.db"), []

    def open_(user: str, restart: bool = False):
        if restart or not clients:
            clients.append(MilvusBank.connect(uri))
        return MilvusPersonal(open_people(uri, "people", StoreLayout(DIM), client=clients[-1]), user)

    yield open_
    for client in clients:
        client.close()


def test_a_memory_is_kept_once_and_a_newer_value_supersedes_the_older(stores):
    mine = stores("ada")
    assert len(mine) == 0 and mine.entries() == []
    first, gone = mine.add(key(1, 0, 0), None, "The user's dog is called Rex.", make_bank=empty, source="chat")
    assert first["id"].startswith("m-") and gone == []
    other, _ = mine.add(key(0, 0, 1), None, "The user lives in Porto.", make_bank=empty, source="api")
    # the same text again, or a key as good as the same with the same words but for fillers: not added twice
    assert mine.add(key(0, 0, 1), None, "the user lives in porto", make_bank=empty)[0] is None
    assert mine.add(key(1, 0.05, 0), None, "The user's dog is really called Rex", make_bank=empty)[0] is None
    # the same thing, a new value (cosine 0.89: over `supersede`, under `duplicate`)
    newer, gone = mine.add(key(1, 0.5, 0), None, "The user's dog is called Pocket.", make_bank=empty)
    assert [g["id"] for g in gone] == [first["id"]]
    assert [e["text"] for e in mine.entries()] == ["The user's dog is called Pocket.", "The user lives in Porto."]
    (old,) = mine.history
    assert old["text"] == "The user's dog is called Rex." and old["superseded_by"] == newer["id"]
    assert old["superseded_at"] >= old["created_at"]

    again = stores("ada", restart=True)  # a restart: the same memories, ids, times, history
    ids = lambda m: [{k: v for k, v in e.items() if k != "index"} for e in m.entries()]  # noqa: E731 (rows renumber)
    assert ids(again) == ids(mine) and again.history == mine.history
    assert again.find(other["id"])["source"] == "api"


def test_deletes_are_by_id_and_an_unknown_id_deletes_nothing(stores):
    mine = stores("ada")
    a, _ = mine.add(key(1), None, "The user is a nurse.", make_bank=empty)
    b, _ = mine.add(key(0, 1), None, "The user has two cats.", make_bank=empty)
    with pytest.raises(KeyError, match="m-000000000000"):
        mine.remove([b["id"], "m-000000000000"])
    assert len(mine) == 2
    assert [e["id"] for e in mine.remove([a["id"]])] == [a["id"]]
    assert [e["id"] for e in stores("ada", restart=True).entries()] == [b["id"]]
    assert mine.clear() == 1 and len(stores("ada", restart=True)) == 0


def test_a_deleted_memory_takes_the_older_values_it_superseded_with_it(stores):
    """"Forget my bank PIN." deleted the PIN 2222 and kept "The user's bank PIN is 1111." in the file's history (and
    in the About-you export): the person asked the PIN gone. Another memory's history stays."""
    mine = stores("ada")
    mine.add(key(1, 0, 0), None, "The user's bank PIN is 0000.", make_bank=empty)
    mine.add(key(1, 0.05, 0), None, "The user's bank PIN is 1111.", make_bank=empty)  # (supersedes 0000)
    pin, _ = mine.add(key(1, 0.1, 0), None, "The user's bank PIN is 2222.", make_bank=empty)  # (supersedes 1111)
    mine.add(key(0, 0, 1), None, "The user's dog is called Rex.", make_bank=empty)
    mine.add(key(0, 0.05, 1), None, "The user's dog is called Max.", make_bank=empty)
    assert sorted(h["text"] for h in mine.history) == ["The user's bank PIN is 0000.", "The user's bank PIN is 1111.",
                                                       "The user's dog is called Rex."]
    assert [e["id"] for e in mine.remove([pin["id"]])] == [pin["id"]]
    for m in (mine, stores("ada", restart=True)):
        assert [h["text"] for h in m.history] == ["The user's dog is called Rex."]
        assert [e["text"] for e in m.entries()] == ["The user's dog is called Max."]


def test_restore_puts_a_superseded_or_forgotten_memory_back_as_it_was(stores):
    mine = stores("ada")
    rex, _ = mine.add(key(1, 0, 0), None, "The user's dog is called Rex.", make_bank=empty, source="chat")
    porto, _ = mine.add(key(0, 0, 1), None, "The user lives in Porto.", make_bank=empty, source="api")
    pocket, (superseded,) = mine.add(key(1, 0.5, 0), None, "The user's dog is called Pocket.", make_bank=empty)
    (forgotten,) = mine.remove([porto["id"]])
    # the undo of the supersede: the newer goes, the older is recalled again and leaves the history
    mine.remove([pocket["id"]])
    back = mine.restore(key(1, 0, 0), None, superseded, make_bank=empty)
    assert back == rex and mine.history == []
    assert mine.restore(key(1, 0, 0), None, superseded, make_bank=empty) is None  # there already: not twice
    # the undo of a forget: the same id, time and source
    assert mine.restore(key(0, 0, 1), None, forgotten, make_bank=empty) == porto
    again = stores("ada", restart=True)
    assert sorted((e["id"], e["text"], e["created_at"]) for e in again.entries()) == sorted(
        (e["id"], e["text"], e["created_at"]) for e in (rex, porto))
    scores, ids = again.bank.topk(key(1, 0, 0)[0], 1)  # recalled again
    assert float(scores[0]) > 0.99 and again.bank.text(int(ids[0])) == rex["text"]


def test_a_changed_number_or_name_at_a_near_identical_key_supersedes_and_fillers_are_a_repeat(stores):
    """(Any key at `duplicate` or closer was a duplicate whatever its words: "The user's bank PIN is 2222." after
    "... 1111." (keys 0.99 apart with the trained key encoder) was dropped, and the older value kept.)"""
    mine = stores("ada")
    pin, _ = mine.add(key(1, 0, 0), None, "The user's bank PIN is 1111.", make_bank=empty)
    newer, gone = mine.add(key(1, 0.05, 0), None, "The user's bank PIN is 2222.", make_bank=empty)  # cosine 0.999
    assert newer is not None and [g["id"] for g in gone] == [pin["id"]]
    named, gone = mine.add(key(0, 0, 1), None, "The user's dog is called Rex.", make_bank=empty)
    renamed, gone = mine.add(key(0, 0.05, 1), None, "The user's dog is called Max.", make_bank=empty)
    assert renamed is not None and [g["id"] for g in gone] == [named["id"]]
    # words that differ only in fillers ("got", "really", "a", ...) at such a key: the same memory
    assert mine.add(key(0, 0.06, 1), None, "The user's dog is really called Max", make_bank=empty)[0] is None
    # the same words at a farther key are a repeat too; fillers at a farther key (under `duplicate`) are not
    assert mine.add(key(0, 1, 1), None, "the user's bank pin is 2222", make_bank=empty)[0] is None
    assert [e["text"] for e in mine.entries()] == ["The user's dog is called Max.", "The user's bank PIN is 2222."]
    assert twin(mine.bank.search(key(0, 0.06, 1)[0], 8), "The user's dog is just called Max.",
                Similar())["text"] == "The user's dog is called Max."
    assert twin(mine.bank.search(key(0, 0.06, 1)[0], 8), "The user's dog is called Pip.", Similar()) is None


def test_with_the_trained_key_encoder_a_new_number_or_name_is_a_newer_value(tmp_path):
    """The probe's cases with the shipped key encoder (their keys 0.98-0.997 apart): each newer value supersedes
    the older; a repeat with a filler is still a repeat."""
    from models.text_keys import TextEncoder

    enc = TextEncoder()
    mine = PersonalMemory(tmp_path / "ada.safetensors")
    add = lambda text: mine.add(torch.from_numpy(enc.encode([text])), None, text,  # noqa: E731
                                make_bank=lambda: MemoryVectorDB(enc.dim))
    for old, new in [("The user's bank PIN is 1111.", "The user's bank PIN is 2222."),
                     ("The user's locker number is 12.", "The user's locker number is 57."),
                     ("The user's phone number is 555-0101.", "The user's phone number is 555-0199."),
                     ("The user's dog is called Rex.", "The user's dog is called Max.")]:
        first, _ = add(old)
        newer, gone = add(new)
        assert newer is not None and [g["id"] for g in gone] == [first["id"]], (old, new)
    assert add("The user's dog is really called Max.")[0] is None
    assert sorted(e["text"] for e in mine.entries()) == [
        "The user's bank PIN is 2222.", "The user's dog is called Max.", "The user's locker number is 57.",
        "The user's phone number is 555-0199."]
    # another fact about the same person or pet, in either order, is kept (keys 0.89-0.95 apart: it superseded)
    for first, then in [("The user's sister is called Lena.", "The user's sister lives in Oslo."),
                        ("The user's dog is 5 years old.", "The user's dog is called Rex."),
                        ("The user's boss lives in Paris.", "The user's boss is called Greg."),
                        ("The user's mother is called Ann.", "The user's mother is a nurse.")]:
        mine.clear()
        assert add(first)[0] is not None
        kept, gone = add(then)
        assert kept is not None and gone == [], (first, then)
    newer, gone = add("The user's mother is called Anna.")
    assert [g["text"] for g in gone] == ["The user's mother is called Ann."]


def test_another_fact_about_the_same_person_or_pet_is_kept_beside_the_first(stores):
    """(Any key at `supersede` or closer was a newer value: "The user's sister lives in Oslo." superseded "The user's
    sister is called Lena." (keys 0.89 apart with the trained key encoder), which was gone from the list and recall.)"""
    mine = stores("ada")
    lena, _ = mine.add(key(1, 0, 0), None, "The user's sister is called Lena.", make_bank=empty)
    oslo, gone = mine.add(key(1, 0.3, 0), None, "The user's sister lives in Oslo.", make_bank=empty)  # cosine 0.96
    assert oslo is not None and gone == []
    brother, gone = mine.add(key(1, 0.2, 0), None, "The user's brother lives in Oslo.", make_bank=empty)
    assert brother is not None and gone == []  # (another thing of the user's: "sister" / "brother")
    lina, gone = mine.add(key(1, 0.1, 0), None, "The user's sister is called Lina.", make_bank=empty)
    assert [g["id"] for g in gone] == [lena["id"]]  # the same fact, a newer value
    assert sorted(e["text"] for e in mine.entries()) == [
        "The user's brother lives in Oslo.", "The user's sister is called Lina.", "The user's sister lives in Oslo."]


@pytest.mark.parametrize("old,new,same", [
    ("The user's bank PIN is 1111.", "The user's bank PIN is 2222.", True),
    ("The user's locker number is 12.", "The user's locker number is 57.", True),
    ("The user lives in Porto.", "The user lives in Brackholm.", True),
    ("The user lives at 12 Elm Street.", "The user lives at 48 Oak Road.", True),
    ("Lena is the user's sister.", "Lina is the user's sister.", True),
    ("The user works as a baker.", "The user works as a nurse.", True),
    ("The user's dog is called Rex.", "The user's dog is 5 years old.", False),
    ("The user's mother is Ann.", "The user's mother is a nurse.", False),
    ("The user lives in Porto.", "The user works in Porto.", False),
    ("The user's sister is called Lena.", "The user's brother is called Lena.", False),
    ("The user is 30.", "The user is Bob.", False),
    ("The user's dog is called Rex.", "The user's dog is called Rex Junior.", False),
    # (a hostile probe: "I have a meeting on Monday at 9." was superseded by "... on Friday at 3.": one of several)
    ("The user has a meeting on Monday at 9.", "The user has a meeting on Friday at 3.", False),
    ("The user has a horse called Toby.", "The user has a horse called Pickles.", False),
    ("The user has 2 cats.", "The user has 3 cats.", True),
    # (a review: a clause about the thing is its value: the son's age)
    ("The user has a son who is 5 years old.", "The user has a son who is 6 years old.", True),
    ("The user has a daughter aged 7.", "The user has a daughter aged 8.", True),
    ("The user has a sister and works as a nurse.", "The user has a sister and works as a doctor.", True)])
def test_a_newer_value_says_the_same_but_for_its_value(old, new, same):
    assert newer_value(old, new) is same and newer_value(new, old) is same


def test_undo_after_a_delete_takes_back_a_supersede_by_id(stores):
    """(Undo looked a memory up by its place, 0..n-1, as if it were its id: once any memory had been deleted the ids
    had a hole, the lookup failed ("memory id 0 is not in the bank") after what the change wrote was removed, and
    both the newer and the older memory were gone.)"""
    mine = stores("ada")
    cat, _ = mine.add(key(0, 1, 0), None, "The user's cat is called Whiskers.", make_bank=empty)
    lena, _ = mine.add(key(0, 0, 1), None, "The user's sister is called Lena.", make_bank=empty)
    mine.remove([cat["id"]])  # a hole in the ids
    elm, _ = mine.add(key(1, 0, 0), None, "The user lives at 12 Elm Street.", make_bank=empty, source="chat")
    moved, gone = mine.add(key(1, 0.3, 0), None, "The user lives at 48 Elm Street.", make_bank=empty)
    assert [g["id"] for g in gone] == [elm["id"]]
    done = mine.undo([moved["id"]], [(key(1, 0, 0), None, gone[0])], make_bank=empty)
    assert [e["id"] for e in done.removed] == [moved["id"]] and done.restored == (elm,) and done.kept == ()
    again = stores("ada", restart=True)
    assert sorted(e["text"] for e in again.entries()) == ["The user lives at 12 Elm Street.",
                                                         "The user's sister is called Lena."]
    assert again.find(elm["id"])["created_at"] == elm["created_at"] and again.history == []
    # an undo whose memories have all changed since does nothing
    assert mine.undo([moved["id"]], [], make_bank=empty) == Undone()
    assert mine.restore(key(1, 0, 0), None, gone[0], make_bank=empty) is None  # (by id too: here already)


def test_an_undo_does_not_put_back_a_fact_that_came_back_meanwhile(stores):
    """(A forgotten memory told again in another tab or through the API, then the forget undone: two copies.)"""
    mine = stores("ada")
    rex, _ = mine.add(key(1, 0, 0), None, "The user's dog is called Rex.", make_bank=empty)
    (forgotten,) = mine.remove([rex["id"]])
    again, _ = mine.add(key(1, 0, 0), None, "The user's dog is called Rex.", make_bank=empty)  # told again: a new id
    done = mine.undo([], [(key(1, 0, 0), None, forgotten)], make_bank=empty)
    assert done.restored == () and [e["id"] for e in done.kept] == [again["id"]]
    assert [e["id"] for e in mine.entries()] == [again["id"]]
    # what the change itself wrote is no twin: an edit to almost the same words is undone to the old words
    edit, _ = mine.add(key(1, 0.01, 0), None, "The user's dog is really called Rex.", make_bank=empty)
    assert edit is None  # (a repeat of the kept one)
    (old,) = mine.remove([again["id"]])
    edit, _ = mine.add(key(1, 0.01, 0), None, "The user's dog is really called Rex.", make_bank=empty)
    done = mine.undo([edit["id"]], [(key(1, 0, 0), None, old)], make_bank=empty)
    assert [e["id"] for e in mine.entries()] == [again["id"]] and done.kept == ()


def test_an_undo_that_fails_part_way_changes_nothing(tmp_path, monkeypatch):
    """The file store's undo is one write: a failure after what the change wrote was taken out of the copy leaves
    the file and the memories in use as they were."""
    mine = PersonalMemory(tmp_path / "ada.safetensors")
    mine.add(key(0, 0, 1), None, "The user's cat is called Whiskers.", make_bank=empty)
    old, _ = mine.add(key(1, 0, 0), None, "The user lives at 12 Elm Street.", make_bank=empty)
    new, gone = mine.add(key(1, 0.3, 0), None, "The user lives at 48 Elm Street.", make_bank=empty)
    before, file = mine.entries(), (tmp_path / "ada.safetensors").read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(MemoryVectorDB, "add", broken)
    with pytest.raises(OSError, match="disk full"):
        mine.undo([new["id"]], [(key(1, 0, 0), None, gone[0])], make_bank=empty)
    monkeypatch.undo()
    assert mine.entries() == before and (tmp_path / "ada.safetensors").read_bytes() == file
    no_index = lambda entries: [{k: v for k, v in e.items() if k != "index"} for e in entries]  # noqa: E731
    assert no_index(PersonalMemory(tmp_path / "ada.safetensors").entries()) == no_index(before)  # (rows renumber)


def test_the_newest_of_near_memories_about_one_thing_is_read(stores):
    """`Newest`: a told change worded unlike the older memory (keys 0.6 similar: under `supersede`, so both are
    kept) is read instead of it when the message finds both about as well; a memory about another thing, or one
    much less similar to the message, is never hidden."""
    mine = stores("ada")
    porto, _ = mine.add(key(1, 0, 0), None, "The user lives in Porto.", make_bank=empty)
    sister, _ = mine.add(key(0, 0, 1), None, "The user's sister is Lena.", make_bank=empty)
    moved, gone = mine.add(key(0.6, 0.8, 0), None, "These days the user lives in Brackholm.", make_bank=empty)
    assert gone == [] and len(mine) == 3
    read = Newest(mine.bank)
    text = lambda q, k=None: [mine.bank.text(int(i)) for i in read.topk(key(*q)[0], k)[1]]  # noqa: E731
    # the message scores Porto 0.904 and Brackholm 0.885: the newer is read, the older hidden
    assert text((0.95, 0.45, 0)) == [moved["text"], sister["text"]]
    assert text((0.95, 0.45, 0), 1) == [moved["text"]]
    # Brackholm 0.19 under Porto (more than the margin): Porto is read, nothing hidden
    assert text((1, 0.2, 0)) == [porto["text"], moved["text"], sister["text"]]
    # as close as Porto but about another thing (keys 0 similar): both stay, the closer first
    assert text((1, 0, 0.98)) == [porto["text"], sister["text"], moved["text"]]
    # what the memory head then reads: the wrapped bank's memory, values and length
    assert read.memory(int(read.topk(key(0.95, 0.45, 0)[0], 1)[1][0]), 0.9).text == moved["text"]
    assert len(read) == 3 and read.dim == mine.bank.dim


def test_a_change_made_by_another_process_is_seen(tmp_path):
    path = tmp_path / "ada.safetensors"
    here, there = PersonalMemory(path), PersonalMemory(path)  # two replicas on one machine
    here.add(key(1), None, "The user is a nurse.", make_bank=empty)
    there.add(key(0, 1), None, "The user has two cats.", make_bank=empty)  # starts from the file, not its copy
    assert sorted(e["text"] for e in here.entries()) == ["The user has two cats.", "The user is a nurse."]


# (each memory's key its own axis: random keys were once close enough (cosine >= 0.8) for a new memory to supersede
# an old one, which the test then counted as lost)
WRITER = """
import sys, torch
from memory import MemoryVectorDB
from memory.personal import PersonalMemory
mine = PersonalMemory(sys.argv[1])
i = len(mine)
while True:
    k = torch.zeros(1, 256)
    k[0, i] = 1.0
    mine.add(k, None, f"memory {i}", make_bank=lambda: MemoryVectorDB(256))
    i += 1
    print(i, flush=True)
"""


def test_kill_9_in_the_middle_of_writes_leaves_the_memories_as_before_or_after(tmp_path):
    path = tmp_path / "ada.safetensors"
    written = 0
    for round_ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                                text=True)
        seen = written
        deadline = time.monotonic() + 60
        while seen < written + 3 + round_ and time.monotonic() < deadline:  # it is writing: kill it at a new moment
            seen = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        # (it may have reported more writes between the last line read and the kill: every one it reported counts)
        seen = max([seen, *(int(line) for line in proc.stdout.read().split())])
        after = PersonalMemory(path)  # loads: never a half-written file
        texts = [e["text"] for e in after.entries()]
        # every write it reported is there, and at most the one it was making when killed
        assert seen <= len(texts) <= seen + 1, (seen, len(texts))
        assert sorted(texts, key=lambda t: int(t.split()[1])) == [f"memory {i}" for i in range(len(texts))]
        written = len(texts)
    assert written >= 6


def test_joined_banks_search_as_one_and_name_where_a_memory_came_from():
    mine, shared = MemoryVectorDB(DIM), MemoryVectorDB(DIM)
    mine.add(torch.cat([key(1, 0.1), key(0, 0, 1)]), ["The user's dog is Pocket.", "The user lives in Porto."])
    shared.add(torch.cat([key(1, 0.3), key(0, 1)]), ["Dogs are loyal.", "The ferry leaves at seven."])
    both = Joined([("yours", mine), ("shared", shared), ("empty", None)])
    assert len(both) == 4
    scores, ids = both.topk(key(1), 2)
    got = [both.memory(int(i), float(s)) for s, i in zip(scores, ids)]
    assert [(m.text, m.source) for m in got] == [("The user's dog is Pocket.", "yours"), ("Dogs are loyal.", "shared")]
    assert scores.tolist() == pytest.approx([1 / 1.01 ** 0.5, 1 / 1.09 ** 0.5], abs=1e-5)
    assert both.source(int(ids[1])) == ("shared", 0)
    all_scores, all_ids = both.topk(key(1), None)
    assert len(all_scores) == 4 and sorted(both.source(int(i)) for i in all_ids) == [
        ("shared", 0), ("shared", 1), ("yours", 0), ("yours", 1)]


def test_thresholds_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="duplicate"):
        Similar(duplicate=0.5, supersede=0.8)


def test_a_persons_file_keeps_the_newest_history(tmp_path, monkeypatch):
    """(The history of superseded values grew without end, and a person's texts live in the file's header, which
    safetensors caps at 100 MB: a file past it could no longer be read.)"""
    import memory.personal as personal

    monkeypatch.setattr(personal, "MAX_HISTORY", 3)
    mine = PersonalMemory(tmp_path / "ada.safetensors")
    for n in range(6):  # each supersedes the one before
        mine.add(key(1, 0.1 * n, 0), None, f"The user's desk number is {9000 + n}.", make_bank=empty)
    assert [e["text"] for e in mine.entries()] == ["The user's desk number is 9005."]
    assert [h["text"] for h in PersonalMemory(tmp_path / "ada.safetensors").history] == [
        f"The user's desk number is {9000 + n}." for n in (2, 3, 4)]

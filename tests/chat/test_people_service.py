"""Each user's memory through the service's own conversation path, on a tiny random model (fast), in either store:
8 users at once never see one another's memories and lose none; with `memory.store: milvus` the people's memories
live in one Milvus collection, the user its partition key, kept across a restart."""

from __future__ import annotations

import copy
import dataclasses
import json
import threading

import pytest

from chat import transcript
from chat.config import load_config
from chat.operations import (edit_memory, forget_all_memories, forget_memories, my_memories, remember,
                             undo_memory_change)
from chat.changes import Remembered
from chat.decision import Decision
from chat.service import Service
from chat.worker import Notice, ServiceError
from memory import BankError
from decoding.events import RecallEvent
from decoding.settings import GenerationSettings, RecallSettings
from memory.milvus import MilvusBank
from memory.personal import PersonalMemory, Similar
from memory.personal_milvus import MilvusPersonal
from tests_helpers import drain, result

SHORT = GenerationSettings(max_new_tokens=4)
RECALL = RecallSettings(top_k=1)
# the tiny random model's keys of any two sentences have cosines of 0.92-0.96: the app's thresholds would take a new
# fact for a newer value of the last one
TINY = Similar(duplicate=0.99, supersede=0.985)
NAMES = ["Pocket", "Rex", "Mira", "Lena", "Otto", "Juno", "Kai", "Zed"]


def config(tmp_path, store: str, *more: str):
    where = [f"memory.user_dir={tmp_path / 'users'}"]
    if store == "milvus":
        where += ["memory.store=milvus", f"memory.milvus_uri={tmp_path / 'memories.db'}"]
    return load_config(overrides=["model.compile=false", *where, *more], environ={})


def started(cfg, lm) -> Service:
    svc = Service(cfg, lm)
    svc.people.similar = TINY
    return svc


def told(name: str) -> tuple[str, str]:
    """What user `name` says (a chat message and an API write), as their memories read."""
    return f"The user's dog is called {name}.", f"The user's boat is called {name}-{len(name)}."


def one_user(svc: Service, user: str, name: str, start: threading.Barrier) -> dict:
    """A user's turns: tell a fact in the chat, write one through the API, ask; what they saw of their memory."""
    s = svc.new_session(user)
    seen = {"recalls": [], "remembered": [], "listings": []}
    start.wait()
    for event in drain(svc.chat(s, f"Remember that my dog is called {name}.", [], SHORT, RECALL, True).request):
        seen["recalls" if isinstance(event, RecallEvent) else "remembered"].append(event)
    seen["listings"].append(svc.run(my_memories, s))
    seen["remembered"].append(result(svc.run(remember, s, f"My boat is called {name}-{len(name)}.")))
    seen["listings"].append(svc.run(my_memories, s))
    events = drain(svc.chat(s, "What is my dog's name?", [], SHORT, RECALL, True).request)
    seen["recalls"] += [e for e in events if isinstance(e, RecallEvent)]
    seen["listings"].append(svc.run(my_memories, s))
    seen["remembered"] = [e for e in seen["remembered"] if isinstance(e, Remembered)]
    return seen


@pytest.mark.parametrize("store", ["faiss", "milvus"])
def test_eight_users_at_once_never_see_each_others_memories_and_lose_none(tiny_llama, tmp_path, store):
    svc = started(config(tmp_path, store), tiny_llama)
    users = {f"user{i}": NAMES[i] for i in range(8)}
    seen, start = {}, threading.Barrier(len(users))

    def run(user: str) -> None:
        seen[user] = one_user(svc, user, users[user], start)

    threads = [threading.Thread(target=run, args=(u,)) for u in users]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert sorted(seen) == sorted(users)  # every user's turns ran to the end
        ids = {}
        for user, name in users.items():
            mine, got = set(told(name)), seen[user]
            written = [e for r in got["remembered"] for e in r.written]
            assert {e["text"] for e in written} == mine  # both written, as theirs
            assert got["recalls"] and all(r.source == "yours" and r.text in mine for r in got["recalls"])
            for listing in got["listings"]:
                assert {m["text"] for m in listing} <= mine
            assert {m["text"] for m in got["listings"][-1]} == mine  # none lost
            ids[user] = {e["id"] for e in written}
            assert {m["id"] for m in svc.run(my_memories, svc.new_session(user))} == ids[user]
        assert len(set().union(*ids.values())) == 2 * len(users)  # no memory is two users'
    finally:
        svc.close()


def test_with_milvus_each_users_memory_is_theirs_in_one_collection_across_a_restart(tiny_llama, tmp_path):
    cfg = config(tmp_path, "milvus")
    svc = started(cfg, tiny_llama)
    try:
        ada, bob = svc.new_session("ada"), svc.new_session("bob")
        (written,) = result(svc.run(remember, ada, "My dog is a beagle called Pocket.")).written
        assert isinstance(svc.personal(ada), MilvusPersonal) and svc.run(my_memories, bob) == []
        with pytest.raises(KeyError, match="no such memory of yours"):
            svc.run(forget_memories, bob, [written["id"]])
        recalls = [e for e in drain(svc.chat(bob, "What is my dog's name?", [], SHORT, RECALL, True).request)
                   if isinstance(e, RecallEvent)]
        assert recalls == []  # bob has no memory, and ada's is not his to recall
        assert not (tmp_path / "users").exists()  # no user's memory is a file
    finally:
        svc.close()

    client = MilvusBank.connect(str(tmp_path / "memories.db"))
    user = next(f for f in client.describe_collection("memories_people")["fields"] if f["name"] == "user")
    assert user.get("is_partition_key") is True
    client.close()

    svc = started(cfg, tiny_llama)  # a restart: the same collection
    try:
        ada = svc.new_session("ada")
        assert [m["text"] for m in svc.run(my_memories, ada)] == ["The user's dog is a beagle called Pocket."]
        recalls = [e for e in drain(svc.chat(ada, "What is my dog's name?", [], SHORT, RECALL, True).request)
                   if isinstance(e, RecallEvent)]
        assert [(r.text, r.source) for r in recalls] == [("The user's dog is a beagle called Pocket.", "yours")]
        assert svc.run(forget_memories, ada, [written["id"]])[0]["id"] == written["id"]
        assert svc.run(my_memories, ada) == []
    finally:
        svc.close()


def test_without_milvus_each_users_memory_is_a_file(tiny_llama, tmp_path):
    svc = started(config(tmp_path, "faiss"), tiny_llama)
    try:
        assert isinstance(svc.personal(svc.new_session("ada")), PersonalMemory)
    finally:
        svc.close()


def test_a_damaged_memory_file_is_said_and_the_answer_goes_on_and_the_file_is_kept(tiny_llama, tmp_path):
    from chat.worker import Failed, Notice

    svc = started(config(tmp_path, "faiss"), tiny_llama)
    try:
        s = svc.new_session("ada")
        drain(svc.chat(s, "Remember that my dog is called Pocket.", [], SHORT, RECALL).request)
        path = svc.personal(s).path
        damaged = path.read_bytes()[:300]
        path.write_bytes(damaged)  # (changed under the running server: it reads the file again)
        for text in ("What is my dog's name?", "Remember that my cat is called Tom."):
            events = drain(svc.chat(svc.new_session("ada"), text, [], SHORT, RECALL).request)
            assert not [e for e in events if isinstance(e, Failed)], text
            notices = [e.text for e in events if isinstance(e, Notice)]
            assert any("expected a readable safetensors file" in n and "answering without your memories" in n
                       for n in notices), notices
        assert path.read_bytes() == damaged  # nothing written over it
        with pytest.raises(ValueError, match="expected a readable safetensors file"):
            svc.run(my_memories, svc.new_session("ada"))
    finally:
        svc.close()


@pytest.mark.parametrize("store", ["faiss", "milvus"])
def test_undo_takes_back_what_the_last_message_wrote_replaced_or_forgot(tiny_llama, tmp_path, store):
    svc = started(config(tmp_path, store), tiny_llama)
    svc.people.similar = Similar(duplicate=0.999, supersede=0.9)  # (tiny keys: any two facts are close: a newer value)
    s = svc.new_session("ada")
    texts = lambda: [m["text"] for m in svc.run(my_memories, s)]  # noqa: E731
    say = lambda text: drain(svc.chat(s, text, [], SHORT, RECALL).request)  # noqa: E731
    try:
        with pytest.raises(ValueError, match="no change to your memories to undo"):
            svc.run(undo_memory_change, s)
        say("Remember that my dog is called Rex.")
        rex = svc.run(my_memories, s)[0]
        say("Remember that my dog is called Pocket.")  # supersedes Rex
        assert texts() == ["The user's dog is called Pocket."]
        assert "Remembered: The user's dog is called Pocket." in svc.state(s).change
        undone = result(svc.run(undo_memory_change, s))
        assert [e["text"] for e in undone.removed] == ["The user's dog is called Pocket."]
        assert [e["text"] for e in undone.restored] == ["The user's dog is called Rex."]
        assert undone.describe() == ("Removed: The user's dog is called Pocket. · "
                                     "Restored: The user's dog is called Rex.")
        assert svc.run(my_memories, s) == [rex] and svc.personal(s).history == []  # Rex as it was: id, time
        assert svc.state(s).change == ""  # undone once
        say("Forget my dog.")
        assert texts() == []
        # (an undone forget said "Remembered: ...": say what came back)
        assert result(svc.run(undo_memory_change, s)).describe() == "Restored: The user's dog is called Rex."
        assert svc.run(my_memories, s) == [rex]
        say("Hello there.")  # a message that changes nothing: nothing left to undo
        with pytest.raises(ValueError, match="no change"):
            svc.run(undo_memory_change, s)
    finally:
        svc.close()


def test_forgetting_everything_deletes_a_damaged_file_and_nothing_else(tiny_llama, tmp_path):
    """(A hostile probe damaged a user's file: GET, POST and DELETE /v1/memories all failed, so they could not even
    start again.) Forget everything deletes it, as asked; a file that reads is never deleted for another cause."""
    svc = started(config(tmp_path, "faiss"), tiny_llama)
    try:
        s = svc.new_session("ada")
        result(svc.run(remember, s, "My dog is called Pocket."))
        path = svc.personal(s).path
        path.write_bytes(path.read_bytes()[:300])
        with pytest.raises(ValueError, match="expected a readable safetensors file"):
            svc.run(my_memories, svc.new_session("ada"))
        assert svc.run(forget_all_memories, svc.new_session("ada")) == 0 and not path.exists()
        result(svc.run(remember, svc.new_session("ada"), "My cat is called Tom."))
        assert [m["text"] for m in svc.run(my_memories, svc.new_session("ada"))] == ["The user's cat is called Tom."]

        def unreadable(lm, user):  # (another cause: its users file, its owner file)
            raise BankError(f"the memories of {user!r} cannot be read: the users file is damaged")
        svc.people.of = unreadable
        with pytest.raises(ValueError, match="the users file is damaged"):
            svc.run(forget_all_memories, svc.new_session("ada"))
        assert path.exists()
    finally:
        svc.close()


def test_a_memory_file_that_cannot_be_written_is_said_once_and_the_answer_goes_on(tiny_llama, tmp_path, monkeypatch):
    """(A hostile probe made a user's file immutable: "My goat is called Billy." was a 500 with no answer; with a
    damaged file a told thing was dropped without a word, and the file's notice came twice.)"""
    from chat.worker import Failed, Notice
    from memory import MemoryVectorDB

    svc = started(config(tmp_path, "faiss"), tiny_llama)
    try:
        s = svc.new_session("ada")
        drain(svc.chat(s, "Remember that my dog is called Pocket.", [], SHORT, RECALL).request)
        path = svc.personal(s).path
        kept = path.read_bytes()

        def refused(self, path):
            raise PermissionError(1, "Operation not permitted")
        monkeypatch.setattr(MemoryVectorDB, "save", refused)
        events = drain(svc.chat(s, "Remember that my goat is called Billy.", [], SHORT, RECALL).request)
        assert not [e for e in events if isinstance(e, Failed)]
        notices = [e.text for e in events if isinstance(e, Notice)]
        assert f"{path}: cannot be written (Operation not permitted); nothing was changed: this message changed none " \
               "of your memories" in notices
        assert s.conv.messages[-1].role == "assistant" and path.read_bytes() == kept
        monkeypatch.undo()
        path.write_bytes(kept[:300])  # (damaged: read, not written)
        events = drain(svc.chat(svc.new_session("ada"), "Remember that my horse is called Star.", [], SHORT,
                                RECALL).request)
        notices = [e.text for e in events if isinstance(e, Notice)]
        assert len(notices) == len(set(notices)) and any(n.endswith("this message changed none of your memories")
                                                         for n in notices), notices
    finally:
        svc.close()


def test_a_message_that_forgets_and_remembers_is_one_change_undone_at_once(tiny_llama, tmp_path, monkeypatch):
    """("Forget my dog, and remember that my cat is called Tom." did neither.) The forget first, then the writes; the
    answer says both; one Undo takes back both; a memory the same message wrote and then replaced was never there
    before it; a write that fails takes back the message's forget."""
    from decoding.events import TokenEvent

    svc = started(config(tmp_path, "faiss"), tiny_llama)
    svc.people.similar = Similar(duplicate=0.999, supersede=0.9)  # (tiny keys: any two facts are close: a newer value)
    s = svc.new_session("ada")
    texts = lambda: [m["text"] for m in svc.run(my_memories, s)]  # noqa: E731
    say = lambda text: drain(svc.chat(s, text, [], GenerationSettings(max_new_tokens=64), RECALL).request)  # noqa
    try:
        say("Remember that my dog is called Rex.")
        rex = svc.run(my_memories, s)
        events = say("Forget my dog, and remember that my cat is called Tom.")
        reply = "Remembered: The user's cat is called Tom. · Forgot: The user's dog is called Rex."
        assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == reply
        assert texts() == ["The user's cat is called Tom."]
        assert result(svc.run(undo_memory_change, s)).describe() == (
            "Removed: The user's cat is called Tom. · Restored: The user's dog is called Rex.")
        assert svc.run(my_memories, s) == rex

        say("Remember that my dog is called Max, and remember that my dog is called Pocket.")  # (Pocket replaces both)
        assert texts() == ["The user's dog is called Pocket."]
        assert svc.state(s).change == ("Remembered: The user's dog is called Pocket. · "
                                       "(replaces: The user's dog is called Rex.)")
        result(svc.run(undo_memory_change, s))
        assert svc.run(my_memories, s) == rex  # (Max, written and replaced by the same message, stays gone)

        def fails(*args, **kwargs):
            raise BankError("the disk is full")
        monkeypatch.setattr(svc.people, "write", fails)
        events = say("Forget my dog, and remember that my cat is called Tom.")
        assert "the disk is full: this message changed none of your memories" in [getattr(e, "text", "")
                                                                                   for e in events]
        assert svc.run(my_memories, s) == rex and svc.state(s).change == ""
    finally:
        svc.close()


@pytest.mark.parametrize("store", ["faiss", "milvus"])
def test_a_correction_corrects_what_the_last_turn_remembered_and_can_be_undone(tiny_llama, tmp_path, store):
    """("Actually it's Pocket, not Rocket." changed nothing: no "my", no command.) The last turn's memories that say
    "Rocket" say "Pocket" instead, one change that the app's own answer names and one Undo takes back; a memory told
    before that stays as it is (a review: "It's red, not blue." about anything rewrote "The user's car is blue."), and
    a correction of nothing the last turn remembered changes nothing: the model answers it."""
    from decoding.events import TokenEvent

    svc = started(config(tmp_path, store), tiny_llama)
    s = svc.new_session("ada")
    texts = lambda: sorted(m["text"] for m in svc.run(my_memories, s))  # noqa: E731
    say = lambda text: drain(svc.chat(s, text, [], GenerationSettings(max_new_tokens=64), RECALL).request)  # noqa
    answer = lambda events: "".join(e.text for e in events if isinstance(e, TokenEvent))  # noqa: E731
    try:
        say("Remember that Rocket sleeps on the sofa.")
        say("Remember that my dog is called Rocket.")
        before = svc.run(my_memories, s)
        events = say("Actually it's Pocket, not Rocket.")
        assert answer(events) == "Corrected: The user's dog is called Rocket. -> The user's dog is called Pocket."
        assert texts() == ["Rocket sleeps on the sofa.", "The user's dog is called Pocket."]
        assert {m["source"] for m in svc.run(my_memories, s) if "Pocket" in m["text"]} == {"correction"}
        undone = result(svc.run(undo_memory_change, s))
        assert len(undone.removed) == len(undone.restored) == 1
        assert sorted(map(str, svc.run(my_memories, s))) == sorted(map(str, before))  # as they were: ids, times
        events = say("No, it's Pocket, not Rocket.")  # (the last turn was the correction, undone: nothing of it)
        assert texts() == sorted(m["text"] for m in before) and svc.state(s).change == ""
        assert answer(events) and not any(isinstance(e, Remembered) for e in events)  # (the model's answer)
        done = svc.people.carry_out(tiny_llama, "ada", Decision(correct=("Rocket", "Pocket"),
                                                                unless_corrected=("The user's cat is Tom.",)))
        assert [e["text"] for e in done.written] == ["The user's cat is Tom."] and not done.forgotten  # (`auto`'s)
    finally:
        svc.close()


def test_a_correction_in_the_first_person_corrects_what_the_last_turn_remembered(tiny_llama, tmp_path):
    """("Actually I live in Oslo, not Bergen." corrected nothing: only "my ..." statements were read.)"""
    from decoding.events import TokenEvent

    svc = started(config(tmp_path, "faiss"), tiny_llama)
    s = svc.new_session("ada")
    say = lambda text: drain(svc.chat(s, text, [], GenerationSettings(max_new_tokens=64), RECALL).request)  # noqa
    try:
        say("Remember that I live in Bergen.")
        events = say("Actually I live in Oslo, not Bergen.")
        assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == \
            "Corrected: The user lives in Bergen. -> The user lives in Oslo."
        assert [m["text"] for m in svc.run(my_memories, s)] == ["The user lives in Oslo."]
    finally:
        svc.close()


def test_a_correction_to_a_text_already_remembered_says_so(tiny_llama, tmp_path, monkeypatch):
    """(It said "Forgot: The user's dog is called Rocket. · Already remembered: The user's dog is called Pocket.":
    the correction was named as two things it is not.) The memory is corrected to one kept already: it is named
    as a correction, and one Undo brings the old memory back."""
    svc = started(config(tmp_path, "faiss"), tiny_llama)
    s = svc.new_session("ada")
    try:
        drain(svc.chat(s, "Remember that my dog is called Rocket.", [], SHORT, RECALL).request)
        before = svc.run(my_memories, s)
        monkeypatch.setattr(svc.people, "write", lambda lm, user, text, **meta: Remembered(
            note=f"Already remembered: {text}"))  # (what `write` gives for a duplicate of a memory kept)
        done = svc.people.correct(tiny_llama, "ada", "Rocket", "Pocket", {"The user's dog is called Rocket."})
        assert done.describe() == ("Corrected: The user's dog is called Rocket. -> The user's dog is called Pocket. "
                                   "(already remembered)")
        assert svc.run(my_memories, s) == [] and not done.written
        svc.people.undo(tiny_llama, "ada", done)
        assert [m["text"] for m in svc.run(my_memories, s)] == [m["text"] for m in before]
    finally:
        svc.close()


def test_an_edit_to_a_text_close_to_the_old_replaces_it_and_can_be_undone(tiny_llama, tmp_path):
    """(A near-duplicate of the memory it edits was refused as "already remembered" after the old one was deleted:
    the edit lost the memory.)"""
    svc = started(config(tmp_path, "faiss"), tiny_llama)
    s = svc.new_session("ada")
    try:
        drain(svc.chat(s, "Remember that my sister is called Lena.", [], SHORT, RECALL).request)
        (lena,) = svc.run(my_memories, s)
        edited = result(svc.run(edit_memory, s, lena["id"], "My sister is called Lina."))
        assert [m["text"] for m in svc.run(my_memories, s)] == ["The user's sister is called Lina."]
        # (it said "Remembered: ... · Forgot: The user's sister is called Lena.": nothing was forgotten, it was edited)
        assert edited.describe() == "Edited: The user's sister is called Lena. -> The user's sister is called Lina."
        result(svc.run(undo_memory_change, s))
        assert svc.run(my_memories, s) == [lena]
    finally:
        svc.close()


@pytest.mark.parametrize("store", ["faiss", "milvus"])
def test_undo_after_a_delete_puts_back_what_an_edit_replaced(tiny_llama, tmp_path, store):
    """(Once any memory had been deleted, undo failed with "memory id 0 is not in the bank" after it had removed what
    the change wrote: the edited memory and its old text were both gone.)"""
    svc = started(config(tmp_path, store), tiny_llama)
    s = svc.new_session("ada")
    texts = lambda: sorted(m["text"] for m in svc.run(my_memories, s))  # noqa: E731
    try:
        for told_ in ("My cat is called Whiskers.", "My sister is called Lena.", "My dog is called Rex."):
            result(svc.run(remember, s, told_))
        cat = next(m for m in svc.run(my_memories, s) if "Whiskers" in m["text"])
        svc.run(forget_memories, s, [cat["id"]])  # a hole in the bank's ids
        lena = next(m for m in svc.run(my_memories, s) if "Lena" in m["text"])
        result(svc.run(edit_memory, s, lena["id"], "My sister is called Lina."))
        assert texts() == ["The user's dog is called Rex.", "The user's sister is called Lina."]
        undone = result(svc.run(undo_memory_change, s))
        assert undone.describe() == ("Removed: The user's sister is called Lina. · "
                                     "Restored: The user's sister is called Lena.")
        assert texts() == ["The user's dog is called Rex.", "The user's sister is called Lena."]
        assert next(m for m in svc.run(my_memories, s) if "Lena" in m["text"]) == lena  # as it was: id, time
    finally:
        svc.close()


@pytest.mark.parametrize("store", ["faiss", "milvus"])
def test_undoing_a_forget_does_not_put_back_a_fact_told_again_meanwhile(tiny_llama, tmp_path, store):
    """(Undo restored the forgotten memory beside the same fact written again through another tab or the API.)"""
    svc = started(config(tmp_path, store), tiny_llama)
    s, other_tab = svc.new_session("ada"), svc.new_session("ada")
    try:
        drain(svc.chat(s, "Remember that my dog is called Rex.", [], SHORT, RECALL).request)
        drain(svc.chat(s, "Forget my dog.", [], SHORT, RECALL).request)
        result(svc.run(remember, other_tab, "My dog is called Rex."))
        (again,) = svc.run(my_memories, s)
        undone = result(svc.run(undo_memory_change, s))
        assert svc.run(my_memories, s) == [again]
        assert undone.describe() == "Not restored, already remembered: The user's dog is called Rex."
    finally:
        svc.close()


def test_a_new_number_is_a_newer_value_and_a_repeat_names_the_memory_kept(tiny_llama, tmp_path):
    """(Keys at `duplicate` or closer were a repeat whatever their words: "My bank PIN is 2222." after "... 1111."
    said "Already remembered: The user's bank PIN is 2222." and kept 1111.)"""
    svc = started(config(tmp_path, "faiss"), tiny_llama)
    svc.people.similar = Similar(duplicate=0.9, supersede=0.85)  # (tiny keys: any two facts are as good as the same)
    s = svc.new_session("ada")
    try:
        result(svc.run(remember, s, "My bank PIN is 1111."))
        newer = result(svc.run(remember, s, "My bank PIN is 2222."))
        assert newer.describe() == ("Remembered: The user's bank PIN is 2222. · "
                                    "(replaces: The user's bank PIN is 1111.)")
        assert [m["text"] for m in svc.run(my_memories, s)] == ["The user's bank PIN is 2222."]
        reworded = result(svc.run(remember, s, "I've really got my bank PIN 2222."))  # (other words: written)
        assert reworded.written
        same = result(svc.run(remember, s, "I have got my bank PIN 2222."))  # (the same words but for a filler)
        assert not same.written and same.note == "Already remembered: The user has really got the user's bank PIN 2222."
    finally:
        svc.close()


def retrained(lm):
    """`lm` as a retrained adapter makes it: the same model, another memory encoder's name (its digest)."""
    encoder = copy.copy(lm.encoder)
    encoder.base_name = f"{lm.encoder.base_name}@retrained"
    return dataclasses.replace(lm, encoder=encoder)


def test_a_new_model_carries_over_an_earlier_ones_memories_once(tiny_llama, tmp_path):
    """A retrained adapter writes memories with another encoder, so it has its own file; it starts from the earlier
    model's memories re-encoded from their texts (ids, times, history kept), once: a memory deleted after that stays
    deleted across a restart, and "delete all" deletes every model's file."""
    cfg = config(tmp_path, "faiss")
    svc = started(cfg, tiny_llama)
    svc.people.similar = Similar(duplicate=0.999, supersede=0.9)  # (tiny keys: the second dog supersedes the first)
    s = svc.new_session("ada")
    try:
        drain(svc.chat(s, "Remember that my dog is called Rex.", [], SHORT, RECALL).request)
        drain(svc.chat(s, "Remember that my dog is called Pocket.", [], SHORT, RECALL).request)
        svc.people.similar = TINY
        result(svc.run(remember, s, "My boat is called Wave."))
        before, history, old_file = svc.run(my_memories, s), svc.personal(s).history, svc.personal(s).path
    finally:
        svc.close()
    assert [h["text"] for h in history] == ["The user's dog is called Rex."]

    new = retrained(tiny_llama)
    svc = started(cfg, new)
    s = svc.new_session("ada")
    try:
        mine = svc.personal(s)
        assert mine.path != old_file and mine.path.is_file() and old_file.is_file()
        assert svc.run(my_memories, s) == before and mine.history == history  # ids, times, sources, history
        assert mine.bank.info["encoder"] == new.encoder.name
        keys, _ = new.encoder.encode(new.model, new.tokenizer, [m["text"] for m in before], batch_size=4,
                                     progress=False)
        for m, key in zip(before, keys):  # the new encoder's keys: the memory head finds each by its own text
            _, ids = mine.bank.topk(key, 1)
            assert mine.find(m["id"])["index"] == int(ids[0])
        svc.run(forget_memories, s, [m["id"] for m in before])  # the last ones: the file goes
        assert not mine.path.exists()
    finally:
        svc.close()

    svc = started(cfg, new)  # a restart: what was deleted is not carried over again
    s = svc.new_session("ada")
    try:
        assert svc.run(my_memories, s) == [] and old_file.is_file()
        result(svc.run(remember, s, "My boat is called Foam."))
        assert svc.run(forget_all_memories, s) == 1
        assert list((tmp_path / "users" / "ada").glob("*.safetensors")) == []  # every model's file
    finally:
        svc.close()
    svc = started(cfg, tiny_llama)  # and the earlier model, too, finds nothing
    try:
        assert svc.run(my_memories, svc.new_session("ada")) == []
    finally:
        svc.close()


def test_a_memory_over_max_slots_is_refused_by_remember_edit_and_import_and_nothing_is_written(smollm2, tmp_path):
    """(A 20,000-character "remember" was kept as a memory of 4,010 value slots: every question it matched then
    read past the context and answered nothing, across restarts; an import took a 30,000-character text.)"""
    from chat.operations import import_memories
    svc = started(config(tmp_path, "faiss", "memory.max_slots=16"), smollm2)  # (the real model: a slot a token)
    s = svc.new_session("ada")
    long = "My favourite song goes like this: " + "the sea is calm tonight " * 10
    try:
        with pytest.raises(ServiceError, match=r"value slots, over memory.max_slots=16: split it.*nothing was written"):
            result(svc.run(remember, s, long))
        result(svc.run(remember, s, "My dog is called Rex."))
        (rex,) = svc.run(my_memories, s)
        with pytest.raises(ServiceError, match="over memory.max_slots=16"):
            result(svc.run(edit_memory, s, rex["id"], long))
        assert svc.run(my_memories, s) == [rex]  # the failed edit put the old memory back
        with pytest.raises(ServiceError, match="at most 20000 characters, got 20001"):
            svc.run(edit_memory, s, rex["id"], "x" * 20001)
        path = tmp_path / "mine.json"
        path.write_text(json.dumps(["My boat is called Wave.", long, "My cat is called Tom."]))
        with pytest.raises(ServiceError, match=r"memory 2 \(.The user's favourite song.*over memory.max_slots=16"):
            result(svc.run(import_memories, s, str(path)))
        path.write_text(json.dumps(["My boat is called Wave.", "x" * 30_000]))
        with pytest.raises(ServiceError, match="memory 2 has 30000 characters, over app.max_message_chars=20000"):
            svc.run(import_memories, s, str(path))
        assert svc.run(my_memories, s) == [rex]  # nothing of either import
    finally:
        svc.close()


def test_an_import_is_capped_written_at_once_and_says_what_replaced_what(tiny_llama, tmp_path):
    """(3,000 memories held every user's chat for 58 s, each rewriting the whole file, and the status said "imported
    2771 new memories" where 914 were kept: the rest superseded one another.)"""
    from chat.operations import MAX_IMPORT, import_memories
    svc = started(config(tmp_path, "faiss"), tiny_llama)
    s = svc.new_session("ada")
    try:
        path = tmp_path / "many.json"
        path.write_text(json.dumps([f"My friend number {i} is called Rex." for i in range(MAX_IMPORT + 1)]))
        with pytest.raises(ServiceError, match=f"at most {MAX_IMPORT} memories in one import, got {MAX_IMPORT + 1}"):
            svc.run(import_memories, s, str(path))
        result(svc.run(remember, s, "My dog is called Rex."))
        svc.people.similar = Similar(duplicate=0.9999, supersede=0.9)  # (tiny keys: each replaces the one before)
        path.write_text(json.dumps(["My dog is called Pocket.", "My dog is called Pocket.", "My dog is called Mira."]))
        done = result(svc.run(import_memories, s, str(path)))
        mine = svc.run(my_memories, s)
        assert done.kept == len(mine) == 1 and mine[0]["text"] == "The user's dog is called Mira."
        assert (done.items, done.duplicates, done.replaced, done.shadowed) == (3, 1, 1, 1)
        assert done.describe() == ("imported 1 new memories of 3 (1 already remembered, 1 earlier memories replaced, "
                                   "1 replaced by a later item of the file)")
        assert [h["text"] for h in svc.personal(s).history] == ["The user's dog is called Rex.",
                                                                 "The user's dog is called Pocket."]
    finally:
        svc.close()


def test_an_import_nested_too_deep_is_refused_by_name(tiny_llama, tmp_path):
    """(A file of 100,000 "[" showed "Error" and logged a RecursionError.)"""
    from chat.operations import import_memories
    svc = started(config(tmp_path, "faiss"), tiny_llama)
    s = svc.new_session("ada")
    try:
        path = tmp_path / "deep.json"
        path.write_text("[" * 100_000)
        with pytest.raises(ServiceError, match="expected a JSON list of memories, got nesting too deep"):
            svc.run(import_memories, s, str(path))
    finally:
        svc.close()


def test_a_forget_is_answered_with_what_it_forgot_and_the_conversation_goes_on_as_read_whole(tiny_llama, tmp_path):
    """A "forget ..." that forgot a memory is a command done: the answer is the app's own, what was forgotten (the
    model was asked before, and said "You haven't told me your dog's name." with two no-memory notices), streamed
    as an answer, cut at max_new_tokens as one, said again by Regenerate (the model would guess), and kept in the
    conversation exactly: the next answer equals one of the same conversation read whole from its file. A "forget
    ..." that forgot nothing ("Forget it, tell me a joke.") is answered by the model, as any message."""
    from chat.session import Conversation
    from chat.view import status_line
    from chat.worker import Notice
    from decoding.events import FinishEvent, TokenEvent

    svc = started(config(tmp_path, "faiss"), tiny_llama)
    s, tok = svc.new_session("ada"), tiny_llama.tokenizer
    whole = GenerationSettings(max_new_tokens=32)
    answered = lambda events: ("".join(e.text for e in events if isinstance(e, TokenEvent)),  # noqa: E731
                               [e.reason for e in events if isinstance(e, FinishEvent)])
    try:
        drain(svc.chat(s, "Remember that my dog is called Rex.", [], SHORT, RECALL).request)
        events = drain(svc.chat(s, "Forget my dog.", [], whole, RECALL).request)
        reply = "Forgot: The user's dog is called Rex."
        assert answered(events) == (reply, ["stop"]) and not [e for e in events if isinstance(e, Notice)]
        shown = status_line(svc.state(s))  # (the model's speed of the answer before stayed on the line)
        assert svc.state(s).speed is None and "tokens/s" not in shown and "no answer yet" not in shown
        assert [(m.role, m.text) for m in s.conv.messages[-2:]] == [("user", "Forget my dog."), ("assistant", reply)]
        assert s.conv.ids[s.conv.messages[-1].start:] == tok(reply)["input_ids"] + [tok.eos_token_id]
        assert svc.run(my_memories, s) == []
        ids = list(s.conv.ids)
        assert answered(drain(svc.regenerate(s, whole, RECALL).request)) == (reply, ["stop"]) and s.conv.ids == ids

        events = drain(svc.chat(s, "Forget it, tell me a joke.", [], SHORT, RECALL).request)
        assert [e.note for e in events if isinstance(e, Remembered)] == [
            "Nothing to forget: you have not told me anything to remember yet"]
        assert not s.conv.messages[-1].said and answered(events)[1] == ["length"]  # (the model's 4 tokens)

        drain(svc.chat(s, "Remember that my cat is called Tom.", [], SHORT, RECALL).request)
        events = drain(svc.chat(s, "Forget my cat.", [], SHORT, RECALL).request)  # (4 tokens at most)
        cut = tok.decode(tok("Forgot: The user's cat is called Tom.")["input_ids"][:4])
        assert answered(events) == (cut, ["length"]) and s.conv.messages[-1].text == cut

        whole_conv = Conversation(tiny_llama)
        transcript.load(whole_conv, transcript.save(s.conv), tmp_path)
        assert whole_conv.ids == s.conv.ids and [m.said for m in whole_conv.messages] == [
            m.said for m in s.conv.messages]
        drain(svc.chat(s, "Hello there.", [], SHORT, RECALL).request)
        assert list(whole_conv.stream("Hello there.", settings=SHORT, recall=RECALL))
        assert whole_conv.ids == s.conv.ids and whole_conv.messages[-1].text == s.conv.messages[-1].text
    finally:
        svc.close()


@pytest.mark.parametrize("message", ["Forget my dog.", "Remember that my cat is called Tom."])
def test_a_message_stopped_before_its_answer_began_changes_no_memory(tiny_llama, tmp_path, monkeypatch, message):
    """(A "forget ..." stopped while its prompt was read still forgot, and the page said "stopped before it
    started".) The stop comes where a long prompt is read, before the write decision: nothing is written or
    forgotten, and the answer ends stopped."""
    from decoding.events import FinishEvent

    svc = started(config(tmp_path, "faiss"), tiny_llama)
    s = svc.new_session("ada")
    try:
        drain(svc.chat(s, "Remember that my dog is called Rex.", [], SHORT, RECALL).request)
        before = svc.run(my_memories, s)
        window = svc.window.slide

        def stopped_meanwhile(conv):
            svc.stop(s)
            yield from window(conv)

        monkeypatch.setattr(svc.window, "slide", stopped_meanwhile)
        events = drain(svc.chat(s, message, [], SHORT, RECALL).request)
        assert not [e for e in events if isinstance(e, Remembered)] and s.last_change is None
        assert [e.reason for e in events if isinstance(e, FinishEvent)] == ["interrupted"]
        assert svc.run(my_memories, s) == before and len(before) == 1
    finally:
        svc.close()


def test_with_remember_off_a_forget_is_told_it_changed_nothing(tiny_llama, tmp_path):
    """(The model answered "Forget about my sister." with "Your sister is called Lena.", and nothing said that
    messages change no memory with `memory.remember: off`.)"""
    from chat.worker import Notice

    svc = started(config(tmp_path, "faiss", "memory.remember=off"), tiny_llama)
    s = svc.new_session("ada")
    try:
        svc.run(remember, s, "My sister is called Lena.")
        events = drain(svc.chat(s, "Forget about my sister.", [], SHORT, RECALL).request)
        assert any("memory.remember: off): nothing was forgotten" in e.text for e in events if isinstance(e, Notice))
        assert [m["text"] for m in svc.run(my_memories, s)] == ["The user's sister is called Lena."]
        events = drain(svc.chat(s, "What is my sister's name?", [], SHORT, RECALL).request)
        assert not any("memory.remember" in e.text for e in events if isinstance(e, Notice))
    finally:
        svc.close()


def test_the_no_memory_notice_says_when_a_users_own_memories_were_not_read(tiny_llama, tmp_path):
    """("Actually it's Pocket not Rocket." from a user with memories said "there is no bank to read".)"""
    from chat.service import no_memory

    svc = started(config(tmp_path, "faiss"), tiny_llama)
    s = svc.new_session("ada")
    try:
        assert not svc.people.unread(tiny_llama, s.user, "Actually it's Pocket not Rocket.")  # nothing told yet
        drain(svc.chat(s, "Remember that my dog is called Rocket.", [], SHORT, RECALL).request)
        assert svc.people.unread(tiny_llama, s.user, "Actually it's Pocket not Rocket.")
        assert not svc.people.unread(tiny_llama, s.user, "What is my dog's name?")  # (read: it speaks of its author)
        # (a probe: "Tell me a joke." read the user's car into the joke; a request's "me" is not its author's own)
        assert svc.people.unread(tiny_llama, s.user, "Tell me a joke.")
        assert not svc.people.unread(tiny_llama, s.user, "What do you know about me?")
        assert "no bank to read for this message (your own memories are read for one that speaks of you" in \
            no_memory(None, RECALL, yours_unread=True)
        assert not svc.people.unread(tiny_llama, "bob", "Actually it's Pocket.")  # (another user's are not)
    finally:
        svc.close()


def test_an_import_lets_every_other_answer_go_on(tiny_llama, tmp_path):
    """(An import of 500 long memories held every user's chat for 15 s: it encoded all of them in one request.) It
    encodes a batch a worker round, so a chat sent after it began ends before it; its write is still all at once."""
    from chat.operations import import_memories

    svc = started(config(tmp_path, "faiss"), tiny_llama)
    ada, bob = svc.new_session("ada"), svc.new_session("bob")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps([f"My note number {i} says that the sea was calm on day {i}." for i in range(240)]))
    try:
        importing = svc.run(import_memories, ada, str(path))
        chat = svc.chat(bob, "Hello.", [], SHORT, RECALL).request
        drain(chat)
        assert chat.error is None and not importing.done.is_set()  # (bob's answer ended while ada's import encoded)
        imported = result(importing)
        assert imported.items == 240 and len(svc.run(my_memories, ada)) == imported.kept > 0
    finally:
        svc.close()


def test_a_users_memories_are_capped_by_name_and_nothing_is_written_past_it(tiny_llama, tmp_path):
    """(Imports could be repeated without end: 6.3 MB of one user's texts after five, in a header safetensors caps at
    100 MB.) `memory.max_user_memories`: a remember or an import past it is refused by name, writing nothing; an
    edit at it (one out, one in) is not."""
    from chat.operations import edit_memory, import_memories

    svc = started(config(tmp_path, "faiss", "memory.max_user_memories=3"), tiny_llama)
    s = svc.new_session("ada")
    try:
        for text in ("My dog is called Rex.", "I live in Porto."):
            result(svc.run(remember, s, text))
        events = drain(svc.chat(s, "Remember that my cat is Tom, and remember that my car is red.", [], SHORT,
                                RECALL).request)  # (both at once: named with the count held; the memories still read)
        said = [e.text for e in events if isinstance(e, Notice)]
        assert any("holds 2 memories, at most 3 (memory.max_user_memories): these 2 do not fit" in t for t in said)
        assert not any("answering without your memories" in t for t in said)
        result(svc.run(remember, s, "My sister is called Lena."))
        held = svc.run(my_memories, s)
        assert len(held) == 3
        with pytest.raises(ServiceError, match=r"^your memory holds 3 memories, at most 3 \(memory.max_user_memories\);"
                                               r" delete some under About you .*nothing was written$"):
            result(svc.run(remember, s, "My cat is called Tom."))
        path = tmp_path / "mine.json"
        path.write_text(json.dumps(["My boat is called Wave.", "My car is red."]))
        with pytest.raises(ServiceError, match="holds 3 memories, at most 3 .*: these 2 do not fit;"):
            result(svc.run(import_memories, s, str(path)))
        events = drain(svc.chat(s, "Remember that my cat is called Tom.", [], SHORT, RECALL).request)
        assert any("holds 3 memories, at most 3" in getattr(e, "text", "") for e in events)
        assert svc.run(my_memories, s) == held
        result(svc.run(edit_memory, s, held[0]["id"], "My dog is called Pocket."))
        assert len(svc.run(my_memories, s)) == 3
    finally:
        svc.close()


def test_a_users_folder_that_cannot_be_written_stops_the_start_and_one_lost_later_is_said(tiny_llama, tmp_path):
    """(A memory.user_dir that was a file, or read-only, started the app, then answered every message with a 500 and
    blamed POST /v1/memories' caller with a 400.)"""
    from chat.config import ConfigError

    (tmp_path / "a-file").write_text("hi")
    with pytest.raises(ConfigError, match=r"memory.user_dir '.*a-file': expected a folder this server can write "
                                          r"users' memories in, got a file"):
        Service(load_config(overrides=[f"memory.user_dir={tmp_path / 'a-file'}"], environ={}), tiny_llama)
    svc = started(config(tmp_path, "faiss"), tiny_llama)
    s = svc.new_session("ada")
    try:
        (tmp_path / "users").rename(tmp_path / "gone")
        (tmp_path / "users").write_text("now a file")  # (while the server runs)
        events = drain(svc.chat(s, "Remember that my dog is called Rex.", [], SHORT, RECALL).request)
        assert any("cannot be" in getattr(e, "text", "") and "answering without your memories" in e.text
                   for e in events)
        assert [e.reason for e in events if hasattr(e, "reason")][-1] in ("length", "stop")  # (the answer went on)
        with pytest.raises(ServiceError, match="cannot be"):
            result(svc.run(remember, s, "My cat is called Tom."))
    finally:
        svc.close()


def test_a_name_removed_and_added_again_starts_with_no_memories_and_the_old_ones_are_kept_aside(tiny_llama, tmp_path):
    """(A user added with the name of one removed, perhaps another person, read all the memories of the first, in a
    running server and after a restart.)"""
    from chat import users

    path = tmp_path / "users.json"
    users.add(path, "carol", "password1")
    cfg = config(tmp_path, "faiss", f"app.users_file={path}")
    svc = started(cfg, tiny_llama)
    try:
        result(svc.run(remember, svc.new_session("carol"), "My bank PIN is 4711."))
        assert len(svc.run(my_memories, svc.new_session("carol"))) == 1
        users.remove(path, "carol")
        users.add(path, "carol", "password2")
        assert svc.run(my_memories, svc.new_session("carol")) == []  # (the server that ran then)
        result(svc.run(remember, svc.new_session("carol"), "My dog is called Rex."))
    finally:
        svc.close()
    again = started(cfg, tiny_llama)  # (a restart: the new carol's, and the old one's still aside)
    try:
        mine = again.run(my_memories, again.new_session("carol"))
        assert [m["text"] for m in mine] == ["The user's dog is called Rex."]
    finally:
        again.close()
    (aside,) = (tmp_path / "users").glob("carol+removed-*")
    assert any("4711" in p.read_text(errors="ignore") for p in aside.glob("*.safetensors"))


def test_a_persons_memories_are_in_folders_no_other_account_reads(tiny_llama, tmp_path):
    """(A hostile probe: memory files 0644 in folders 0755, their PINs and passwords readable by every account.)"""
    import os
    import stat

    (tmp_path / "users" / "ada").mkdir(mode=0o755, parents=True)  # (as an older server left them)
    os.chmod(tmp_path / "users", 0o755)
    svc = started(config(tmp_path, "faiss"), tiny_llama)
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "users").st_mode) == 0o700
        s = svc.new_session("ada")
        result(svc.run(remember, s, "My bank PIN is 4711."))
        mine = svc.personal(s).path
        assert mine.is_file() and stat.S_IMODE(os.stat(mine.parent).st_mode) == 0o700
        result(svc.run(remember, svc.new_session("bob"), "My dog is called Rex."))
        assert stat.S_IMODE(os.stat(tmp_path / "users" / "bob").st_mode) == 0o700
    finally:
        svc.close()
    fresh = tmp_path / "fresh"
    started(config(fresh, "faiss"), tiny_llama).close()
    assert stat.S_IMODE(os.stat(fresh / "users").st_mode) == 0o700


def test_a_users_folder_or_owner_file_that_cannot_be_read_is_named(tiny_llama, tmp_path):
    """(A hostile probe: a damaged owner file said "cannot be read: Expecting value: line 2 column 1 (char 13)", a file
    in place of the folder "[Errno 17] File exists": neither named what.)"""
    import shutil

    from chat import users

    path = tmp_path / "users.json"
    users.add(path, "ada", "password1")
    svc = started(config(tmp_path, "faiss", f"app.users_file={path}"), tiny_llama)
    try:
        result(svc.run(remember, svc.new_session("ada"), "My dog is called Pocket."))
        folder = tmp_path / "users" / "ada"
        (folder / "owner.json").write_text('{"created": ')
        svc.people._open.clear()  # (as a restart would open it)
        with pytest.raises(ValueError, match=r"owner.json: expected a JSON object \{\"created\": <time>\}, got one "
                                             r"that cannot be read \(Expecting value"):
            svc.run(my_memories, svc.new_session("ada"))
        shutil.rmtree(folder)
        folder.write_text("not a folder")
        svc.people._open.clear()
        with pytest.raises(ValueError, match=r"ada: expected the folder of 'ada''s memories, got a file"):
            svc.run(my_memories, svc.new_session("ada"))
    finally:
        svc.close()


def test_a_users_file_broken_while_running_is_a_notice_and_the_answer_goes_on(tiny_llama, tmp_path):
    """(A review found a UsersError from `People.of` would fail a chat that only asked whether its user had
    memories.)"""
    from chat import users

    path = tmp_path / "users.json"
    users.add(path, "ada", "password1")
    svc = started(config(tmp_path, "faiss", f"app.users_file={path}"), tiny_llama)
    s = svc.new_session("ada")
    try:
        path.write_text('{"users": {"ada": "x"}}')
        events = drain(svc.chat(s, "Remember that my dog is called Rex.", [], SHORT, RECALL).request)
        assert any("cannot be read" in getattr(e, "text", "") for e in events)
        assert s.conv.messages[-1].role == "assistant" and not svc.people.unread(tiny_llama, s.user, "Hello there.")
    finally:
        svc.close()


def test_a_correction_reads_what_the_last_message_wrote_and_the_last_answer_recalled():
    """`Service.recent`: the memory texts a correction may correct, the last turn's: written by its message (an edit
    too), recalled in its answer; none before the first answer."""
    from types import SimpleNamespace

    answered = SimpleNamespace(role="assistant", recalls=[RecallEvent(0, 10, 0.84, 3, "The user's dog is Rex.")])
    s = SimpleNamespace(last_change=Remembered(written=({"id": "m1", "text": "The user's cat is Tom."},)))
    conv = SimpleNamespace(messages=[SimpleNamespace(role="user", recalls=[]), answered])
    assert Service.recent(s, conv) == {"The user's cat is Tom.", "The user's dog is Rex."}
    assert Service.recent(SimpleNamespace(last_change=None), SimpleNamespace(messages=[])) == frozenset()

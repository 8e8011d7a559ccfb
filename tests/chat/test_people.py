"""Each user's own memory through the user's own path: a users file made with `recall-users`, the real server on
the default model, the `openai` client for chat with two keys, plain HTTP for `/v1/memories`, and a restart."""

from __future__ import annotations

import httpx
import torch
import openai
import pytest

from chat import users
from chat.decision import decide
from models.remember import about_the_user
from test_app import serve

pytestmark = pytest.mark.slow
DOG = "The user's dog is a beagle called Pocket."


@pytest.fixture(scope="module")
def people(tmp_path_factory):
    folder = tmp_path_factory.mktemp("people")
    path = folder / "users.json"
    keys = {name: users.add(path, name, f"{name}-password") for name in ("ada", "bob")}
    return folder, path, keys


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "v1", api_key=key, max_retries=0, timeout=300)


def ask(api: openai.OpenAI, text: str):
    return api.chat.completions.create(model="recall-chat", messages=[{"role": "user", "content": text}],
                                       temperature=0, max_tokens=40)


def memories(url: str, key: str) -> httpx.Response:
    return httpx.get(url + "v1/memories", headers={"Authorization": f"Bearer {key}"}, timeout=300)


def test_each_user_remembers_their_own_and_keeps_it_across_a_restart(default_lm, people):
    folder, path, keys = people
    overrides = (f"app.users_file={path}", f"memory.user_dir={folder / 'memories'}")
    with serve(default_lm, *overrides) as server:
        url = server.url
        assert httpx.get(url + "v1/models").status_code == 401  # no key
        for key in ("rc-000000000000-" + "x" * 43, "not-a-key"):  # an unknown one, a malformed one
            assert httpx.get(url + "v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 401
            assert memories(url, key).status_code == 401
        ada, bob = client(url, keys["ada"]), client(url, keys["bob"])

        told = ask(ada, "Remember that my dog is a beagle called Pocket.")
        (written,) = told.model_extra["remembered"]
        assert written["text"] == DOG and written["id"].startswith("m-")
        assert [m["text"] for m in memories(url, keys["ada"]).json()["data"]] == [DOG]
        assert memories(url, keys["bob"]).json() == {"object": "list", "data": []}  # never another user's

        answer = ask(ada, "What is my dog's name?")
        assert "Pocket" in answer.choices[0].message.content
        assert [(r["text"], r["source"]) for r in answer.model_extra["recalls"]] == [(DOG, "yours")]
        assert "Pocket" not in ask(bob, "What is my dog's name?").choices[0].message.content
        nothing = ask(bob, "Forget about my dog.")  # (the note was the page's alone: the API said nothing)
        assert nothing.model_extra["forgotten"] == [] and "Nothing to forget" in nothing.model_extra["notices"][0]

        # bob cannot delete ada's memory: 404, and it is still hers
        gone = httpx.delete(url + f"v1/memories/{written['id']}", headers={"Authorization": f"Bearer {keys['bob']}"})
        assert gone.status_code == 404 and "no such memory of yours" in gone.text
        assert len(memories(url, keys["ada"]).json()["data"]) == 1

        added = httpx.post(url + "v1/memories", json={"text": "My sister is called Lena."},
                           headers={"Authorization": f"Bearer {keys['bob']}"}, timeout=300)
        assert added.status_code == 201 and added.json()["text"] == "The user's sister is called Lena."
        again = httpx.post(url + "v1/memories", json={"text": "My sister is called Lena."},
                           headers={"Authorization": f"Bearer {keys['bob']}"}, timeout=300)
        assert again.status_code == 200 and again.json()["duplicate"] is True  # not written twice
        bad = httpx.post(url + "v1/memories", json={"txt": "x"}, headers={"Authorization": f"Bearer {keys['bob']}"})
        assert bad.status_code == 400 and "text" in bad.text
        blank = httpx.post(url + "v1/memories", json={"text": "\u200b\u200b"},  # (a probe: kept as "\u200b\u200b.")
                           headers={"Authorization": f"Bearer {keys['bob']}"}, timeout=300)
        assert blank.status_code == 400 and "expected what to remember, got nothing" in blank.text
        assert blank.json()["error"]["param"] == "text"  # (it named no field)

    with serve(default_lm, *overrides) as server:  # a restart: a new server over the same folder
        url = server.url
        assert [m["text"] for m in memories(url, keys["ada"]).json()["data"]] == [DOG]
        assert "Pocket" in ask(client(url, keys["ada"]), "What is my dog's name?").choices[0].message.content
        forgot = ask(client(url, keys["ada"]), "Forget about my dog.")
        assert [m["text"] for m in forgot.model_extra["forgotten"]] == [DOG]
        assert memories(url, keys["ada"]).json()["data"] == []
        cleared = httpx.delete(url + "v1/memories", headers={"Authorization": f"Bearer {keys['bob']}"})
        assert cleared.json()["deleted"] == 1 and memories(url, keys["bob"]).json()["data"] == []

        # a change told in other words than the older memory (keys 0.49 similar: both kept), then asked about: the
        # newer is the one read (`memory.personal.Newest`)
        for said in ("Remember that I live in Porto.", "Remember that these days I live in Brackholm."):
            ask(client(url, keys["ada"]), said)
        assert len(memories(url, keys["ada"]).json()["data"]) == 2
        answer = ask(client(url, keys["ada"]), "Where do I live?")
        assert [r["text"] for r in answer.model_extra["recalls"]] == ["These days the user lives in Brackholm."]


def test_without_a_users_file_there_is_one_local_user_and_the_shared_key_still_works(default_lm, tmp_path):
    with serve(default_lm, "app.api_key=shared-secret", f"memory.user_dir={tmp_path}") as server:
        url = server.url
        assert memories(url, "wrong-key").status_code == 401
        told = ask(client(url, "shared-secret"), "Remember that I live in Porto.")
        assert [m["text"] for m in told.model_extra["remembered"]] == ["The user lives in Porto."]
        assert len(list((tmp_path / "local").glob("*.safetensors"))) == 1  # the local user's, for this model
        (path,) = (tmp_path / "local").glob("*.safetensors")
        path.write_bytes(path.read_bytes()[:300])  # damaged on the server: its error, not the request's
        listed = memories(url, "shared-secret")
        assert listed.status_code == 500 and listed.json()["error"]["type"] == "server_error"
        assert "expected a readable safetensors file" in listed.json()["error"]["message"]


@pytest.mark.parametrize("said,written", [
    ("Remember that my sister is called Lena", "The user's sister is called Lena."),
    ("please remember: I live in Porto.", "The user lives in Porto."),
    ("Remember I really like jazz", "The user really likes jazz."),
    ("remember that I\u2019ve got two cats", "The user has got two cats."),
    ("Remember that the ferry leaves at seven", "The ferry leaves at seven."),
    # (written as "Don't forget that the user's dog is called Rex.")
    ("Don't forget that my dog is called Rex.", "The user's dog is called Rex."),
    ("Please do not forget: I work nights.", "The user works nights."),
])
def test_remember_writes_what_follows_about_the_user(said, written):
    assert decide(said, "explicit").writes == (written,)
    assert decide(said, "off").writes == ()


@pytest.mark.parametrize("said,written", [
    # (each was written broken: "The user don't have a car.", "... and the user lives in Rome.", "The user myselfs
    # built ...", "The user haven't ...", "The user would been ...", "The user need ...", "The user taughts the user")
    ("I don't have a car.", "The user doesn't have a car."),
    ("We don't eat pork.", "The user doesn't eat pork."),
    ("I haven't been to Paris.", "The user hasn't been to Paris."),
    ("My wife and I live in Rome.", "The user's wife and the user live in Rome."),
    ("My brother and I are twins.", "The user's brother and the user are twins."),
    ("Lena and I are friends.", "Lena and the user are friends."),
    ("My wife and I've been married for ten years.", "The user's wife and the user have been married for ten years."),
    ("I and my wife live in Rome.", "The user and the user's wife live in Rome."),
    ("I myself built my own house.", "The user built the user's own house."),
    ("I myself am a doctor.", "The user is a doctor."),
    ("I taught myself Spanish.", "The user taught themselves Spanish."),
    ("I'd been to Paris twice.", "The user had been to Paris twice."),
    ("I'd like tea.", "The user would like tea."),
    ("I need a new car.", "The user needs a new car."),
    ("I no longer live in Porto.", "The user no longer lives in Porto."),
    ("Our kids visit us on Sundays.", "The user's kids visit the user on Sundays."),
    # as before: a clause of its own after "and", I'm / I've / am / was, the US
    ("I have two cats and I love them.", "The user has two cats and the user loves them."),
    ("My sister cooks and I clean.", "The user's sister cooks and the user cleans."),
    ("I'm not married.", "The user is not married."),
    ("I've got two cats", "The user has got two cats."),
    ("I am tired.", "The user is tired."),
    ("I was born in Lyon.", "The user was born in Lyon."),
    ("We moved to the US last year.", "The user moved to the US last year."),
    # (a probe: a Roman numeral or a letter "I" was the user: "World War the user", "type the user diabeteses")
    ("My grandfather fought in World War I.", "The user's grandfather fought in World War I."),
    ("I have type I diabetes.", "The user has type I diabetes."), ("I work for I.B.M.", "The user works for I.B.M."),
    ("My favourite king is Charles I.", "The user's favourite king is Charles I."),
    ("Louis I of France is my hero.", "Louis I of France is the user's hero."),
    ("In Paris I met Tom.", "In Paris the user met Tom."), ("Yesterday I went home.", "Yesterday the user went home."),
])
def test_a_first_person_statement_is_rewritten_about_the_user_in_good_grammar(said, written):
    assert about_the_user(said) == written


@pytest.mark.parametrize("said", ["What is my sister's name?", "remember me?", "Do you remember Lena?",
                                  "I live in Porto.", "Hello!"])
def test_questions_and_chit_chat_write_nothing(said):
    assert decide(said, "explicit") == decide("", "explicit")


def test_forget_names_what_to_forget():
    assert decide("Forget about my dog.", "explicit").forget == "my dog"
    # (asked politely, these were not commands: the model answered "Your dog is called Rex.")
    assert decide("Can you forget my dog?", "explicit").forget == "my dog"
    assert decide("Could you please forget where I live?", "explicit").forget == "where I live"
    assert decide("Do you forget things?", "explicit") == decide("", "explicit")
    assert about_the_user("my dog") == "The user's dog."


@pytest.fixture(scope="module")
def writer():
    from models.remember import WriteDecision
    from models.text_keys import TextEncoder

    decision, keys = WriteDecision.load(), TextEncoder()
    return lambda text: decision.wants(text, torch.from_numpy(keys.encode([text])[0]))


def test_auto_writes_what_people_tell_on_held_out_messages_and_not_questions_or_chit_chat(writer):
    from training.remember import messages

    texts, labels = messages("eval", 200)  # templates and names the decision never saw
    wrote = [decide(t, "auto", writer).writes != () for t in texts]
    told = [w for w, y in zip(wrote, labels) if y]
    other = [w for w, y in zip(wrote, labels) if not y]
    assert sum(told) / len(told) >= 0.95  # measured 0.98 (the misses: "I really like the colour teal.")
    assert sum(other) / len(other) <= 0.03  # measured 0.00
    for text in ["I live in Porto.", "My sister is called Lena.", "We are moving to Lisbon next month."]:
        assert decide(text, "auto", writer).writes == (about_the_user(text),)
    for text in ["What is my sister's name?", "Who wrote Romeo and Juliet?", "Hello!", "Thanks, that helps!",
                 "Write a haiku about rain."]:
        assert decide(text, "auto", writer) == decide("", "auto"), text
    assert decide("I live in Porto.", "explicit", writer).writes == ()  # explicit: only "remember ..."


def test_a_turn_embeds_its_message_once_in_one_batch(default_lm, tmp_path, monkeypatch):
    """The write decision's input and the memory head's query of a message that speaks of its author come from one
    batch of the message and its words about the user (what a turn's memory work adds to it: bench/user_memory)."""
    from chat.config import load_config
    from chat.people import People

    lm, calls = default_lm, []
    encode = lm.encoder.keys.encode
    monkeypatch.setattr(lm.encoder.keys, "encode", lambda texts, **kw: calls.append(list(texts)) or encode(texts, **kw))
    people = People(load_config(overrides=[f"memory.user_dir={tmp_path}"], environ={}))
    text = "What is my grey parrot's name, the one from Oslo?"
    assert people.decide(lm, text).writes == ()
    query = lm.encoder.message_query(text)  # the recall's query, after the decision
    assert calls == [[text, about_the_user(text)]]
    mine, about = (torch.from_numpy(encode([t])[0]) for t in (text, about_the_user(text)))
    torch.testing.assert_close(query, torch.nn.functional.normalize(mine + about, dim=-1))


def test_a_users_memory_that_cannot_be_written_is_the_servers_500_not_the_callers_400(tiny_llama, people, tmp_path):
    """(POST /v1/memories answered 400 invalid_request_error "NotADirectoryError: ..." for the server's own folder.)"""
    folder, path, keys = people
    mem = tmp_path / "mem"
    with serve(tiny_llama, f"app.users_file={path}", f"memory.user_dir={mem}") as server:
        mem.rmdir()
        mem.write_text("now a file")
        added = httpx.post(server.url + "v1/memories", json={"text": "My sister is called Lena."},
                           headers={"Authorization": f"Bearer {keys['bob']}"}, timeout=300)
        assert added.status_code == 500 and added.json()["error"]["type"] == "server_error"
        assert "cannot be" in added.json()["error"]["message"]
        assert memories(server.url, keys["bob"]).status_code == 500

"""What a person's words do to their memory, beyond the chat's own turn: "forget X" forgets the memory X is about and
none when nothing told is (the real key encoder and fit check), and the Remember box, `POST /v1/memories` and an
import write what "remember that ..." in the chat writes, refusing what the chat would not write."""

from __future__ import annotations

import json

import httpx
import pytest

from chat.config import load_config
from chat.operations import edit_memory, import_memories, my_memories, remember
from chat.corrections import corrected, correction
from chat.decision import Decision, decide, plain, to_remember
from chat.naming import forget_reading, to_forget
from chat.people import People
from chat.service import Service
from chat.worker import ServiceError
from memory.personal import Similar
from models.remember import about_the_user, asks, is_request
from test_app import serve
from tests_helpers import result

TOLD = ["My cat is called Whiskers.", "I work as a baker.", "My sister is called Lena."]
CAT, BAKER, SISTER = (about_the_user(t) for t in TOLD)


@pytest.fixture
def told(smollm2, tmp_path):
    """A person who told the three things, on the real model's memory encoder (the key encoder and its fit check)."""
    people = People(load_config(overrides=[f"memory.user_dir={tmp_path}"], environ={}))
    for text in TOLD:
        assert people.write(smollm2, "ada", about_the_user(text)).written
    return people


def texts(people: People, lm) -> list[str]:
    return sorted(e["text"] for e in people.of(lm, "ada").entries())


@pytest.mark.slow
@pytest.mark.parametrize("said", ["Forget about my brother.", "Forget about my job as a pilot.",
                                  "Forget about my hamster.", "Forget my address.", "Forget my wife.",
                                  "Forget about my dog.", "Forget that I live in Porto.", "Forget it.",
                                  "Forget about Mira.", "Forget my sister's address.", "Forget my sister's job.",
                                  "Forget my cat's age.", "Forget my sister's birthday.", "Forget where my sister lives.",
                                  "Forget the birthday of my sister."])
def test_forgetting_something_never_told_forgets_nothing(smollm2, told, said):
    """(Each of these forgot one of the three: the brother and the wife the sister, the pilot's job, the address and
    the dog the baker, the hamster the cat: the closest memory was deleted at a key similarity of 0.5; "my sister's
    address", "... job", "... birthday", "my cat's age" the sister and the cat: the word "sister" named the memory.)"""
    what = decide(said, "explicit").forget
    done = told.forget(smollm2, "ada", what)
    assert done.forgotten == () and done.note == f"Nothing to forget: no memory of yours is about {what!r}"
    assert texts(told, smollm2) == sorted([CAT, BAKER, SISTER])


def test_forgetting_everything_in_a_message_says_where_all_memories_are_forgotten(smollm2, told):
    """("forget everything you know about me" said "Nothing to forget", with no word of how to.)"""
    for said in ("Forget everything you know about me.", "forget all of it"):
        done = told.forget(smollm2, "ada", decide(said, "explicit").forget)
        assert done.forgotten == () and "use Forget everything under About you" in done.note
    assert texts(told, smollm2) == sorted([CAT, BAKER, SISTER])


@pytest.mark.slow
@pytest.mark.parametrize("said,gone", [("Forget about my cat.", CAT), ("Forget where I work.", BAKER),
                                       ("Forget my sister's name.", SISTER), ("Forget about Whiskers.", CAT),
                                       ("Forget my job.", BAKER), ("Forget that I work as a baker.", BAKER),
                                       ("Please forget what I told you about my sister.", SISTER)])
def test_forgetting_something_told_forgets_that_memory(smollm2, told, said, gone):
    done = told.forget(smollm2, "ada", decide(said, "explicit").forget)
    assert [e["text"] for e in done.forgotten] == [gone]
    assert texts(told, smollm2) == sorted({CAT, BAKER, SISTER} - {gone})


@pytest.mark.slow
@pytest.mark.parametrize("said,gone", [("Forget about my sister.", [SISTER, "The user's sister lives in Oslo."]),
                                       ("Forget my sister's name.", [SISTER]),
                                       ("Forget where my sister lives.", ["The user's sister lives in Oslo."]),
                                       ("Forget about my sister and my cat.",
                                        [SISTER, "The user's sister lives in Oslo.", CAT])])
def test_a_forget_takes_every_memory_it_names_and_no_other(smollm2, told, said, gone):
    """("Forget about my sister." with her name and her town told forgot one of them: the closest; "... my sister and
    my cat." forgot neither.) Every memory the request names and no word of it speaks against is forgotten; an
    attribute, the memory that says it; of each thing named."""
    assert told.write(smollm2, "ada", "The user's sister lives in Oslo.").written
    done = told.forget(smollm2, "ada", decide(said, "explicit").forget)
    assert sorted(e["text"] for e in done.forgotten) == sorted(gone)
    assert texts(told, smollm2) == sorted({CAT, BAKER, SISTER, "The user's sister lives in Oslo."} - set(gone))


@pytest.mark.slow
@pytest.mark.parametrize("told_too,said,gone", [
    (["The user lives in Porto.", "The user now lives in Lisbon."], "Forget where I live.",
     ["The user lives in Porto.", "The user now lives in Lisbon."]),
    (["The user's favourite colour is green.", "The user's favourite colour is now blue."],
     "Forget my favourite colour.",
     ["The user's favourite colour is green.", "The user's favourite colour is now blue."]),
    (["The user's landlord is called Olga."], "Forget where I live.", []),
    (["The user's office is in Oslo."], "Forget where I live.", []),
    (["The user's landlord Olga likes sushi and plays darts."], "Forget where I live.", []),
    (["The user's favourite colour is green.", "The user's sister's favourite colour is red."],
     "Forget my favourite colour.", ["The user's favourite colour is green."])])
def test_a_forget_takes_a_thing_told_twice_and_never_another_thing(smollm2, told, told_too, said, gone):
    """(A hostile probe: "Forget where I live." forgot "The user lives in Porto." and the next question read "The user
    now lives in Lisbon."; with nothing told of a home it forgot the landlord, or the office.) Every memory the fit
    check admits goes; a kind word ("live") must be said by the memory."""
    for text in told_too:
        assert told.write(smollm2, "ada", text).written
    done = told.forget(smollm2, "ada", decide(said, "explicit").forget)
    assert sorted(e["text"] for e in done.forgotten) == sorted(gone)
    assert texts(told, smollm2) == sorted({CAT, BAKER, SISTER, *told_too} - set(gone))


@pytest.mark.parametrize("what,memory,reads", [
    ("where I live", "The user's landlord is called Olga.", False),
    ("where I live", "The user's office is in Oslo.", False),
    ("my job", "The user's sister works as a nurse.", False), ("my name", "The user's dog is called Rex.", False),
    ("my job", "Lena's job is nurse.", False),
    ("my favourite colour", "The user's sister's favourite colour is red.", False),
    ("where I live", "The user lives in Porto.", True), ("my job", "The user's new job is clockmaker.", True),
    ("my pet", "The user's dog is called Rex.", True), ("my family", "The user's sister is called Lena.", True),
    # (a review: a kind word said in other words)
    ("my age", "The user is 34.", True), ("my hobbies", "The user plays chess.", True),
    ("where I live", "The user is from Porto.", True), ("where I live", "The user resides in Porto.", True),
    ("where I work", "The user teaches maths at a school.", True), ("my favourite colour", "The user likes blue.", True),
    ("my allergies", "The user cannot eat peanuts.", True), ("my pet", "The user has a snake called Sid.", True),
    ("my pets", "The user goes fishing.", False)])
def test_kind_words_alone_ask_of_the_user_in_any_words_the_kind_says(what, memory, reads):
    """(A hostile probe: "Forget where I live." forgot the landlord; once every admitted memory went, "my job" could
    take a sister's.) Kind words alone ("my job") ask it of the user, not of another thing of theirs nor of someone
    else."""
    assert forget_reading(what, memory)[0] is reads


@pytest.mark.parametrize("question,memory,another", [
    ("What is my mother's name?", "The user's sister is called Lena.", True),
    ("What is my father's name?", "The user's grandfather was born in 1942.", True),
    ("What is my goat called?", "The user's neighbour's goat is called Loki.", True),
    ("Where does my cousin Zelda live?", "The user's cousin Maya lives in Oslo.", True),
    ("Where does my boss live?", "The user's landlord Olga lives in Riga.", True),
    ("What is my phone number?", "The user's bank PIN is 4711.", True),
    ("What is my dog's name?", "The user's dog is a beagle called Pocket.", False),
    ("Who is my best friend?", "The user's best friend is called Tom.", False),
    ("Where does Lena live?", "The user's sister Lena lives in Oslo.", False),
    ("What is my daughter called?", "The user has a daughter called Mia.", False),
    ("What's my favourite colour?", "Green is the user's favourite colour.", False),
    ("Where do I live?", "The user lives in Porto.", False),
    ("What is my job?", "The user works as a baker.", False),
    ("Where does my cousin Zelda live?", "Maya is the user's cousin.", True),
    ("Where does my cousin Zelda live?", "The user's cousin lives in Oslo.", False),
    # (a review: these dropped the right memory: a capitalised word anywhere, one of two things, another word)
    ("Hi there. What is my name?", "The user's name is Sam.", False),
    ("Where do I live? I told you on Monday.", "The user lives in Porto.", False),
    ("What do I do for work, Recall?", "The user works as a baker.", False),
    ("What is MY name?", "Sam is my name.", False),
    ("What are the names of my dog and my cat?", "The user's cat is called Tom.", False),
    ("What should I get my sister for her birthday? She likes books.", "The user's sister loves books.", False),
    ("What's my wife's name?", "The user is married to Anna.", False),
    ("What is my mother's name?", "The user's mum is called Ann.", False),
    ("How old are my kids?", "The user's son is 5 years old.", False),
    ("What is my dog called?", "The user has a Labrador called Rex.", False)])
def test_a_question_reads_no_memory_about_another_thing_of_the_users(question, memory, another):
    """(A hostile probe: beside "The user's sister is called Lena." the fit check admitted it for "What is my mother's
    name?", answered "Lena"; the grandfather's birth for the father's name, a neighbour's goat for the user's.)"""
    from chat.naming import speaks_of_another

    assert speaks_of_another(question, memory) is another


@pytest.mark.parametrize("what,memory", [
    ("Tim", "The user goes swimming three times a week."), ("tim", "The user goes swimming three times a week."),
    ("Andrea", "The user's son is called Andrew."), ("Paris", "The user lives in a small parish."),
    ("Daniel", "The user's friend is called Danielle."), ("james", "The user loves jam."),
    ("my car", "The user cares about the climate."), ("my brother", "The user's brother-in-law is called Sam."),
    ("my dog", "The user's brother has a dog called Max."), ("my dog", "Lena's dog is called Max."),
    ("my sister's name", "The user's sister moved to Oslo last May.")])
def test_a_forget_names_no_memory_by_a_like_word_or_someone_elses_thing(what, memory):
    """(Each forgot its memory: "times" stemmed to "tim", "Andrea" and "Andrew" shared 5 letters, "brother-in-law"
    held "brother", "my dog" took the brother's dog, "last May" was a name.) A name is one word in one form, a
    hyphenated word is one word, "my X" is the user's own X."""
    assert forget_reading(what, memory) != (True, True) and to_forget(what, [memory], [0.9], [1.0]) == []


@pytest.mark.parametrize("what,memory", [
    ("my dog", "The user's dog is called Rex."), ("my dog", "The user has a dog called Rex."),
    ("my little dog", "The user's little dog is called Rex."), ("my cats", "The user's cat is called Whiskers."),
    ("Whiskers", "The user's cat is called Whiskers."), ("Paris", "The user lives in Paris."),
    ("my boxes", "The user keeps old box files."), ("my sister's name", "The user's sister is called Lena.")])
def test_a_forget_still_names_the_users_own_memory_in_another_form(what, memory):
    assert forget_reading(what, memory) == (True, True) and to_forget(what, [memory], [0.9], [1.0]) == [0]


@pytest.mark.parametrize("what,memory,means", [
    ("my mother's birthday", "The user's mother is called Ann.", False),
    ("my boss's birthday", "The user's boss is called Greg.", False),
    ("where my sister lives", "The user's sister is called Lena.", False),
    ("my sister's name", "The user's sister lives in Oslo.", False),
    ("my sister's job", "The user's sister lives in Oslo.", False),
    ("my dog's name", "The user's dog is 5 years old.", False),
    ("my sister's name", "The user's sister is called Lena.", True),
    ("the name of my sister", "Lena is the user's sister.", True),
    ("my sister's address", "The user's sister lives in Oslo.", True),
    ("my sister's job", "The user's sister is a nurse.", True),
    ("my dog's age", "The user's dog is 5 years old.", True),
    ("my mother's birthday", "The user's mother's birthday is in May.", True),
    ("my mother's birthday", "The user's mother was born in May.", True)])
def test_an_attribute_of_a_person_or_pet_is_forgotten_only_from_a_memory_that_says_it(what, memory, means):
    """("Forget my mother's birthday." forgot "The user's mother is called Ann.": a kind word ("birthday", "address",
    "job", "age") could be missing from the memory once "mother" was in it.)"""
    assert forget_reading(what, memory) == (means, True)
    assert (to_forget(what, [memory], [0.9], [1.0]) == [0]) is means


@pytest.mark.parametrize("sent,kind", [("What is my name?", "a question"), ("what is my name", "a question"),
                                       ("Where do I live", "a question"),
                                       ("Forget about my car.", "a command to forget"),
                                       ("Tell me about Port Avel's harbour.", "a request"), ("hello", "a single word"),
                                       ("Remember that", "a single word"),
                                       ("My cat is Tom, and forget my dog.", "more than one command")])
def test_what_the_chat_would_not_write_is_refused_naming_what_was_expected(sent, kind):
    with pytest.raises(ValueError, match=rf"^expected a statement to remember, such as .*, got {kind}: .*nothing was "
                                         "written$"):
        to_remember(sent)


@pytest.mark.parametrize("sent,memory", [("Remember that I hate olives.", "The user hates olives."),
                                         ("remember: my dog is called Rex", "The user's dog is called Rex."),
                                         ("The wifi password is hunter2.", "The wifi password is hunter2."),
                                         ("My name is Bob.", "The user's name is Bob."),
                                         ("When I was young I lived in Porto.",
                                          "When the user was young the user lived in Porto."),
                                         ("Remember:I like jazz.", "The user likes jazz."),  # (stored whole)
                                         ("私は猫が好きです。", "私は猫が好きです。")])  # (refused as "a single word")
def test_the_remember_box_writes_what_remember_that_writes_in_the_chat(sent, memory):
    assert to_remember(sent) == memory
    said = sent if sent.lower().startswith("remember") else f"Remember that {sent}"
    assert decide(said, "explicit").writes == (memory,)  # the chat's own "remember that ..."


def test_the_remember_box_and_an_import_refuse_a_question_or_a_command_and_write_nothing(tiny_llama, tmp_path):
    """("What is my name?" was kept as "What is the user's name?" and superseded "The user's name is Bob."; "Forget
    about my car." was kept as a memory; "Remember that I hate olives." as "Remember that the user hates olives.".)"""
    svc = Service(load_config(overrides=["model.compile=false", f"memory.user_dir={tmp_path / 'users'}"],
                              environ={}), tiny_llama)
    svc.people.similar = Similar(duplicate=0.99, supersede=0.985)  # (tiny keys: any two sentences are close)
    s = svc.new_session("ada")
    try:
        assert result(svc.run(remember, s, "My name is Bob.")).written[0]["text"] == "The user's name is Bob."
        for sent, kind in [("What is my name?", "a question"), ("Forget about my car.", "a command to forget"),
                           ("hello", "a single word")]:
            with pytest.raises(ServiceError, match=f"^text: expected a statement to remember, .*got {kind}"):
                svc.run(remember, s, sent)
        assert result(svc.run(remember, s, "Remember that I hate olives.")).written[0]["text"] == \
            "The user hates olives."
        path = tmp_path / "mine.json"
        path.write_text(json.dumps(["My boat is called Wave.", "Where do I live?"]))
        with pytest.raises(ServiceError, match=r"^mine.json: memory 2: expected a statement to remember, .*got a "
                                               r"question: 'Where do I live\?'.*nothing was written$"):
            svc.run(import_memories, s, str(path))
        path.write_text(json.dumps(["Remember that my boat is called Wave."]))
        assert result(svc.run(import_memories, s, str(path))).kept == 1
        bob = next(m for m in svc.run(my_memories, s) if "Bob" in m["text"])  # an edit into a question: refused
        with pytest.raises(ServiceError, match=r"^text: expected a statement to remember, .*got a question"):
            svc.run(edit_memory, s, bob["id"], "What is my name?")
        assert sorted(m["text"] for m in svc.run(my_memories, s)) == [
            "The user hates olives.", "The user's boat is called Wave.", "The user's name is Bob."]
    finally:
        svc.close()


def test_the_api_answers_a_question_sent_as_a_memory_with_a_400(tiny_llama):
    with serve(tiny_llama) as server:
        url = server.url + "v1/memories"
        asked = httpx.post(url, json={"text": "What is my name?"}, timeout=120)
        assert asked.status_code == 400
        assert "got a question: 'What is my name?'" in asked.json()["error"]["message"]
        told = httpx.post(url, json={"text": "Remember that I hate olives."}, timeout=120)
        assert told.status_code == 201 and told.json()["text"] == "The user hates olives."
        assert [m["text"] for m in httpx.get(url, timeout=120).json()["data"]] == ["The user hates olives."]


@pytest.mark.parametrize("said,writes,forget", [
    ("Forget my dog, and remember that my cat is called Tom.", ("The user's cat is called Tom.",), "my dog"),
    ("Remember that my cat is Tom; forget my dog.", ("The user's cat is Tom.",), "my dog"),
    ("Please forget my dog. Remember that I live in Porto.", ("The user lives in Porto.",), "my dog"),
    ("Forget my dog, but don't forget that my cat is Tom.", ("The user's cat is Tom.",), "my dog"),
    ("Remember that my cat is Tom, and remember that my dog is Rex.",
     ("The user's cat is Tom.", "The user's dog is Rex."), None),
    # one command, as before: a "forget" inside a statement, a list of things to forget, a second part no command
    ("Remember that I forget names easily.", ("The user forgets names easily.",), None),
    ("Forget my sister and my dog.", (), "my sister and my dog"),
    ("Forget my dog, and tell me a joke.", (), "my dog, and tell me a joke"),
    ("I love my dog and remember him fondly.", (), None),
    # (a review found these split: a forget of "my dreams", of "Paris", a memory "Every city.", "He is old.")
    ("Remember that I sleep badly and forget my dreams.", ("The user sleeps badly and forget the user's dreams.",),
     None),
    ("Remember that my favourite films are Memento, and Forget Paris.",
     ("The user's favourite films are Memento, and Forget Paris.",), None),
    ("Remember that I travel a lot and remember every city.", ("The user travels a lot and remember every city.",),
     None),
    ("Remember my dog is Rex. Note: he is old.", ("The user's dog is Rex. Note: he is old.",), None),
    ("Remember that I like the book Remember, Remember.", ("The user likes the book Remember, Remember.",), None),
    ("Forget where I live, and remember that I work in Lyon.", ("The user works in Lyon.",), "where I live"),
])
def test_a_message_of_several_commands_does_each(said, writes, forget):
    """("Forget my dog, and remember that my cat is Tom." did neither: all of it was what to forget, which no memory
    was; "Remember ... and remember ..." wrote one memory of both sentences, "... and remember the user's dog ...".)"""
    assert decide(said, "explicit") == Decision(writes, forget)


@pytest.mark.parametrize("text", ["I often work late and forget to eat lunch.",
                                  "The user's kids lose things and forget their keys.",
                                  "The user's dog is Rex. Note: he is old."])
def test_a_statement_with_forget_or_note_in_it_is_one_memory(text):
    """(A review found them refused as "more than one command": an import of an export holding one was refused.)"""
    assert to_remember(text)


@pytest.mark.parametrize("said,fix", [
    ("Actually it's Pocket, not Rocket.", ("Rocket", "Pocket")), ("No, Pocket not Rocket!", ("Rocket", "Pocket")),
    ("no its pocket not rocket", ("rocket", "pocket")), ("Sorry, I meant Lina, not Lena.", ("Lena", "Lina")),
    ("It's Tuesday, not Monday.", ("Monday", "Tuesday")), ("No, not Rocket, Pocket.", ("Rocket", "Pocket")),
    ("Sorry, not Lena but Lina.", ("Lena", "Lina")), ("I said Rocket but I meant Pocket.", ("Rocket", "Pocket")),
    ("Actually, it was Oslo and not Bergen.", ("Bergen", "Oslo")), ("No, New York not Boston", ("Boston", "New York")),
    ("It's a cat, not a dog.", ("a dog", "a cat")), ("No, it is my sister not my brother.", ("brother", "sister")),
    # (a review found the word before the name kept: "... is called called Pocket.", "... spelled Lina")
    ("Actually he's called Pocket, not Rocket.", ("Rocket", "Pocket")),
    ("It's spelled Lina, not Lena.", ("Lena", "Lina")),
    ("Sorry, I meant to say Pocket, not Rocket.", ("Rocket", "Pocket")),
    # a statement about the user's own after a mark: its last name, number, or words from the corrected ones' particle
    ("Actually my dog is called Pocket, not Rocket.", ("Rocket", "Pocket")),
    ("Actually my dog's called Pocket, not Rocket.", ("Rocket", "Pocket")),
    ("Actually my name is Ann, not Anna.", ("Anna", "Ann")), ("Sorry, my sister is Lina, not Lena.", ("Lena", "Lina")),
    ("Correction: my dentist is on Friday, not on Thursday.", ("on Thursday", "on Friday")),
    ("Actually my sister lives in New York, not Boston.", ("Boston", "New York")),
    ("Actually my son is 12, not 11.", ("11", "12")),
    # the same in the first person (left alone before: "Actually I live in Oslo, not Bergen." corrected nothing)
    ("Actually I live in Oslo, not Bergen.", ("Bergen", "Oslo")), ("Actually I'm 34, not 33.", ("33", "34")),
    ("No, I work at Google, not at Apple.", ("at Apple", "at Google")), ("No, I am 34, not 33.", ("33", "34")),
    ("Actually I moved to New York, not Boston.", ("Boston", "New York")),
    ("Actually I live in Oslo now, not Bergen.", None), ("Actually I live with Tom, not alone.", None),
    ("Actually I, not Bob.", None),
    # (a review: a wish, a question or a plan rewrote the last turn's memories; a name of two words was cut to one;
    # "I've got Rex" was kept whole as the new name)
    ("No, I want to go to Paris, not London.", None), ("No, I asked about Paris, not London.", None),
    ("Sorry, I prefer Tom, not Max.", None), ("No, I'll see Anna, not Lena.", None),
    ("Actually I'd rather visit Rome, not Berlin.", None),
    ("Sorry, I live in New York, not in Boston.", ("in Boston", "in New York")),
    ("Sorry, my sister lives in New York, not in Boston.", ("in Boston", "in New York")),
    ("Actually I've got Rex, not Max.", ("Max", "Rex")),
    # (a second probe: a denial, a plan, a name among others, a phrase twice, "not X Y" with no comma)
    ("No, I'm not from Paris, not London.", None), ("No, I don't live in Bergen, not Oslo.", None),
    ("No, I really want to go to Paris, not London.", None), ("No, I'm going to Paris, not London.", None),
    ("No, my plan is to visit Paris, not London.", None), ("Actually I met Tom in Oslo, not Anna.", None),
    ("Actually I moved to Bergen from Oslo, not Paris.", None), ("No, I live in Oslo in Norway, not in Bergen.", None),
    ("Actually I have a dog and a cat, not a hamster.", None), ("No, not Python again!", None),
    ("Nope, not Monday morning.", None),
    # a particle on one side only, as many words from the particle (a second review: "... is on on Friday.")
    ("Actually it's on Friday, not Thursday.", ("Thursday", "Friday")), ("No, it's at 5, not 4.", ("4", "5")),
    ("No, it's Oslo, not in Bergen.", ("in Bergen", "in Oslo")),
    ("Correction: my dentist is on Friday at 3, not on Thursday.", ("on Thursday", "on Friday")),
    # none: no mark nor lead, not about the user's own, words that name nothing, nothing given instead, a guess (the
    # review: "... not the user." made every memory "the assistant's ...", "ice cream" gave "cream")
    ("Tea, not coffee.", None), ("I like tea, not coffee.", None), ("Actually I want tea, not coffee.", None),
    ("No, that is not true.", None), ("No, not really.", None), ("That's fine, not a problem.", None),
    ("It is not Rocket.", None), ("No, not me.", None), ("It's not that, it's this.", None),
    ("No, it's the assistant, not the user.", None), ("It's Bob, not the user.", None), ("It's a, not the.", None),
    ("It's an, not a.", None), ("It's or, not and.", None), ("Wait, on not in.", None),
    ("Actually it's Pocket, not -", None), ("Actually my favourite food is ice cream, not pizza.", None),
    ("Actually my son is 12 years old, not 11.", None), ("Actually my dog is a golden retriever, not labrador.", None),
    ("No, it's Ann's, not the user's.", None), ("Actually it's mine, not the user’s.", None),  # (every memory)
    ("No, it was Tom, not her.", None), ("Actually it's Pocket, not Rocket's.", None),
    ("No " * 40 + "no!", None), ("No, it is Pocket" + " " * 20_000 + "x", None)])  # (a run of "no"s took 8 s for 22)
def test_a_correction_is_read_from_its_words(said, fix):
    assert correction(said) == fix
    assert decide(said, "explicit") == (Decision(correct=fix) if fix else Decision())


def test_a_correction_writes_in_auto_mode_what_it_would_without_and_remember_that_keeps_its_words():
    """(A correction wrote nothing in `auto` mode, though the message was worth keeping; "Remember that it's Tuesday,
    not Monday." wrote nothing, and an import holding such a memory was refused.)"""
    said = "Actually my dog is called Pocket, not Rocket."
    assert decide(said, "auto", lambda text: True) == Decision(
        correct=("Rocket", "Pocket"), unless_corrected=("Actually the user's dog is called Pocket, not Rocket.",))
    assert decide(said, "auto", lambda text: False) == Decision(correct=("Rocket", "Pocket"))
    assert decide("Remember that it's Tuesday, not Monday.", "explicit") == Decision(("It's Tuesday, not Monday.",))
    assert to_remember("It's Tuesday, not Monday.") == "It's Tuesday, not Monday."


@pytest.mark.parametrize("memory,old,new,fixed", [
    ("The user's dog is called Rocket.", "Rocket", "Pocket", "The user's dog is called Pocket."),
    ("rocket sleeps on the sofa; Rocket is old.", "rocket", "pocket", None),  # (twice: which one is meant?)
    ("The user's flight leaves at 2 pm on May 2.", "2", "3", None),
    ("The user's daughter Rose loves rose gardens.", "Rose", "Lily", "The user's daughter Lily loves rose gardens."),
    ("The user's sister lives in New  York.", "New York", "Boston", "The user's sister lives in Boston."),
    ("Rocket's bed is blue.", "Rocket", "Pocket", "Pocket's bed is blue."),
    ("The user's dog is called Rocket.", "rocket", "pocket", "The user's dog is called Pocket."),  # (the name's case)
    ("The user’s friend is O’Brian.", "O'Brian", "Kelly", "The user’s friend is Kelly."),  # (either apostrophe)
    ("The dog is called 'Rocket'.", "Rocket", "Pocket", "The dog is called 'Pocket'."),
    ("The user likes rocketry.", "Rocket", "Pocket", None),  # (whole words only)
    ("The user's sister-in-law is called Lena.", "sister", "brother", None),
    ("Write to rocket@example.com, see rocket.com or /home/rocket/.", "rocket", "pocket", None),
    ("The user supports Manchester City.", "City", "Manchester United", None)])  # (a probe: "Manchester Manchester")
def test_a_correction_changes_whole_words_of_a_memory(memory, old, new, fixed):
    assert corrected(memory, old, new) == fixed


def test_a_memory_is_kept_without_invisible_or_control_characters():
    """(A probe: "Remember that" and two zero-width spaces wrote the memory "That\u200b\u200b.", `POST /v1/memories`
    took "\u200b\u200b" as a memory, and "\x00\x07" stayed in "The user's pin is \x00\x07 1234.")"""
    assert plain("my pin is \x00\x07 1234.\u200b\u202e") == "my pin is 1234."
    family = "Family: \U0001F468\u200d\U0001F469\u200d\U0001F467"
    assert plain(family) == family
    # (a review: what spells was taken out too: Persian's and Indic's non-joiner, a flag's tags)
    scotland = "\U0001F3F4\U000E0067\U000E0062\U000E0073\U000E0063\U000E0074\U000E007F"
    for spelled in ("\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", "\u0915\u094d\u200c\u0937", scotland):
        assert plain(spelled) == spelled
    assert to_remember("Remember that my pin is \x00\x07 1234.") == "The user's pin is 1234."
    for empty in ("\u200b\u200b", "Remember that \u200b", "\ufeff \x00", "Remember that ,,,", "Remember that 42",
                  "Remember that \U0001F642"):  # (a second probe: each was kept as a memory)
        with pytest.raises(ValueError, match="expected a statement to remember.*got"):
            to_remember(empty)
    assert decide("Remember that\u200b\u200b", "explicit") == Decision()
    assert decide("Remember that my pin is \x00\x07 1234.", "explicit") == Decision(("The user's pin is 1234.",))


MANY = " ".join(f"My friend number {i} is called Ann." for i in range(13))


@pytest.mark.parametrize("said,explicit,auto", [
    # (a probe: "My friend Ana is a pilot. My friend Bo is a cook. ..." wrote nothing: the write decision judged it
    # whole)
    ("Remember that my niece is called Lena. My nephew is called Tom.",
     ("The user's niece is called Lena.", "The user's nephew is called Tom."), None),
    ("My niece is called Lena. My nephew is called Tom.", (),
     ("The user's niece is called Lena.", "The user's nephew is called Tom.")),
    ("My friend Ana is a pilot. My friend Bo is a cook. I am a poet.", (),
     ("The user's friend Ana is a pilot.", "The user's friend Bo is a cook.", "The user is a poet.")),
    # whole, as before (a review: each of these split lost its meaning or said what is false): a sentence that leans
    # on the one before, a question or a request among them, quoted words, a mark that ends no sentence
    ("I have a cat. I love her.", (), ("The user has a cat. The user loves her.",)),
    ("My wife is Anna. We met in 2010.", (), ("The user's wife is Anna. The user met in 2010.",)),
    ("I moved to Oslo in 2020. Before that I lived in Bergen.", (),
     ("The user moved to Oslo in 2020. Before that the user lived in Bergen.",)),
    ("I'm vegan. Just kidding, I'm not.", (), ("The user is vegan. Just kidding, the user is not.",)),
    ("I live in Porto. Where is the nearest beach?", (), ()),
    ("Remember that I hate spoilers. Tell me if a review has spoilers.",
     ("The user hates spoilers. Tell the user if a review has spoilers.",), None),
    ('I said "Hi. My name is Bob." to him.', (), ('The user said "Hi. The user\'s name is Bob." to him.',)),
    ("My doctor is Dr. Smith. She works in St. Ives.", (), ("The user's doctor is Dr. Smith. She works in St. Ives.",)),
    ("I climbed Mt. Everest in 2019 with my brother.", (), ("The user climbed Mt. Everest in 2019 with the user's "
                                                             "brother.",)),
    ("I like fruit, e.g. I eat apples daily.", (), ("The user likes fruit, e.g. the user eats apples daily.",)),
    ("Remember that I love J. K. Rowling.", ("The user loves J. K. Rowling.",), None),
    ("Remember that my niece is Lena; my nephew is Tom.", ("The user's niece is Lena; the user's nephew is Tom.",),
     None),
    ("My son is 5. I am 35.", (), ("The user's son is 5.", "The user is 35.")),
    ("I have a dog named Rex. I speak French.", (), ("The user has a dog named Rex.", "The user speaks French.")),
    ("I'm Tom. I love you.", (), ("The user is Tom. The user loves you.",)),  # (the second is about the assistant)
    # (a second probe: a sentence that takes back, frames or leans on the one before was split into a false memory)
    ("I have a dog. I'm joking, I don't.", (), ("The user has a dog. The user is joking, the user doesn't.",)),
    ("I'm 25. I'm kidding, I'm 40.", (), ("The user is 25. The user is kidding, the user is 40.",)),
    ("My sister is Anna. I meant Lena.", (), ("The user's sister is Anna. The user meant Lena.",)),
    ("I had a weird dream last night. My teeth fell out.", (),
     ("The user had a weird dream last night. The user's teeth fell out.",)),
    ("I'm writing a novel. My main character is a detective.", (),
     ("The user is writing a novel. The user's main character is a detective.",)),
    ("I used to live in Paris. I don't anymore.", (), ("The user used to live in Paris. The user doesn't anymore.",)),
    ("I moved to Oslo. I love the city.", (), ("The user moved to Oslo. The user loves the city.",)),
    ("My mom always says 'Be kind. I love you.' to me.", (),
     ("The user's mom always says 'Be kind. The user loves you.' to the user.",)),
    (MANY, (), (about_the_user(MANY),))])  # (over MOST_STATEMENTS: whole)
def test_each_sentence_about_the_user_is_a_memory_of_its_own(said, explicit, auto):
    assert decide(said, "explicit").writes == explicit
    statement = lambda text: not asks(text) and not is_request(text)  # noqa: E731 - the write decision's part here
    assert decide(said, "auto", statement).writes == (explicit if auto is None else auto)


@pytest.mark.parametrize("said,writes", [
    ("If I had a dog, I would call it Max.", ()), ("Imagine I lived in Paris.", ()),
    ("Remember that if I won the lottery I would buy a boat.", ()), ("Suppose I were a pilot.", ()),
    ("If I'm late, I take the bus.", ("If the user is late, the user takes the bus.",)),
    ("Remember that, if I had a dog, I'd call it Max.", ()),
    # (a review: "Imagine Dragons" is a band, and a condition in the past a habit)
    ("Imagine Dragons is my favourite band.", ("Imagine Dragons is the user's favourite band.",)),
    ("If I got sick as a kid, my mum made soup.", ("If the user got sick as a kid, the user's mum made soup.",)),
    ("I'd like to visit Japan one day.", ("The user would like to visit Japan one day.",)),
    ("I live in Porto.", ("The user lives in Porto.",))])
def test_what_would_be_is_not_remembered_and_what_is_on_a_condition_is(said, writes):
    """(A hostile probe: "If I had a dog, I would call it Max." was written as a memory.)"""
    assert decide(said, "auto", lambda text: True).writes == writes
    if not writes:
        with pytest.raises(ValueError, match="got a (hypothetical|request)"):
            to_remember(said)

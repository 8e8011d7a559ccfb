"""bench/user_memory.py's simulated users and verdicts (pure: no model)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench._users import Ask, ask_for, contains, is_junk, judge, make_users, says_not_told  # noqa: E402
from training.personal import Told  # noqa: E402
from bench.user_memory import history_prompt, summarize, told_before  # noqa: E402


def test_saying_it_was_not_told():
    for answer in ("You haven't told me your sister's name.", "You have not told me where you live.",
                   "I don't know what your job is.", "You didn\u2019t tell me.", "I'm not sure.",
                   "I don't have any information about your dog."):
        assert says_not_told(answer), answer
    for answer in ("Your sister is called Lena.", "You live in Porto.", "The capital is Paris."):
        assert not says_not_told(answer), answer


def test_junk():
    for answer in ("", "   ", "<recall>:<recall>:", ":::", "<|memory_pad|> Lena", "?! ...", "user\nYou play tennis.",
                   "assistant\n"):
        assert is_junk(answer), answer
    for answer in ("Paris.", "William Shakespeare wrote it.", "4", "The user's sister is Lena."):
        assert not is_junk(answer), answer


def test_values_are_whole_words_in_any_case():
    assert contains("Your favourite colour is Red.", "red")
    assert not contains("It was redone.", "red")
    assert contains("You live in Port Vinmere now.", "Port Vinmere")


def test_verdicts_on_hand_made_answers():
    assert judge(Ask("cross", "What's my cat's name?", "Gind"), "Your cat is called Gind.")
    assert not judge(Ask("cross", "What's my cat's name?", "Gind"), "Your cat is called Mittens.")
    colour = ask_for(Told("colour", "Red is my favourite colour.", ("What's my favourite colour?",), "", "red", ""),
                     "cross", random.Random(0))
    assert judge(colour, "Your favourite colour is red.")
    assert not judge(colour, "Is it blue, red or green?")  # a list of guesses names other colours
    update = Ask("update", "Where is my home?", "Maesmere", ("Furkholm",))
    assert judge(update, "You live in Maesmere.")
    assert not judge(update, "You lived in Furkholm and now in Maesmere.")
    abstain = Ask("abstain", "What's my sport?", None, ("Gind", "red"))
    assert judge(abstain, "You haven't told me which sport you play.")
    assert not judge(abstain, "You haven't told me, but your cat Gind might know.")
    assert not judge(abstain, "You play tennis.")
    general = Ask("general", "What is the capital of France?", r"\bparis\b")
    assert judge(general, "The capital of France is Paris.") and not judge(general, "<recall>Paris")
    near = Ask("near", "What colour is my boat?", None, ("green",))  # (after "My favourite colour is green.")
    assert judge(near, "You haven't told me the colour of your boat.") and not judge(near, "Your boat is green.")
    leak = Ask("leak", "What's my goat's name?", None, ("Gind",))
    assert judge(leak, "You haven't told me your goat's name.") and not judge(leak, "Your goat is Gind.")


def test_users_are_the_same_for_a_seed_and_hold_every_category():
    users = make_users(3, seed=5)
    again = make_users(3, seed=5)
    assert [u.earlier() for u in users] == [u.earlier() for u in again]
    for user in users:
        assert 3 <= len(user.told) <= 4 and len(user.distractors) == 2
        old, new = user.changed
        assert old in user.told and new.value != old.value and new.tell in user.earlier()
        assert {a.category for a in user.later} == {"cross", "update", "abstain", "near", "general", "leak"}
        assert all(t.tell in user.earlier(2) for t in user.told)
        assert all(m.role == "chit" for conv in user.conversations for m in conv[::2])  # chit-chat around each tell
        assert [m.role for m in user.conversations[2]] == ["chit", "update", "chit"]


def test_anchor_prompts():
    assert told_before([], "Q?") == "Q?"
    assert told_before(["a", "b"], "Q?") == "Things I told you before:\n- a\n- b\n\nQuestion: Q?"
    count = lambda text: {"input_ids": text.split()}  # noqa: E731  (a word a token)
    kept = history_prompt(count, ["one two three", "four", "five six"], "Q?", budget=14)
    assert kept == told_before(["four", "five six"], "Q?")


def test_summary_counts_writes_and_verdicts():
    records = [{"system": "recall", "role": "tell", "written": ["x"]},
               {"system": "recall", "role": "update", "written": [], "superseded": []},
               {"system": "recall", "role": "chit", "written": []},
               {"system": "recall", "category": "leak", "ok": True, "written": []},
               {"system": "recall", "category": "general", "ok": False, "junk": True, "written": []}]
    column = summarize(records, "recall")
    assert column["write recall"] == {"k": 1, "n": 2, "rate": 0.5}
    assert column["update supersedes the old"] == {"k": 0, "n": 1, "rate": 0.0}
    assert column["false writes"]["k"] == 0 and column["leaks"]["k"] == 0
    assert column["general junk"]["k"] == 1 and column["cross-session"]["n"] == 0

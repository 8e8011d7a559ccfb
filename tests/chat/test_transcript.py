"""Saved conversations load back exactly, and hostile files are refused whole, with the field named; nothing
changes (`chat.transcript`)."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest

from chat import transcript
from chat.session import Conversation
from chat.transcript import encode_vector
from decoding.settings import GenerationSettings, RecallSettings
from memory import MemoryVectorDB


@pytest.fixture
def saved(tiny_llama, tmp_path):
    """A real saved conversation with one recalled memory."""
    lm = tiny_llama
    bank = MemoryVectorDB(lm.hidden_size)
    bank.add(np.random.default_rng(0).normal(size=(3, lm.hidden_size)).astype(np.float32), ["a", "b", "c"])
    conv = Conversation(lm)
    list(conv.stream("Remember", settings=GenerationSettings(max_new_tokens=4), recall=RecallSettings(),
                     memory_db=bank, recall_first=True))
    assert conv.memory
    return json.loads(transcript.save(conv))


def load(lm, data, tmp_path) -> Conversation:
    conv = Conversation(lm)
    transcript.load(conv, json.dumps(data), tmp_path)
    return conv


def test_a_saved_conversation_loads_back_exactly(tiny_llama, saved, tmp_path):
    conv = load(tiny_llama, saved, tmp_path)
    assert conv.ids == saved["ids"] and [m.text for m in conv.messages] == [m["text"] for m in saved["messages"]]
    assert sorted(conv.memory) == sorted(int(p) for p in saved["memory"])


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(ids=[1] * 3_000_000), "fewer than 512 tokens"),
    (lambda d: d["ids"].__setitem__(3, -5), "token ids must be >= 0"),
    (lambda d: d["ids"].__setitem__(3, 10 ** 9), "below the vocabulary size"),
    (lambda d: d["messages"][0].update(text=42), "messages.0.text"),
    (lambda d: d["messages"][1].update(start="7"), "messages.1.start"),
    (lambda d: d.update(system_prompt=["be", "a", "cat"]), "system_prompt"),
    (lambda d: d["messages"][1]["recalls"][0].update(position="x"), "messages.1.recalls.0.position"),
    (lambda d: d["messages"][1]["recalls"][0].update(position=0), "expected positions of <|memory_pad|>"),
    (lambda d: d["messages"][1]["recalls"].append({"oops": 1}), "messages.1.recalls.1"),
    (lambda d: d.update(memory={"1": next(iter(d["memory"].values()))}), "expected a position holding <|memory_pad|>"),
    (lambda d: d.update(memory={}), "expected a vector for every <|memory_pad|>"),
    (lambda d: d.update(memory={k: encode_vector(__import__("torch").full((64,), float("nan")))
                                for k in d["memory"]}), "expected finite values"),
    (lambda d: d.update(memory={k: base64.b64encode(b"short").decode() for k in d["memory"]}), "float32 values"),
    (lambda d: d["messages"][0].update(images=["/etc/passwd"]), "images"),
    (lambda d: d["messages"].reverse(), "messages"),
    (lambda d: d.update(format="recall-chat/conversation-1"), "format"),
    (lambda d: d.update(extra=1), "extra"),
    # the page showed the edited question while the model answered the one its ids hold
    (lambda d: d["messages"][0].update(text="What colour is the bakery door?"),
     re.escape("messages.0.text: expected the text its ids hold, got 'What colour is the bakery door?' where")),
    (lambda d: d.update(system_prompt="You are a pirate."), "system_prompt: expected the system prompt its ids hold"),
    # ids of another tokenizer decode to other words here
    (lambda d: d.update(ids=[(t + 7) % 40000 for t in d["ids"]]), "messages.0.text: expected the text its ids hold"),
    # (each of these loaded: a question left without its answer, then saved twice in a row and refused at its load;
    # text the page never shows, which the model read; an answer the page showed from its ids and Regenerate said
    # from its edited text; an injection the recall log never showed)
    (lambda d: d["messages"].pop(), re.escape("ending with an answer, got ['user']")),
    (lambda d: d["messages"][0].update(text=d["messages"][0]["text"][:3]),
     "ids: expected the tokens the messages make with the chat template, got other tokens from position"),
    (lambda d: d["messages"][1].update(said=True, text="Forgot: every one of your memories."),
     "messages.1.text: expected the text its ids hold, got 'Forgot: every one of your memories.'"),
    (lambda d: (d["ids"].__setitem__(1, d["ids"][int(next(iter(d["memory"])))]),
                d["memory"].update({"1": next(iter(d["memory"].values()))})),
     r"memory: expected every <\|memory_pad\|> position in a recall of an answer, got 1 in none: \[1\]"),
])
def test_hostile_files_are_refused_and_the_conversation_is_untouched(tiny_llama, saved, tmp_path, change, message):
    conv = load(tiny_llama, saved, tmp_path)
    before = (list(conv.ids), [m.text for m in conv.messages], dict(conv.memory))
    bad = json.loads(json.dumps(saved))
    change(bad)
    with pytest.raises(ValueError, match=message):
        transcript.load(conv, json.dumps(bad), tmp_path)
    assert (conv.ids, [m.text for m in conv.messages], conv.memory.keys()) == (before[0], before[1], before[2].keys())


def test_ids_before_the_first_message_are_refused(tiny_llama, tmp_path):
    """(A file with no messages and the ids of a whole turn loaded as an empty conversation the model read.)"""
    conv = Conversation(tiny_llama)
    list(conv.stream("The secret password is Zorblax.", settings=GenerationSettings(max_new_tokens=3)))
    data = json.loads(transcript.save(conv))
    data["messages"] = []
    with pytest.raises(ValueError, match="ids: expected the tokens the messages make with the chat template, got "
                                         "other tokens from position 0"):
        load(tiny_llama, data, tmp_path)


def test_a_long_text_and_its_ids_text_are_shown_where_they_differ():
    """(A probe's file whose message started one token late was shown as the message's start beside the end of the
    ids' text: the difference, at the start, in neither.)"""
    from chat.transcript import _around_difference

    text = "The most important thing in life is not what you have but how you spend it, said my grandmother."
    got, holds = _around_difference(text, "user\n" + text[4:] + "<|im_end|>")  # (one token late)
    assert got.startswith("'The most important") and holds.startswith("'user\\nmost important")
    got, holds = _around_difference(text, "user\n" + text.replace("how you spend", "what you do with"))
    assert got == "'...t what you have but how you spend it, said my grandmother.'"
    assert holds.startswith("'...t what you have but what you do with it")

"""The write decision never writes a request to the assistant or a question without its "?" (the shipped decision
over the real key encoder's embeddings, as the chat decides), and still writes what people tell."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from chat.decision import decide
from models.remember import WriteDecision, about_the_user, asks, is_request, mentions_the_user

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


@pytest.fixture(scope="module")
def decision():
    from models.text_keys import TextEncoder

    shipped, keys = WriteDecision.load(), TextEncoder()
    score = lambda text: shipped.score(torch.from_numpy(keys.encode([text])[0]))  # noqa: E731
    return shipped, score, lambda text: shipped.wants(text, torch.from_numpy(keys.encode([text])[0]))


@pytest.mark.parametrize("text", ["Tell me about Port Avel's harbour.", "Tell me about my options for a mortgage."])
def test_a_request_that_scores_as_a_fact_is_not_written(decision, text):
    """(Both were written: "Tell the user about Port Avel's harbour.")"""
    shipped, score, wants = decision
    assert score(text) >= shipped.threshold  # the score alone would write it
    assert is_request(text) and decide(text, "auto", wants).writes == ()


@pytest.mark.parametrize("text", ["Give me a recipe for pancakes.", "Help me write an email to my boss.",
                                  "Show me how to train my dog.", "Explain how my boiler works.",
                                  "Write a poem about my cat Whiskers.", "Can you plan my week in Lisbon.",
                                  "Could you recommend a book about sailing.", "Please summarise the history of Porto.",
                                  "I'd like you to plan my trip to Rome.", "What is my name", "Where do I live",
                                  "Do I have a cat",
                                  # (written, then read for "What is my name?": "What's the user's name.")
                                  "what's my name", "Where's my car", "Who's my doctor", "whats my dog called",
                                  "How's my sister", "what my name is", "I'd like to know my dog's name.",
                                  "I want to know where I live.", "I wonder whether my sister likes jazz."])
def test_requests_and_questions_are_never_written(decision, text):
    _, _, wants = decision
    assert asks(text) or is_request(text)
    assert decide(text, "auto", wants).writes == ()


@pytest.mark.parametrize("text", ["I live in Porto.", "My sister is called Lena.",
                                  "We are moving to Lisbon next month.",
                                  "When I was young I lived in Porto.", "Will is my brother.",
                                  "Writing is my hobby.", "Show jumping is my sport.", "I work as a baker.",
                                  "What I love most is jazz.", "What my sister likes is jazz.",
                                  "What's more, my dog is called Rex.", "I wonder about things.",
                                  # (a review found these read as questions: never written)
                                  "I need to know French for my job.", "I want to know how to sail one day.",
                                  "I'd like to know Spanish better someday.", "Where my heart is."])
def test_what_people_tell_is_neither_a_question_nor_a_request(text):
    assert not asks(text) and not is_request(text)


def test_held_out_requests_are_not_written_and_held_out_facts_are(decision):
    """bench/memory_commands.py's write sets: 120 held-out requests (33 were written before), the user bench's told
    things and chit-chat, and training.remember's held-out facts."""
    from bench.memory_commands import write_sets

    _, _, wants = decision
    sets = write_sets(1)
    written = {name: [decide(t, "auto", wants).writes != () for t in texts] for name, texts in sets.items()}
    rate = {name: sum(w) / len(w) for name, w in written.items()}
    assert rate["held-out requests (false writes)"] == 0.0
    assert rate["user bench: told things (write recall)"] == 1.0  # measured 52/52, before and after
    assert rate["user bench: chit-chat (false writes)"] == 0.0
    assert rate["training.remember eval: facts"] >= 0.97  # measured 0.975, before and after
    assert rate["training.remember eval: others"] == 0.0
    for text in ["I live in Porto.", "My sister is called Lena."]:
        assert decide(text, "auto", wants).writes == (about_the_user(text),)


@pytest.mark.parametrize("text,mine", [
    ("Tell me a joke.", False), ("Show us a picture of a cat.", False), ("Explain me the rules of chess.", False),
    ("What colour is the sky?", False), ("What do you know about me?", True), ("Tell me my dog's name.", True),
    ("Tell me about myself.", True), ("Where do I live?", True), ("Do you remember me?", True),
    ("Tell me what you know about me.", True), ("Show me where I live.", True),
    # (a review: these lost the user's memories, which bear on them: "The user is vegan.")
    ("Recommend me a restaurant.", True), ("Find me a hotel in Rome.", True), ("Cats make me sneeze.", True),
    ("Help me decide what to eat tonight.", True),
    # (a second probe: asking what the assistant knows of its author is about them)
    ("Tell me what you remember.", True), ("Write me a bio based on what you know.", True),
    ("Read me the notes you have.", True),
    # (the country is no one: "What is the capital of the US?" read the user's memories)
    ("What is the capital of the US?", False), ("Where do the US and Canada meet?", False),
    ("Can you help us?", True), ("Us two live in Porto.", True), ("WHAT DO YOU KNOW ABOUT US?", True)])
def test_a_requests_me_is_not_a_message_about_its_author(text, mine):
    """(A hostile probe: "Tell me a joke." read the user's "The user's car is a blue Volvo." into the joke: its "me"
    made it a message about its author, whose memories it then reads.)"""
    assert mentions_the_user(text) is mine


def test_reading_a_message_for_its_author_looks_back_a_few_characters_a_me(monkeypatch):
    """(A review: each "me" searched the text before it from its start: "get me " 3,000 times took 3.7 s.) What each
    "me" reads of the text before it is counted, not timed."""
    from models import remember

    read = []

    class Counted:
        def search(self, text, pos, endpos):
            read.append(endpos - pos)
            return asked.search(text, pos, endpos)

    asked = remember._ASKED_OF
    monkeypatch.setattr(remember, "_ASKED_OF", Counted())
    assert not mentions_the_user(("tell me " * 3000)[:20000])
    assert len(read) == 2500 and max(read) <= 12

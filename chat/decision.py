"""What a message asks of its author's memory, read from its words: remember something (a sentence, or several:
`statements`), forget something, correct a word of it ("Actually it's Pocket, not Rocket.": `chat.corrections`), or
nothing (`decide`). Pure functions over text; which memories a "forget ..." or a question names is `chat.naming`'s,
and `chat.people` does what they decide."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

from chat.corrections import correction
from models.remember import about_the_user, asks, is_request, mentions_the_user

REMEMBER = re.compile(r"^\s*(?:please\s*,?\s+)?(?:remember|note|keep in mind|don['’]?t forget|do not forget)"
                      r"(?:\s+that)?(?:\s*[,:]\s*|\s+)(?P<what>.+?)\s*$", re.I | re.S)
FORGET = re.compile(r"^\s*(?:(?:can|could|would|will) you\s+)?(?:please\s*,?\s+)?forget"
                    r"(?:\s+(?:that|about|what i said about|what i told you about))?\s*[,:]?\s+(?P<what>.+?)\s*$",
                    re.I | re.S)
# a second command after the first, after a clause's punctuation ("Forget my dog, and remember that my cat is Tom."):
# each part its own command; a "forget" or "remember" inside a statement is none ("Remember that I forget names.",
# "... I sleep badly and forget my dreams.", "... the films Memento and Forget Paris.")
_NEXT_COMMAND = re.compile(r"\s*[,;.!]\s*(?:(?:and|but|then|and then)\s+)?"
                           r"(?=(?:please\s*,?\s+)?(?:remember|forget|keep in mind|don['’]?t forget|do not forget)\b)",
                           re.I)
# a part "forget ..." of several commands names something of the user's ("my ...", "where I ...", "about ..."):
# "Forget Paris" after a comma is a title's words, not a command
_NAMED = re.compile(r"^\s*(?:please\s*,?\s+)?forget\s+"
                    r"(?:about\s+|that\s+|what\s+i\s+(?:said|told\s+you)\s+about\s+)?"
                    r"(?:my|where|when|how|who|what|which|the\s+user)\b", re.I)


@dataclass(frozen=True)
class Decision:
    """What a message asks of its author's memory."""

    writes: tuple[str, ...] = ()  # the memories to write (already about the user), in order
    forget: str | None = None  # what to forget (first)
    correct: tuple[str, str] | None = None  # (the words to correct, the words they become) in the last turn's memories
    unless_corrected: tuple[str, ...] = ()  # what to write when the correction corrects none (`auto`'s write)

    def __bool__(self) -> bool:
        return bool(self.writes or self.forget or self.correct)


# what would be, not what is: "If I had a dog, I would call it Max." (a hostile probe: written as a memory); not a
# real condition ("If I'm late, I take the bus.": a habit), nor one in the past ("If I got sick as a kid, my mum made
# soup."): an "if" clause with "would" (or "could", "might") after it, or "imagine that", "suppose I", "what if"
_HYPOTHETICAL = re.compile(r"\s*(?:(?:even )?if\b[^.!?]*?(?:\b(?:would|could|might)\b|['\u2019]d\b)"
                           r"|(?:imagine|suppose|supposing|pretend)(?: that| if| I| we)\b|what if\b)", re.I)


def hypothetical(text: str) -> bool:
    """Whether a statement (or "remember that" one) says what would be (`_HYPOTHETICAL`)."""
    m = None if FORGET.match(text) else REMEMBER.match(text)
    return bool(_HYPOTHETICAL.match((m["what"] if m else text).lstrip(" ,")))


def refusal(what: str) -> str | None:
    """Why `what` (a message, or what follows its "remember (that)") is not a memory to write: a question, a request
    to the assistant, a command to forget, more than one command, a hypothetical, a single word; None when it is
    one."""
    if FORGET.match(what):
        return "a command to forget"
    if _several(f"Remember that {what}"):
        return "more than one command"
    if asks(what):
        return "a question"
    if is_request(what):
        return "a request"
    if hypothetical(what):
        return "a hypothetical"
    if len(what.split()) < 2 and re.fullmatch(r"[A-Za-z'.!-]+", what):  # (a script without spaces is not one word)
        return "a single word"
    if not re.search(r"[^\W\d_]", what):  # (",,,", "42", an emoji: a probe kept each as a memory)
        return "no words"
    return None


_KEPT_FORMAT = "\u200c\u200d\u200e\u200f"  # the (non-)joiners of Persian, Indic and emoji spelling; LRM, RLM


def plain(text: str) -> str:
    """`text` as a memory keeps it: one line, control characters as spaces, invisible format characters (zero-width
    spaces, bidirectional overrides, a byte-order mark) gone but those that spell (`_KEPT_FORMAT`, an emoji flag's
    tags), runs of spaces as one (a probe: "Remember that" and two zero-width spaces wrote the memory
    "That\u200b\u200b.", and "\x00\x07" stayed in one)."""
    return " ".join("".join(" " if unicodedata.category(c) == "Cc" else c for c in text
                            if c in _KEPT_FORMAT or "\U000e0000" <= c <= "\U000e007f"
                            or unicodedata.category(c) != "Cf").split())


def to_remember(text: str) -> str:
    """The memory the Remember box, `POST /v1/memories` and each item of an import write: `text` as "remember ..."
    in the chat writes it (a leading "remember (that)" goes; the rest in the third person). `ValueError` naming what
    was expected and what came for what the chat would not write either: a question ("What is my name?" was kept
    as a memory and superseded "The user's name is Bob."), a request ("Tell me about Porto."), a "forget ..." (kept as
    a memory; nothing forgotten), a single word."""
    text = plain(text).strip()
    m = None if FORGET.match(text) else REMEMBER.match(text)
    what = m["what"] if m else text
    if not what.strip():
        raise ValueError(f"expected a statement to remember, such as \"My dog is called Pocket.\", got "
                         f"{'nothing' if not text else repr(text)}; nothing was written")
    why = refusal(what)
    if why is not None:
        shown = what if len(what) <= 60 else what[:57] + "..."
        hint = {"a command to forget": " (say it in the chat, or delete the memory from the list)",
                "a question": " (ask it in the chat)", "a request": " (ask it in the chat)",
                "more than one command": " (one memory at a time here; the chat takes several)"}.get(why, "")
        raise ValueError(f"expected a statement to remember, such as \"My dog is called Pocket.\", got {why}: "
                         f"{shown!r}{hint}; nothing was written")
    return about_the_user(what)


def _several(text: str) -> list[Decision] | None:
    """The commands of `text` when it is several ("Forget my dog, and remember that my cat is Tom."), each part
    one a command would be alone (a forget naming something of the user's, a statement to remember), at most one
    forget; else None."""
    parts = [p for p in _NEXT_COMMAND.split(text.strip()) if p]
    if len(parts) < 2:
        return None
    each = [_one(p) for p in parts]
    forgets = [p for p, d in zip(parts, each) if d.forget]
    if not all(each) or len(forgets) > 1 or any(not _NAMED.match(p) for p in forgets):
        return None
    return each


# where a statement about the user begins another: after ".", "!" or "?" and a space, before "My", "I", "I'm", "I've"
# (a letter alone before the mark is an initial or "e.g.": no end; "Dr. Smith" is no end either, "I climbed Mt.
# Everest" has no "I" after its mark)
_SENTENCE_END = re.compile(r"(?<=[.!?])(?<!\b[A-Za-z]\.)(?<!\bDr\.)(?<!\bMr\.)(?<!\bMrs\.)(?<!\bMs\.)(?<!\bSt\.)"
                           r"\s+(?=(?:My|I|I['’]m|I['’]ve)\b)")
# a statement of one of the user's attributes, a sentence alone: "My friend Ana is a pilot.", "I am a poet.", "I live
# in Porto." (what a message of several is split into memories by; anything else keeps it whole)
_ATTRIBUTE = re.compile(r"(?:my [\w'’ -]+? (?:is|are|was|were)|i['’]m|i am|i live|i work|i was born|i grew up"
                        r"|i['’]ve got|i have got|i have|i own|i speak|i play|i study|i like|i love|i hate|i drive)"
                        r" [^.!?]+[.!]?", re.I)
# a word that makes a sentence no fact alone: it leans on the one before ("I have a cat. I love her."), denies, takes
# back or frames it ("I have a dog. I'm joking, I don't.", "I had a dream. My teeth fell out.", "I'm writing a novel.")
_NOT_ALONE = frozenset("""it its itself he him his she her hers they them their theirs we us our ours there that this
these those then before after later same too also either neither both each other one ones so such not never no nor
you your yours
kidding joking lying pretending wish wished hope hoped mean meant think thought guess maybe perhaps probably if would
will could should might may used dream dreamt dreamed dreaming story novel character imagine pretend
anymore""".split())
MOST_STATEMENTS = 12  # sentences one message writes as memories of their own; a longer one is judged whole


def sentences(text: str) -> list[str]:
    """`text` cut where a statement about the user begins another ("My niece is Lena. My nephew is Tom." -> two)."""
    return [part for part in _SENTENCE_END.split(text.strip()) if part.strip()]


def statements(text: str) -> list[str] | None:
    """The sentences of `text` to keep as memories of their own: when it has several (at most `MOST_STATEMENTS`),
    each a plain statement of an attribute of the user's (`_ATTRIBUTE`) that stands alone ("My niece is Lena. My
    nephew is Tom.": a probe's eight "My friend ... is a ..." wrote nothing, two wrote one memory); None to judge it
    whole, as before: anything else ("I have a cat. I love her.", "My wife is Anna. We met in 2010.", "I'm 25. I'm
    kidding, I'm 40.", "I'm writing a novel. My main character is a detective."), quoted words."""
    if re.search(r"[\"“”«»]|(?:^|[\s(])['‘]\w", text):
        return None
    each = sentences(text)
    if not 1 < len(each) <= MOST_STATEMENTS:
        return None
    words = lambda one: {w.strip("'’").lower() for w in re.findall(r"[\w'’]+", one)}  # noqa: E731
    alone = all(_ATTRIBUTE.fullmatch(one.strip()) and not words(one) & _NOT_ALONE
                and not re.search(r"n['’]t\b|\bi['’]m \w+ing\b", one, re.I) for one in each)
    return each if alone else None


def _one(text: str) -> Decision:
    """One command: "forget X", or "remember X" whose X is a statement to remember (or several: `statements`)."""
    if m := FORGET.match(text):
        return Decision(forget=m["what"].rstrip(".!?"))
    if m := REMEMBER.match(text):
        if (each := statements(m["what"])) is not None and all(refusal(one) is None for one in each):
            return Decision(tuple(map(about_the_user, each)))
        if refusal(m["what"]) is None:
            return Decision((about_the_user(m["what"]),))
    return Decision()


def decide(text: str, mode: str, wants: Callable[[str], bool] | None = None) -> Decision:
    """The write decision of `memory.remember`: "forget ..." and "remember ..." always (unless `off`), also several
    in one message ("Forget my dog, and remember that my cat is Tom.": at most one "forget", done first), and a
    correction ("Actually it's Pocket, not Rocket.": the last turn's memories that say "Rocket" say "Pocket" instead);
    with `auto`, any other message `wants` (the write decision model) says is worth keeping (a correction's: when it
    corrects none)."""
    text = plain(text)
    if mode == "off" or not text:
        return Decision()
    if each := _several(text):
        return Decision(tuple(w for d in each for w in d.writes), next((d.forget for d in each if d.forget), None))
    if one := _one(text):
        return one
    wanted = tuple(about_the_user(one) for one in statements(text) or [text]
                   if not hypothetical(one) and wants(one)) \
        if mode == "auto" and wants is not None else ()  # (each statement judged alone: its own memory, or none)
    if fix := correction(text):
        return Decision(correct=fix, unless_corrected=wanted)
    return Decision(wanted)

"""Corrections of what the last turn remembered or recalled ("Actually it's Pocket, not Rocket."): which words a
message corrects and what it gives instead (`correction`), and a memory's text with them (`corrected`). Pure functions
over text; `chat.decision.decide` reads a message with them and `chat.people.People.correct` changes the memories."""

from __future__ import annotations

import re

# a correction of what the last turn remembered or recalled (`chat.people.People.correct`): "Actually it's Pocket, not
# Rocket.", "No, Pocket not Rocket!", "Sorry, I meant Lina, not Lena.", "It's called Pocket, not Rocket.", "No, not
# Rocket, Pocket.", "I said Rocket but I meant Pocket.", "Actually my name is Ann, not Anna.", "Correction: my
# dentist is on Friday, not on Thursday."; read from a short message (`_LONGEST`, its spaces collapsed) that has a mark
# ("actually", "no", "sorry", ...) or a lead ("it's", "I meant"); what it corrects is one to four words, what it gives
# instead as few, or, in a statement about the user's own ("my ..."), its last name, number or phrase from the
# particle the corrected words begin with; none with words that name nothing ("No, that is not true.", "It's a, not
# the.", "..., not the user."): a correction is never a guess
_W = r"[\w'’-]+"
_PHRASE = rf"{_W}(?: {_W}){{0,3}}?"
# (each repeat of a mark begins with a word and ends in punctuation: one way to read it, so a run of "no no no ..."
# reads in linear time; a mark that could end in spaces or punctuation either way took seconds for 22 "no"s)
_MARK = r"(?P<mark>(?:(?:actually|no|nope|sorry|oops|wait|correction|my (?:bad|mistake))\b[ ,:;!.-]*)+)"
_LEAD = (r"(?P<lead>(?:it|that|he|she|they)(?:['’]?s| is| was|['’]re| are| were)(?: (?:called|named|spelled|spelt))?"
         r"|i meant(?: to say)?|i mean)")
_CORRECTIONS = [re.compile(p, re.I) for p in (
    rf"^{_MARK}?(?:{_LEAD} )?(?P<new>{_W}(?: {_W}){{0,7}}?),? (?:and )?not (?P<old>{_PHRASE})[.!]*$",
    rf"^{_MARK}?(?:{_LEAD} )?not (?P<old>{_PHRASE})(?:[,;] |,? but )(?:it['’]s |i meant )?(?P<new>{_PHRASE})[.!]*$",
    rf"^{_MARK}?(?P<lead>i said) (?P<old>{_PHRASE}),? (?:but )?i meant (?P<new>{_PHRASE})[.!]*$")]
_LONGEST = 200  # characters of a message read for a correction (a correction is short)
_VAGUE = frozenset("""is was are were am be been being not it its it's that this these those so too very really quite
i i'm me you he she they we him her his hers them their theirs us our ours your yours mine my there here true false
right wrong correct yes no sure all any some one more less fine ok okay problem matter deal thanks user users
assistant""".split())  # (words that name nothing a memory says, a possessive's "'s" aside)
_PARTICLES = frozenset("in at on to from by with for of the a an".split())
_FUNCTION = _PARTICLES | {"and", "or", "but", "nor", "as", "than"}
# how a statement about the user's own begins ("my sister ...", "I live ...")
_OWN = frozenset({"my", "i", "i'm", "i’m", "i've", "i’ve"})
# what a statement about the user's own says that is no fact of theirs to correct with: a wish, a question, a plan, a
# denial ("No, I want to go to Paris, not London." rewrote "The user's sister lives in London.", "No, I'm not from
# Paris, not London." made the user from Paris)
_NO_FACT = frozenset("""want wanted wants wanna wish asked ask prefer meant mean said say think thinking thought guess
hope hoping need would will could should might may going gonna plan plans planning planned dream dreams idea rather
not never no nor i'll i’ll i'd i’d""".split())


def _value(statement: list[str], old: list[str]) -> list[str] | None:
    """The words of a statement about the user's own ("my sister lives in Oslo", "I live in Oslo") that a correction
    gives in place of `old`: from the particle `old` begins with ("in Bergen": "in Oslo"), its last number for a
    number, the run of capitalised words it ends with for a name ("New York"); None when it ends in no such thing
    ("my son is 12 years old" for "11", "my favourite food is ice cream" for "pizza": not a guess)."""
    first = old[0].lower()
    if first in _PARTICLES:  # (a name's capitalised words, else as many words: "on Friday at 3" for "on Thursday" is
        at = [i for i, w in enumerate(statement) if w.lower() == first]  # "on Friday", "in New York" for "in Boston")
        if len(at) != 1:  # (none, or which one? "I live in Oslo in Norway, not in Bergen.")
            return None
        if len(old) > 1 and old[1][:1].isupper():
            end = at[0] + 1
            while end < len(statement) and statement[end][:1].isupper():
                end += 1
            return statement[at[0]:end] if end > at[0] + 1 else None
        return statement[at[0]:at[0] + len(old)]
    if all(re.fullmatch(r"\d+(?:[.,]\d+)?", w) for w in old):
        return statement[-1:] if re.fullmatch(r"\d+(?:[.,]\d+)?", statement[-1]) else None
    if old[0][:1].isupper() and statement[-1][:1].isupper():
        start = len(statement) - 1
        while start > 1 and statement[start - 1][:1].isupper():
            start -= 1
        named = [w for w in statement[1:start] if w[:1].isupper() and w.lower() not in _OWN]
        return None if named else statement[start:]  # (one name in it, or which one? "I met Tom in Oslo, not Anna.")
    return None


def correction(text: str) -> tuple[str, str] | None:
    """(the words a correction corrects, the words it gives instead) when `text` is one ("Actually it's Pocket, not
    Rocket." -> ("Rocket", "Pocket"); see `_CORRECTIONS`), else None."""
    text = " ".join(text.split())
    if len(text) > _LONGEST:
        return None
    for pattern in _CORRECTIONS:
        if not ((m := pattern.match(text)) and (m["mark"] or m["lead"])):
            continue
        old, new = m["old"].split(), m["new"].split()
        if (new[0].lower() in _OWN or new[0].lower() in _NO_FACT) and any(  # ("I'll see Anna": a plan)
                w.lower() in _NO_FACT or re.search(r"n['’]t$", w.lower()) for w in new):
            continue
        if new[0].lower() in _OWN and len(new) > 1 and not (len(old) > 1 and old[0].lower() == "my"):
            if not m["mark"] or (new := _value(new, old)) is None:  # (a statement about the user's own)
                continue
        elif len(new) > 4:
            continue
        if len(old) == len(new) > 1 and old[0].lower() == new[0].lower() == "my":  # (memories say "the user's")
            old, new = old[1:], new[1:]
        if len(new) > 1 and new[0].lower() in _PARTICLES and old[0].lower() not in _PARTICLES:
            new = new[1:]  # ("it's on Friday, not Thursday": "on Thursday" would read "on on Friday")
        elif len(old) > 1 and old[0].lower() in _PARTICLES and new[0].lower() not in _PARTICLES:
            new = [old[0], *new]  # ("it's Oslo, not in Bergen": "in Oslo")
        words = [re.sub(r"'s$", "", w.lower().replace("’", "'")) for w in old + new]
        if " ".join(old).lower() != " ".join(new).lower() and not set(words) & _VAGUE \
                and not re.search(r"['’]s$", old[-1]) \
                and not set(w.lower() for w in old) <= _FUNCTION and not set(w.lower() for w in new) <= _FUNCTION \
                and all(re.search(r"[^\W_]", w) for w in old + new):
            return " ".join(old), " ".join(new)
    return None


def corrected(memory: str, old: str, new: str) -> str | None:
    """`memory` with the whole words `old` (either apostrophe; in any case when typed in lower case, else as typed)
    as `new`, or None when it does not say `old` once ("The user's dog is called Rocket." -> "... Pocket."; not
    "Rocketry", "rocket@example.com", "/home/rocket/", the "rose" of "rose gardens" for "Rose", nor "at 2 pm on May
    2" for "2": which one is meant?). `new` typed in lower case takes the title case of a name it replaces
    ("pocket" for "Rocket": "Pocket")."""
    words = [re.sub(r"['’]", "['’]", re.escape(w)) for w in old.split()]
    pattern = re.compile(r"(?<![\w@/-])" + r"\s+".join(words) + r"(?![\w@-])(?![./]\w)", re.I if old.islower() else 0)
    found = pattern.findall(memory)
    if len(found) != 1:
        return None
    said = found[0]
    instead = new.title() if new.islower() and said == said.title() and said != said.lower() else new
    fixed = pattern.sub(lambda _: instead, memory)
    # a word the new words repeat is left ("Manchester City" for "City": "Manchester Manchester United")
    doubled = lambda text: re.search(r"\b(\w+) \1\b", text, re.I) is not None  # noqa: E731
    return None if doubled(fixed) and not doubled(memory) else fixed

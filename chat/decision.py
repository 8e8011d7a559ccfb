"""What a message asks of its author's memory, read from its words: remember something (a sentence, or several:
`statements`), forget something, correct a word of it ("Actually it's Pocket, not Rocket.": `chat.corrections`), or
nothing (`decide`), and which of their memories a "forget ..." means (`to_forget`). Pure functions over text, scores
and fit probabilities; `chat.people` does what they decide."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from chat.corrections import correction
from models.remember import about_the_user, asks, is_request, mentions_the_user

REMEMBER = re.compile(r"^\s*(?:please\s*,?\s+)?(?:remember|note|keep in mind|don['’]?t forget|do not forget)"
                      r"(?:\s+that)?(?:\s*[,:]\s*|\s+)(?P<what>.+?)\s*$", re.I | re.S)
FORGET = re.compile(r"^\s*(?:(?:can|could|would|will) you\s+)?(?:please\s*,?\s+)?forget"
                    r"(?:\s+(?:that|about|what i said about|what i told you about))?\s*[,:]?\s+(?P<what>.+?)\s*$",
                    re.I | re.S)
# "Forget X" forgets the memory X is about, and none when no memory is (`to_forget`); measured on held-out requests
# by bench/memory_commands.py (docs/benchmarks.md, "Forget"): the top-1 at 0.5 it replaces forgot a memory for about a
# third of the requests about something never told ("Forget about my brother." forgot the sister)
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
FORGET_FLOOR = 0.3  # the least key similarity of a memory to X for the fit check to be asked whether it is about X
FORGET_ALONE = 0.7  # with no fit check for this model's keys: the least key similarity alone
FORGET_CANDIDATES = 1024  # the memories "forget X" is read against, closest first


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


# words of "forget X" that say nothing of what X is
_NOT_CONTENT = frozenset("""a an the my mine me i i'm i've i'd i'll we we're our ours us myself you your yours he she it
they them his her its their about that this these those what which where who whom whose how when why is am are was
were be been being do does did done to of in at on for with from by and or but as so than then there here all any some
everything anything something user said say told tell mentioned know knew just also really please again ever now
anymore more thing things stuff bit one has have had having got get gets""".split())
# words that name what a memory is about without being in it: "Forget my job." is about "The user works as a baker."
# when the fit check says so; any other word of X must be in the memory ("Forget about my job as a pilot." is not)
_KIND_WORDS = frozenset("""name names called named call job jobs work works worked working profession occupation career
living live lives lived home house flat town city place address favourite favorite colour color colours allergy
allergies allergic sport sports play plays playing pet pets birthday age hobby hobbies like likes love loves
family""".split())


_WORD = r"[a-z0-9]+(?:-[a-z0-9]+)*(?:'[a-z]+)?"  # ("brother-in-law" is one word, not "brother")


def _content(text: str) -> list[str]:
    words = re.findall(_WORD, text.lower().replace("\u2019", "'"))
    return [w for w in (re.sub(r"'s?$", "", w) for w in words) if w and w not in _NOT_CONTENT]


def _proper(text: str, sentence: bool = True) -> set[str]:
    """The words of `text` written capitalised (past its first word when it is a `sentence`), lower-cased: names
    ("Lena", "Paris"), which are one word in one form only."""
    words = re.findall(r"[\w'’-]+", text)
    return {re.sub(r"['’]s?$", "", w).lower() for w in words[sentence:] if w[:1].isupper()}


def _stem(word: str) -> str:
    for end in ("ing", "ed", "es", "s"):
        if word.endswith(end) and len(word) - len(end) >= 3 and (end != "es" or re.search(r"(?:[sxz]|[cs]h)es$", word)):
            return word[:-len(end)]  # (not "times" -> "tim": "es" after a hissing sound only, "boxes", "wishes")
    return word


def _same_word(a: str, b: str, names: set[str] = frozenset()) -> bool:
    """One word in two forms: "work" / "works", "cat" / "cats", "allergy" / "allergic" (not "teal" / "team",
    "grandmother" / "grandfather", "brother" / "brother-in-law"). A name (`names`) in one form only: "Tim" is not
    "times", "Andrea" not "Andrew", "Paris" not "parish"."""
    if a == b:
        return True
    if a in names or b in names or "-" in a + b:
        return False
    if _stem(a) == _stem(b):
        return True
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return common >= max(5, min(len(a), len(b)) - 2)


def _someone_elses(word: str, memory: str) -> bool:
    """Whether a memory gives `word` to someone other than the user: "The user's brother has a dog called Max." for
    "my dog" ("brother has a dog", "Lena's dog"), not "The user's dog is called Rex." or "The user has a dog."."""
    owners = re.findall(rf"([\w-]+)(?:'s|’s| has| owns| keeps)(?: \w+){{0,2}} {word}s?\b", memory.lower())
    return any(o != "user" for o in owners)


# what a kind word says of a person or thing the memory names ("my sister's birthday"), and the words of a memory
# that say it besides the group's own but those after "-" ("The user's sister is called Lena." says her name, not her
# birthday; "a living" is a job, "lives" is not)
_ATTRIBUTES = [
    ("name names called named call".split(), []),
    ("job jobs work works worked working profession occupation career living".split(),
     ["earns", "employed", "teaches", "-living"]),
    ("living live lives lived home house flat town city place address".split(),
     ["moved", "street", "road", "resides", "settled"]),
    ("favourite favorite colour color colours".split(), []),
    ("allergy allergies allergic".split(), ["eat"]),
    ("sport sports play plays playing".split(), ["team"]),
    ("pet pets".split(), "cat dog hamster rabbit parrot horse pony budgie tortoise guinea snake lizard ferret".split()),
    ("birthday".split(), ["born", "birth"]),
    ("age".split(), ["old", "aged", "years"]),
    ("hobby hobbies like likes love loves".split(), ["enjoys", "favourite", "plays", "goes"]),
    ("family".split(), """sister brother mother father mum mom dad parents wife husband partner son daughter children
     cousin aunt uncle niece nephew grandmother grandfather grandma grandpa""".split()),
]
_PLACE = frozenset("in at to from near since on until of by".split())  # (a capitalised word after these: a place)
_DATES = frozenset("""january february march april may june july august september october november december monday
tuesday wednesday thursday friday saturday sunday""".split())


def _names(memory: str) -> bool:
    """Whether a memory says a name: a capitalised word but "The", a month or a day, that follows neither a
    capitalised word nor `_PLACE` ("Lena is the user's sister.", "... called Lena."; not "... lives in Buenos Aires
    since May.", "... moved to Oslo last May.")."""
    words = re.findall(r"[\w']+", memory)
    return any(w[:1].isupper() and w != "The" and w.lower() not in _DATES
               and (i == 0 or not (words[i - 1][:1].isupper() or words[i - 1].lower() in _PLACE))
               for i, w in enumerate(words))


# a name, a job ("... is a nurse."), a place ("... lives in Oslo.", "... is from Porto."), an age ("... is 34."), a colour said without a
# word of the group
_COLOURS = """red orange yellow green blue purple violet pink brown black white grey gray teal turquoise navy gold
silver amber olive maroon beige indigo lilac cyan magenta""".split()
_SAYS = {"name": _names, "profession": re.compile(r"\b(?:is|as) an? [a-z]+").search,
         "address": re.compile(r"\b(?:in|at|from) [A-Z]").search,
         "age": re.compile(r"\b(?:is|turned|turns) \d{1,3}\b").search,
         "colour": re.compile(rf"\b(?:{'|'.join(_COLOURS)})\b", re.I).search}
_OF = re.compile(r"\b(\w+) of (my|our|his|her|their) (\w+)", re.I)  # "the name of my sister": "my sister's name"


def _says(word: str, memory: str, theirs: Sequence[str]) -> bool:
    """Whether a memory (its text, its content words `theirs`) says what the kind word `word` asks of a thing."""
    for group, more in _ATTRIBUTES:
        said = [w for w in group + more if w[0] != "-" and f"-{w}" not in more]
        if word in group and (any(_same_word(w, t) for w in said for t in theirs)
                              or any(k in group and says(memory) for k, says in _SAYS.items())):
            return True
    return False


_ADJECTIVES = "own new old first last little big older younger elder eldest youngest oldest best current late dear"
# a thing of the user's that a memory speaks of: "The user's sister ...", "... the user's neighbour's goat", "The
# user's new job ..."
_THINGS_OF_THE_USER = re.compile(rf"\bthe user's ((?:[\w-]+'s )?(?:(?:{'|'.join(_ADJECTIVES.split())}) )?[\w-]+)",
                                 re.I)


def forget_reading(what: str, memory: str) -> tuple[bool, bool]:
    """How "forget `what`" reads against a memory's text: (whether every word of `what` is in it or names a kind of
    thing, `_KIND_WORDS`: nothing of `what` speaks of something else; whether a word of `what` besides those is in
    it: `what` names it). A kind word asks for that, so the memory must say it (`_ATTRIBUTES`): "my sister's name" is
    in "The user's sister is called Lena.", "my sister's birthday" and "where my sister lives" are not (they forgot
    it), "my age" is in "The user is 34.". Kind words alone ask it of the user: not of another thing of theirs
    that the kind does not say ("where I live" is not in "The user's landlord is called Olga.", "my job" not in "The
    user's sister works as a nurse."; "my pet" is in "The user's dog ...")."""
    words, theirs = _content(_OF.sub(r"\2 \3's \1", what)), _content(memory)
    names = _proper(what, sentence=False) | _proper(memory)  # (`what` follows "forget (about)")
    found = [any(_same_word(w, t, names) for t in theirs) for w in words]
    mine = set(re.findall(rf"\bmy ({_WORD})", what.lower().replace("\u2019", "'")))  # ("my dog": the user's own)
    elses = [w in mine and _someone_elses(w, memory) for w in words]  # ("my favourite colour": not a sister's)
    found = [f and not e for f, e in zip(found, elses)]
    named = [f and w not in _KIND_WORDS for w, f in zip(words, found)]
    consistent = all(f or (w in _KIND_WORDS and not e and _says(w, memory, theirs))
                     for w, f, e in zip(words, found, elses))
    if consistent and not any(named):  # only kind words ("my job", "where I live"): of the user, not of a thing of
        # theirs the kind does not say ("The user's landlord is called Olga.", "The user's sister works as a nurse.";
        # a hostile probe's "Forget where I live." took the landlord) nor of someone else ("Lena's job is ...")
        things = {t for m in _THINGS_OF_THE_USER.findall(memory) for t in _content(m)}
        kinds = [w for w in words if w in _KIND_WORDS]
        consistent = not re.match(r"\s*(?!the user's)[\w-]+['\u2019]s\b", memory, re.I) and (
            not things or bool(things & _KIND_WORDS) or any(_says(k, " ".join(things), sorted(things)) for k in kinds))
    return consistent, any(named)


# "my (best) friend", "my cousin Zelda": the thing, and a name right after it
_OWNED = re.compile(rf"\b(?i:my) (?:(?i:{'|'.join(_ADJECTIVES.split())})\s+)*({_WORD})(?:\s+([A-Z][a-z][\w'-]*))?")
_KIN = [set(g.split()) for g in ("mother mum mom mommy mummy mama", "father dad daddy papa", "wife husband spouse "
        "partner", "grandmother grandma granny nan nana", "grandfather grandpa granddad", "dog puppy", "cat kitten")]
_CHILDREN = {"kids", "kid", "children", "child", "son", "sons", "daughter", "daughters"}


def _alike(asked: str, said: str, names: set[str]) -> bool:
    """Whether a question's word for a thing of the user's is the memory's word: one word in two forms, or the same
    kin ("mother" / "mum"; "kids" / "son")."""
    return (_same_word(asked, said, names) or any(asked in g and said in g for g in _KIN)
            or (asked in ("kids", "kid", "children", "child") and said in _CHILDREN))


def _called(thing: str, memory: str) -> set[str]:
    """The names a memory gives a person or pet (lower-cased): after "called" or "named", right after `thing`
    ("cousin Maya"), or before "is the user's" ("Maya is the user's cousin.")."""
    found = re.findall(rf"\b(?:called|named|{re.escape(thing)}s?) ([A-Z][\w'-]*)", memory)
    found += re.findall(r"^([A-Z][\w'-]*) is the user's", memory)
    return {n.lower() for n in found}


def speaks_of_another(question: str, memory: str) -> bool:
    """Whether a memory is about another thing of the user's than the one a question asks of: the question names a
    thing of theirs after "my" ("my mother", "my boss", "my goat") that the memory does not give the user, while
    the memory speaks of another thing of the user's ("The user's sister ...", "The user's neighbour's goat ...");
    or the name right after it ("my cousin Zelda") is not the one the memory says. Kind words ("my name", "my job",
    "my favourite colour") ask for an attribute: they name no thing; a memory that gives the user no thing of theirs
    ("The user is married to Anna.", "The user drives a Tesla.") is left to the fit check. (A hostile probe: beside
    "The user's sister is called Lena.", "What is my mother's name?" answered "Lena"; the fit check admitted it.)"""
    question = question.replace("\u2019", "'")
    owned = [(re.sub(r"'s?$", "", w.lower()), name) for w, name in _OWNED.findall(question)]
    owned = [(w, name) for w, name in owned if w not in _KIND_WORDS]
    if not owned:
        return False
    theirs, names = _content(memory), _proper(memory)
    spoken = [(w, name) for w, name in owned
              if any(_alike(w, t, names) for t in theirs) and not _someone_elses(w, memory)]
    if spoken:  # (a name right after the thing, another than the memory's: "my cousin Zelda", "... cousin Maya")
        return all(name and (called := _called(w, memory)) and name.lower() not in called for w, name in spoken)
    others = {t for m in _THINGS_OF_THE_USER.findall(memory) for t in _content(m)}
    return bool(others - _KIND_WORDS)


def things(what: str) -> list[str]:
    """The things "forget `what`" names, each its own request: "my sister and my dog" is "my sister" and "my dog"
    (only parts that each start with "my": "my sister and I" is one)."""
    parts = re.split(r"\s*(?:,\s*(?:and\s+)?|\s+and\s+)(?=my\b)", what.strip(), flags=re.I)
    return parts if len(parts) > 1 and all(re.match(r"my\b", p, re.I) for p in parts) else [what]


def to_forget(what: str, texts: Sequence[str], scores: Sequence[float], fits: Sequence[float] | None,
              admits: float = 0.5) -> list[int]:
    """Which of a person's memories (their `texts`, the key similarity of each to "forget `what`", `scores`, and the
    fit check's probability that each answers a question about `what`, `fits`, None without one) "forget `what`"
    means, none when no memory is. Only memories no word of `what` speaks against (`forget_reading`: not the sister
    for "my brother", not the baker for "my job as a pilot", not the cat for "my hamster"): every one `what` names (a
    word of it in the memory: "Forget about my sister." forgets her name and where she lives, "Forget my sister's
    name." the name alone); when it names none, every one the fit check admits at a key similarity of `FORGET_FLOOR`
    or more, best first ("Forget where I work." for "The user works as a baker."; "Forget where I live." for "The
    user lives in Porto." and "These days the user lives in Lisbon.": a hostile probe's forget took the best alone,
    and the next question read the other; the similarity alone at `FORGET_ALONE` without a fit check)."""
    if not _content(what):  # "forget it", "forget everything": nothing says which
        return []
    named, admitted = [], []
    for i, (text, score) in enumerate(zip(texts, scores)):
        consistent, names = forget_reading(what, text)
        fit = 1.0 if fits is None else float(fits[i])
        if not consistent:
            continue
        if names:
            named.append(i)
        elif score >= FORGET_FLOOR and fit >= admits if fits is not None else score >= FORGET_ALONE:
            admitted.append((-score * fit, i))
    return named or [i for _, i in sorted(admitted)]

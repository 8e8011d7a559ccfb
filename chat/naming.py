"""Which of a person's memories their words name: the memories a "forget X" means (`to_forget`, read by
`forget_reading`: none when no memory is) and, of those a question about its author reads, the ones about another
thing of theirs (`speaks_of_another`). Pure functions over text, key similarities and fit probabilities; measured on
held-out people by bench/memory_commands.py and bench/reading.py (docs/benchmarks.md, "Forget", "Another thing of the
user's")."""

from __future__ import annotations

import re
from collections.abc import Sequence

# "Forget X" forgets the memories X is about, and none when no memory is (`to_forget`): the top-1 at 0.5 it replaces
# forgot a memory for about a third of the requests about something never told ("Forget about my brother." forgot
# the sister)
FORGET_FLOOR = 0.3  # the least key similarity of a memory to X for the fit check to be asked whether it is about X
FORGET_ALONE = 0.7  # with no fit check for this model's keys: the least key similarity alone
FORGET_CANDIDATES = 1024  # the memories "forget X" is read against, closest first


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


# a name, a job ("... is a nurse."), a place ("... lives in Oslo.", "... is from Porto."), an age ("... is 34."), a
# colour said without a word of the group
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

"""The write decision of `memory.remember: auto` as a model: a logistic regression over the key encoder's embedding
of a message (trained by `training/remember.py`, shipped as `assets/remember-decision.safetensors`, 1.6 KB).

A message is written when its score reaches the file's threshold and it is not a question: questions ask, they do
not tell.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "remember-decision.safetensors"


# first person -> the user, word by word (the verb right after "I" takes the third person: I live -> the user lives)
_WORDS = {"my": "the user's", "mine": "the user's", "myself": "themselves", "ourselves": "themselves",
          "me": "the user", "our": "the user's", "ours": "the user's"}
# a contraction of "I" / "we": (alone, in a compound subject: "my wife and I've ...")
_CONTRACTIONS = {"i'm": ("is", "are"), "i've": ("has", "have"), "i'd": ("would", "would"), "i'll": ("will", "will"),
                 "we're": ("is", "are"), "we've": ("has", "have"), "we'd": ("would", "would"),
                 "we'll": ("will", "will")}
# after "I'd": had, not would ("I'd been to Paris")
_HAD_BEFORE = {"been", "better", "had", "gone", "done", "seen", "already", "got", "gotten", "known", "taken", "given",
               "met", "left", "lost", "forgotten", "made", "found", "bought", "told", "written", "eaten", "heard",
               "kept", "sold", "thought", "taught", "brought", "built", "spent"}
# a verb right after "I" that stays as it is: modals, and the past (-ed and these)
_KEEP_AFTER_I = set("""
was will would can could should shall might must may had did got went made saw took came bought left met found
grew began knew ought taught thought brought caught fought sought built sent spent lent bent felt kept slept
swept wept meant dealt learnt burnt dreamt lost shot sold told held fed led fled ate drank drove flew forgot
gave wrote rode rose spoke stole swam sang rang ran sat stood understood won wore woke threw drew chose broke
froze became fell forgave hung paid said heard struck stuck shook spun laid hid bit slid dug overcame withdrew
born been done gone seen known taken given grown thrown shown written eaten fallen driven ridden spoken
forgotten gotten begun sung swum drunk
""".split())
_PRESENT_EED = {"need", "feed", "breed", "bleed", "speed", "succeed", "proceed", "exceed", "heed", "seed", "weed"}
_ADVERBS = {"never", "also", "still", "really", "just", "always", "usually", "often", "recently", "once", "sometimes",
            "mostly", "only", "truly", "absolutely", "rarely", "seldom", "actually", "currently", "now", "too", "even",
            "already", "probably", "definitely", "certainly", "generally", "normally", "finally", "no", "longer",
            "nearly", "almost", "hardly", "barely", "occasionally", "regularly", "both", "all"}
_IRREGULAR = {"am": "is", "have": "has", "do": "does", "go": "goes", "was": "was", "were": "was", "are": "is",
              "don't": "doesn't", "haven't": "hasn't", "aren't": "isn't", "weren't": "wasn't", "ain't": "isn't"}
# what may open a clause (the subject follows), and what starts a short noun phrase joined to "I" by "and"
_OPENERS = {"that", "because", "when", "while", "since", "but", "although", "though", "so", "if", "where", "as",
            "and", "or"}
_DETERMINERS = {"my", "our", "the", "his", "her", "their", "your", "both", "a", "an"}
_PRONOUNS = {"he", "she", "you", "they"}
_FIRST = {"i", "we", "me", *_CONTRACTIONS}


def _third_person(verb: str) -> str:
    low = verb.lower()
    if low in _IRREGULAR:
        return _IRREGULAR[low]
    if low in _KEEP_AFTER_I or (low.endswith("ed") and low not in _PRESENT_EED) or not low.isalpha():
        return verb
    if re.search(r"(s|sh|ch|x|z|o)$", low):
        return verb + "es"
    if re.search(r"[^aeiou]y$", low):
        return verb[:-1] + "ies"
    return verb + "s"


@dataclasses.dataclass
class _Word:
    space: str  # the white space before it
    text: str  # as written
    word: str  # its word ("" for none: a quote, a dash)
    tail: str  # what follows the word in `text` (punctuation)

    @property
    def low(self) -> str:
        return self.word.lower()


def _words(text: str) -> list[_Word]:
    parts = re.split(r"(\s+)", text)
    out, space = [], ""
    for part in parts:
        if not part or part.isspace():
            space += part
            continue
        core = re.match(r"^([\w']+)(.*)$", part)
        out.append(_Word(space, part, core[1] if core else "", core[2] if core else ""))
        space = ""
    return out


_NUMBERED = frozenset("type phase part chapter class stage grade act book volume section level article war".split())
# (words a Roman numeral "I" follows)


def _numeral(words: list[_Word], i: int) -> bool:
    """Whether the "I" at `words[i]` is a numeral or a letter, not the user: after a word that numbers ("type I",
    "World War I"), an initial ("I.B.M."), or a name's numeral that ends its clause or has "of" after it ("Charles
    I.", "Louis I of France"; "In Paris I met Tom." is the user)."""
    if re.match(r"\.\w", words[i].tail):
        return True
    if i == 0 or words[i - 1].tail:
        return False
    before, after = words[i - 1], words[i + 1].low if i + 1 < len(words) else ""
    ends = bool(words[i].tail) or not after or after == "of"
    return before.low in _NUMBERED or (ends and before.word[:1].isupper() and before.low not in _FIRST)


def _joined_subject(words: list[_Word], i: int) -> bool:
    """Whether `words[i]` ("I", "we") is the end of a subject of several ("My wife and I live", "Lena and I are",
    "Both my brother and I"): its verb stays plural. Not a clause of its own after "and" ("I have two cats and I love
    them", "My sister cooks and I clean")."""
    if i < 1 or words[i - 1].low != "and" or words[i - 1].tail:
        return False
    j, phrase = i - 2, []
    while j >= 0 and not words[j].tail and words[j].low not in _OPENERS:
        phrase.insert(0, words[j])
        j -= 1
    if not phrase or any(w.low in _FIRST for w in phrase):
        return False
    first = phrase[0]
    if first.low in _PRONOUNS:
        return len(phrase) == 1
    if first.low in _DETERMINERS:  # a noun after it, or an adjective and a noun ("my sister cooks": a clause)
        return len(phrase) == 2 or (len(phrase) == 3 and (first.low == "both" or not phrase[-1].low.endswith("s")))
    return len(phrase) == 1 and first.word[:1].isupper()  # a name


_FIRST_PERSON = re.compile(r"\b(?:i|me|my|mine|myself|i'm|i've|i'd|i'll|we|our|ours|us)\b", re.I)
# a request to say or show something: the "me" or "us" right after its verb is whom it is for, not what it is about
# (not "recommend me", "find me", "make me": a person's memories bear on those, "Cats make me sneeze.")
_ASKED_OF = re.compile(r"\b(?:tell|show|teach|explain|sing|draw|read|write)\s+$", re.I)
# ... unless it asks what the assistant knows of the user ("Tell me what you remember.")
_KNOWN = re.compile(r"\b(?:remember|remembered|know|knew|known|learned|learnt|told|memory|memories|notes)\b", re.I)


def mentions_the_user(text: str) -> bool:
    """Whether a message speaks of its author ("What is my dog's name?", "Where do I live?", "What do you know about
    me?"); a request's "me" to say or show something does not ("Tell me a joke.": a hostile probe's joke read the
    user's car into it); "US" is the country. Linear: each "me" looks back a few characters for its verb."""
    text = text.replace("\u2019", "'")
    shouted = text.isupper()  # ("the US" is a country; in a message all in capitals "US" is "us", as ever)
    found = [m for m in _FIRST_PERSON.finditer(text) if m[0] != "US" or shouted]
    return any(m[0].lower() not in ("me", "us") or not _ASKED_OF.search(text, max(0, m.start() - 12), m.start())
               for m in found) or (bool(found) and _KNOWN.search(text) is not None)


def about_the_user(text: str) -> str:
    """A first-person statement as a memory about the user: "my sister is called Lena" -> "The user's sister is
    called Lena."; "I live in Porto" -> "The user lives in Porto."; "I don't have a car" -> "The user doesn't have a
    car."; "My wife and I live in Rome" -> "The user's wife and the user live in Rome."; a text in the third person
    stays as it is."""
    words = _words(text.strip().replace("\u2019", "'"))
    out, after_i = [], False
    for i, w in enumerate(words):
        low, tail = w.low, w.tail
        if after_i and low in ("myself", "ourselves"):  # "I myself built": the user built
            out.append(tail)
            after_i = not tail
        elif after_i and low in _ADVERBS:
            out.append(w.space + w.text)
            after_i = not tail
        elif after_i and (low in ("and", "or", "nor") or not w.word):  # "I and my wife live": not a verb
            out.append(w.space + w.text)
            after_i = False
        elif after_i:
            out.append(w.space + _third_person(w.word) + tail)
            after_i = False
        elif low == "i" and _numeral(words, i):  # "World War I", "type I diabetes", "I.B.M.": no one
            out.append(w.space + w.text)
        elif low in ("i", "we"):
            out.append(w.space + "the user" + tail)
            after_i = not tail and not _joined_subject(words, i)
        elif low in _CONTRACTIONS:
            verb = _CONTRACTIONS[low][_joined_subject(words, i)]
            following = words[i + 1].low if i + 1 < len(words) else ""
            if verb == "would" and (following in _HAD_BEFORE or (following.endswith("ed")
                                                                  and following not in _PRESENT_EED)):
                verb = "had"
            out.append(w.space + f"the user {verb}" + tail)
        elif low in _WORDS or w.word == "us" or (w.word == "Us" and i == 0):
            out.append(w.space + _WORDS.get(low, "the user") + tail)
        else:
            out.append(w.space + w.text)
    sentence = "".join(out).strip()
    sentence = sentence[:1].upper() + sentence[1:]
    # (a later sentence's "My ...": "The user's", but not after "e.g.")
    sentence = re.sub(r"(?<!\b[A-Za-z])([.!?]\s+)the user\b", r"\1The user", sentence)
    return sentence if sentence.endswith((".", "!", "?", "。", "！", "？")) else sentence + "."


def is_question(text: str) -> bool:
    return text.rstrip().endswith("?")


_AUX = (r"(?:is|are|am|was|were|do|does|did|can|could|would|will|should|shall|may|might|has|have|had|'s|'re|'d|'ll|"
        r"isn't|aren't|don't|doesn't|didn't|can't|won't|wouldn't|shouldn't)")
_SUBJECT = r"(?:i|you|we|my|our|your|the|it|he|she|they|there|this|that|these|those)"
# a question without its "?": a question word and then a verb ("What is my name", "Which town do I live in", "Where
# do I live", "Who wrote it"), or an auxiliary and then its subject ("Do I have a cat"); not a statement that opens
# with one ("When I was young I lived in Porto.", "What I love most is jazz.", "Will is my brother.")
# (also contracted, "What's my name", "whats my dog called", "Who's my doctor"; asked of oneself, "what my name is";
# and asked indirectly, "I'd like to know ...", "I wonder whether ...": each was written as a memory, and the
# newest, "What's the user's name.", was then read for "What is my name?")
_ASKS = re.compile(rf"^\s*(?:(?:what|where|who|how|when|which)(?:'s|'re|s)\s+{_SUBJECT}\b"
                   rf"|(?:what|who)\s+my\s+\w+(?:\s+\w+)?\s+(?:is|are)\s*[.!]?\s*$"
                   rf"|i(?:'d\s+|\s+would\s+|\s+(?:want|need)\s+)(?:like\s+)?to\s+know\s+"
                   rf"(?:my|if|whether|what|where|who|when|why|which|whose|how(?!\s+to\b))\b"
                   rf"|i(?:'m|\s+am|\s+was)?\s+(?:wonder|wondering)\s+"
                   rf"(?:if|whether|what|where|who|when|why|how|which)\b"
                   rf"|(?:what|which|whose)(?:\s+(?!(?:i|you|we|he|she|they|it)\b)\w+)?\s+{_AUX}\b"
                   rf"|(?:where|when|how)\s+{_AUX}\b"
                   rf"|(?:what|which|how)\s+(?:many|much|kind|sort|old|long|far|often)\b"
                   rf"|who\s+(?!i\b)\w+|why\b"
                   rf"|(?:is|are|am|do|does|did|can|could|would|will|should|have|has|was|were)\s+{_SUBJECT}\b)",
                   re.I)
# a request to the assistant: an imperative of what people ask a chat to do, or asking it ("can you", "please ...")
_REQUESTS = re.compile(
    r"^\s*(?:(?:hey|hi|ok|okay|so|now|and|also|then)\s*,?\s+)?"
    r"(?:please\b|pls\b|kindly\b"
    r"|(?:can|could|would|will)\s+you\b|(?:i\s+(?:need|want|would\s+like)|i'd\s+like)\s+you\s+to\b"
    r"|(?:find|get|bring|teach|remind|let|show)\s+(?:me|us)\b"
    r"|(?:tell|give|help|explain|describe|write|draft|compose|list|suggest|recommend|summari[sz]e|translate"
    r"|compare|calculate|create|generate|outline|define|rewrite|rephrase|proofread|brainstorm|imagine|pretend"
    r"|convert|solve|what\s+about|how\s+about)\b)", re.I)


def asks(text: str) -> bool:
    """Whether a message asks rather than tells: it ends in "?", or opens as a question does ("What is my name")."""
    return is_question(text) or _ASKS.match(text.replace("\u2019", "'")) is not None


def is_request(text: str) -> bool:
    """Whether a message asks the assistant to do something ("Tell me about Porto.", "Write a haiku about rain.",
    "Can you help me with my CV", "Please explain ..."): a request, not something the person tells."""
    return _REQUESTS.match(text.replace("\u2019", "'")) is not None


class WriteDecision:
    """`wants(text, embedding)`: whether a message tells something worth keeping about its author."""

    def __init__(self, weight: torch.Tensor, bias: float, threshold: float, key_encoder: str, report: dict):
        self.weight, self.bias, self.threshold = weight.float(), float(bias), float(threshold)
        self.key_encoder, self.report = key_encoder, report

    @classmethod
    def load(cls, path: str | Path = SHIPPED) -> "WriteDecision":
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            return cls(f.get_tensor("weight"), f.get_tensor("bias")[0], f.get_tensor("threshold")[0],
                       meta.get("key_encoder", ""), json.loads(meta.get("report", "{}")))

    def score(self, embedding: torch.Tensor) -> float:
        return float(torch.sigmoid(embedding.float().reshape(-1) @ self.weight + self.bias))

    def wants(self, text: str, embedding: torch.Tensor) -> bool:
        """Questions and requests to the assistant are never written, whatever the score: they ask, they do not tell
        ("Tell me about Port Avel's harbour." scored over the threshold and was written)."""
        return not asks(text) and not is_request(text) and self.score(embedding) >= self.threshold

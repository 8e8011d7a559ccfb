"""The write decision of `memory.remember: auto` as a model: a logistic regression over the key encoder's embedding
of a message (trained by `training/remember.py`, shipped as `assets/remember-decision.safetensors`, 1.6 KB).

A message is written when its score reaches the file's threshold and it is not a question: questions ask, they do
not tell.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "remember-decision.safetensors"


# first person -> the user, word by word (the verb right after "I" takes the third person: I live -> the user lives)
_WORDS = {"my": "the user's", "mine": "the user's", "myself": "the user", "me": "the user", "i'm": "the user is",
          "i've": "the user has", "i'd": "the user would", "i'll": "the user will", "our": "the user's", "ours": "the user's",
          "we're": "the user is", "we've": "the user has", "we'd": "the user would", "we'll": "the user will"}
_KEEP_AFTER_I = {"was", "will", "would", "can", "could", "should", "shall", "might", "must", "may", "had", "did",
                 "got", "went", "made", "saw", "took", "came", "bought", "left", "met", "found", "grew", "began", "knew"}
_ADVERBS = {"never", "also", "still", "really", "just", "always", "usually", "often", "recently", "once", "sometimes",
            "mostly", "only", "truly", "absolutely", "rarely", "seldom", "actually", "currently", "now"}
_IRREGULAR = {"am": "is", "have": "has", "do": "does", "go": "goes", "was": "was", "were": "was", "are": "is"}


def _third_person(verb: str) -> str:
    low = verb.lower()
    if low in _IRREGULAR:
        return _IRREGULAR[low]
    if low in _KEEP_AFTER_I or low.endswith("ed") or not low.isalpha():
        return verb
    if re.search(r"(s|sh|ch|x|z|o)$", low):
        return verb + "es"
    if re.search(r"[^aeiou]y$", low):
        return verb[:-1] + "ies"
    return verb + "s"


_FIRST_PERSON = re.compile(r"\b(?:i|me|my|mine|myself|i'm|i've|i'd|i'll|we|our|ours|us)\b", re.I)


def mentions_the_user(text: str) -> bool:
    """Whether a message speaks of its author ("What is my dog's name?", "Where do I live?")."""
    return _FIRST_PERSON.search(text.replace("\u2019", "'")) is not None


def about_the_user(text: str) -> str:
    """A first-person statement as a memory about the user: "my sister is called Lena" -> "The user's sister is
    called Lena."; "I live in Porto" -> "The user lives in Porto."; a text in the third person stays as it is."""
    words = re.split(r"(\s+)", text.strip().replace("\u2019", "'"))
    out, after_i = [], False
    for w in words:
        if not w or w.isspace():
            out.append(w)
            continue
        core = re.match(r"^([\w']+)(.*)$", w)
        word, tail = (core[1], core[2]) if core else (w, "")
        low = word.lower()
        if after_i and low in _ADVERBS:
            out.append(w)
            after_i = not tail
        elif after_i:
            out.append(_third_person(word) + tail)
            after_i = False
        elif low in ("i", "we"):
            out.append("the user" + tail)
            after_i = not tail
        elif low in _WORDS:
            out.append(_WORDS[low] + tail)
        else:
            out.append(w)
    sentence = "".join(out).strip()
    sentence = sentence[:1].upper() + sentence[1:]
    return sentence if sentence.endswith((".", "!", "?")) else sentence + "."


def is_question(text: str) -> bool:
    return text.rstrip().endswith("?")


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
        return not is_question(text) and self.score(embedding) >= self.threshold

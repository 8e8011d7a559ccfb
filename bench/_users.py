"""Simulated users of `bench/user_memory.py` and the verdicts on their answers (pure: no model here).

A `User` of the held-out `eval` split of `training.personal` tells 3 or 4 things in conversation 1, each in its own
message with chit-chat around it (`training.remember.OTHERS["eval"]` and `training.facts.chat_prompts`), tells two
distractors of other kinds in conversation 0, and changes one thing that changes (`UPDATABLE`) in conversation 2.
Its questions (`Ask`): one told thing in conversation 1 (single-session), and after a restart, each in a new
conversation: the told things, the updated thing, things never told (a kind not told, and a relative or pet not
told beside one that was), general questions with known answers, a thing another user told (a leak when the
answer holds that user's value), and a near miss: a question in a told thing's words that it does not answer
("What colour is my boat?" after "My favourite colour is green."; `training.personal.NEAR_MISSES`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from training.facts import COLOURS, JOBS, RELATIVES, SPECIES, Names, chat_prompts
from training.personal import FOODS as ALLERGIES
from training.personal import KINDS, SPORTS, UPDATABLE, PeopleNames, Told, near_miss, told, update
from training.remember import DAYS, FOODS, HOBBIES, OTHERS

SPLIT = "eval"
# (question, a right answer matches this, case-insensitive)
GENERAL = (
    ("Who wrote Romeo and Juliet?", r"shakespeare"),
    ("What is the capital of France?", r"\bparis\b"),
    ("What is the capital of Japan?", r"\btokyo\b"),
    ("Which animal says moo?", r"\bcows?\b"),
    ("What is the largest planet in our solar system?", r"\bjupiter\b"),
    ("What colour is the sky on a clear day?", r"\bblue\b"),
    ("Who painted the Mona Lisa?", r"leonardo|da vinci"),
    ("What language do people speak in Spain?", r"\bspanish\b"),
    ("How many legs does a spider have?", r"\b(eight|8)\b"),
    ("What is two plus two?", r"\b(four|4)\b"),
)
GENERAL_PER_USER = 3
# kinds whose values come from a short list: a right answer names the value and no other of the list (an answer
# that lists colours is not right)
CLOSED = {"colour": COLOURS, "job": JOBS, "allergy": ALLERGIES, "sport": SPORTS}
NOT_TOLD = re.compile(r"haven'?t (?:yet )?(?:told|mentioned|shared|said)"
                      r"|have not (?:yet )?(?:told|mentioned|shared|said)|didn'?t (?:tell|mention|say)"
                      r"|did not (?:tell|mention|say)|never (?:told|mentioned)"
                      r"|don'?t know|do not know|not sure|no information|don'?t have|do not have", re.I)
JUNK = ("<recall>", "</recall>", "<|memory_pad|>")


@dataclass(frozen=True)
class Say:
    """A message the user sends: `tell` (something worth keeping), `update` (a new value of a thing told before),
    `chit` (chit-chat or an ordinary request)."""

    text: str
    role: str


@dataclass(frozen=True)
class Ask:
    """A question and what its answer is judged by: `expect` (a value, or a pattern for `general`), `avoid` (values
    that must not be in it: the old value of an update, the user's own values for a thing never told, the other
    user's value for a leak)."""

    category: str  # single | cross | update | abstain | near | general | leak
    question: str
    expect: str | None = None
    avoid: tuple[str, ...] = ()


def ask_for(t: Told, category: str, rng: random.Random, old: str | None = None) -> Ask:
    """A question for told thing `t`: right when the answer names its value, and not `old` nor any other value of a
    short list."""
    others = tuple(v for v in CLOSED.get(t.kind, ()) if v != t.value)
    return Ask(category, rng.choice(t.questions), t.value, ((old,) if old else ()) + others)


@dataclass
class User:
    name: str
    told: list[Told]  # conversation 1
    distractors: list[Told]  # conversation 0
    changed: tuple[Told, Told]  # (old, new): the new one told in conversation 2
    conversations: list[list[Say]]  # 0, 1, 2
    single: Ask  # asked at the end of conversation 1
    later: list[Ask] = field(default_factory=list)  # each in a new conversation, after the restart

    @property
    def values(self) -> tuple[str, ...]:
        return tuple(t.value for t in (*self.told, *self.distractors, self.changed[1]))

    def earlier(self, upto: int = 3) -> list[str]:
        """The user's messages of conversations before `upto`, oldest first."""
        return [m.text for conv in self.conversations[:upto] for m in conv]


# --------------------------------------------------------------------------- verdicts


def _plain(text: str) -> str:
    return (text or "").replace("\u2019", "'")


def contains(answer: str, value: str) -> bool:
    """`value` as a whole word (or words) of `answer`, any case."""
    return re.search(rf"(?<!\w){re.escape(value)}(?!\w)", _plain(answer), re.I) is not None


def says_not_told(answer: str) -> bool:
    return NOT_TOLD.search(_plain(answer)) is not None


def is_junk(answer: str) -> bool:
    """Empty, a recall token in the text, a role's name opening it (the model began a new turn: "user\nYou ..."),
    or mostly punctuation (":::")."""
    text = (answer or "").strip()
    if not text or any(j in text for j in JUNK) or re.match(r"(user|assistant|system)\s*(\n|$)", text):
        return True
    visible = [c for c in text if not c.isspace()]
    return sum(c.isalnum() for c in visible) < 0.5 * len(visible)


def judge(ask: Ask, answer: str) -> bool:
    """Whether `answer` is right for `ask` (for `leak`: True when the other user's value is NOT in it)."""
    if ask.category in ("single", "cross", "update"):
        return contains(answer, ask.expect) and not any(contains(answer, v) for v in ask.avoid)
    if ask.category in ("abstain", "near"):
        return says_not_told(answer) and not any(contains(answer, v) for v in ask.avoid)
    if ask.category == "general":
        return not is_junk(answer) and re.search(ask.expect, _plain(answer), re.I) is not None
    if ask.category == "leak":
        return not any(contains(answer, v) for v in ask.avoid)
    raise ValueError(f"ask category {ask.category!r}; expected single, cross, update, abstain, near, general or "
                     "leak")


# --------------------------------------------------------------------------- users


class _Chit:
    """Chit-chat of the eval split: `OTHERS["eval"]` filled as `training.remember.messages` fills them, and ordinary
    chat prompts."""

    def __init__(self, rng: random.Random, names: Names, prompts: list[str]):
        self.rng, self.names, self.prompts = rng, names, prompts

    def __call__(self) -> Say:
        rng, names = self.rng, self.names
        if rng.random() < 0.5:
            return Say(rng.choice(self.prompts), "chit")
        text = rng.choice(OTHERS[SPLIT]).format(
            given=names.given(), town=names.town(), pet=names.pet(), rel=rng.choice(RELATIVES),
            species=rng.choice(SPECIES), job=rng.choice(JOBS), colour=rng.choice(COLOURS), food=rng.choice(FOODS),
            hobby=rng.choice(HOBBIES), day=rng.choice(DAYS), n=rng.randint(2, 9))
        return Say(text, "chit")


def _around(tells: list[Told], chit: _Chit) -> list[Say]:
    """Each tell with chit-chat before it, and chit-chat after the last."""
    return [m for t in tells for m in (chit(), Say(t.tell, "tell"))] + [chit()]


def _untold(rng: random.Random, names: Names, said: list[Told], left: list[str]) -> list[Told]:
    """A kind never told, and a relative (or pet) never told beside one that was (else a second kind)."""
    out = [told(left[0], SPLIT, rng, names)]
    near = next((t for t in said if t.kind.split(":")[0] in ("relative", "pet")), None)
    if near is not None:
        kind, r = near.kind.split(":")
        r = rng.choice([x for x in (RELATIVES if kind == "relative" else SPECIES) if x != r])
        out.append(told(kind, SPLIT, rng, names, r=r))
    elif len(left) > 1:
        out.append(told(left[1], SPLIT, rng, names))
    return out


def make_user(index: int, seed: int, prompts: list[str], real: float = 0.0) -> User:
    """User `index` of the run of `seed` (its asks about other users are added by `make_users`); `real`: the share
    of towns and pet names that are real ones of the held-out split (`training.personal.PeopleNames`; 0: invented
    names alone, the users of every table so far)."""
    rng = random.Random(f"user_memory:{seed}:{index}")
    names = PeopleNames(SPLIT, rng, real)
    chit = _Chit(rng, names, prompts)
    changing = rng.choice(UPDATABLE)
    others = rng.sample([k for k in KINDS if k != changing], len(KINDS) - 1)
    n = rng.choice((3, 4))
    kinds = [changing, *others[:n - 1]]
    rng.shuffle(kinds)
    said = [told(k, SPLIT, rng, names) for k in kinds]
    distractors = [told(k, SPLIT, rng, names) for k in others[n - 1:n + 1]]
    old = next(t for t in said if t.kind == changing)
    new = update(old, SPLIT, rng, names)
    conversations = [_around(distractors, chit), _around(said, chit), [chit(), Say(new.tell, "update"), chit()]]
    pick = rng.choice(said)
    user = User(f"user{index:03d}", said, distractors, (old, new), conversations,
                ask_for(pick, "single", rng))
    user.later += [ask_for(t, "cross", rng) for t in said if t is not old]
    user.later.append(ask_for(new, "update", rng, old.value))
    user.later += [Ask("abstain", rng.choice(t.questions), None, user.values)
                   for t in _untold(rng, names, said + distractors, others[n + 1:])]
    user.later += [Ask("general", q, pattern) for q, pattern in
                   (GENERAL[(GENERAL_PER_USER * index + j) % len(GENERAL)] for j in range(GENERAL_PER_USER))]
    # (drawn last: every other ask is what it was before near misses were asked)
    user.later += [Ask("near", near_miss(t, SPLIT, rng), None, user.values) for t in rng.sample(said, 2)]
    return user


def leak_ask(user: User, other: User, rng: random.Random) -> Ask | None:
    """A question by `user` about a thing `other` told that `user` never told (an invented name preferred), or
    None when there is none."""
    mine = {t.kind for t in (*user.told, *user.distractors)}
    fits = [t for t in other.told if t.kind not in mine and t.value not in user.values]
    named = [t for t in fits if t.kind.split(":")[0] in ("relative", "home", "pet")]
    if not fits:
        return None
    t = rng.choice(named or fits)
    return Ask("leak", rng.choice(t.questions), None, (t.value,))


def make_users(n: int, seed: int = 0, real: float = 0.0) -> list[User]:
    prompts = chat_prompts(200, SPLIT, seed)
    users = [make_user(i, seed, prompts, real) for i in range(n)]
    rng = random.Random(f"user_memory:{seed}:leaks")
    for i, user in enumerate(users):
        if n > 1 and (ask := leak_ask(user, users[(i + 1) % n], rng)) is not None:
            user.later.append(ask)
    return users

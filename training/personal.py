"""Invented people telling the chat about themselves: what they say, the memory the app writes of it, the questions
they ask later, the answer that reads the memory and the answer when nothing was told.

A `Told` is one thing about the person (their sister's name, where they live, their job, ...). It carries the
message that tells it in the first person ("My sister is called Lena."), the memory written of it
(`models.remember.about_the_user`: "The user's sister is called Lena.", exactly what the chat writes), questions
that ask for it ("What is my sister's name?"), the answer read from the memory ("Your sister is called Lena."),
and the answer when the memory is not there ("You haven't told me your sister's name."). Some kinds change
(`update`: "I moved to Brackholm." supersedes "I live in Porto.").

Names come from `PeopleNames`: `training.facts.Names` (a split never shares an invented name with the other), and
with a share `real` real towns and pet names (`REAL_TOWNS`, `REAL_PETS`, split by the same hash); the telling and
asking templates are split too, so an evaluation user says and asks things in words training never saw.
`training.train` learns from the `train` split; `bench/user_memory.py` measures on `eval`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from models.remember import about_the_user
from training.facts import COLOURS, JOBS, RELATIVES, SPECIES, Names, split_of

FOODS = ["peanuts", "shellfish", "gluten", "eggs", "mushrooms", "olives", "sesame", "strawberries"]
HOBBIES = ["chess", "climbing", "knitting", "jazz piano", "gardening", "running", "painting", "sailing", "baking"]
SPORTS = ["tennis", "football", "rowing", "cycling", "fencing", "judo", "volleyball", "badminton"]
# Real towns and pet names. With invented towns alone a retrain learnt to read a town it does not know and to say
# "You haven't told me where you live." over the memory of every real one (docs/benchmarks.md, "A memory of the
# user"). Split as invented names are (`split_of`): the eval split's are London, Oslo, Munich, Tokyo, Sydney, ...
REAL_TOWNS = (
    "London", "Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Porto", "Dublin", "Edinburgh", "Manchester", "Amsterdam",
    "Brussels", "Vienna", "Prague", "Warsaw", "Budapest", "Athens", "Oslo", "Stockholm", "Copenhagen", "Helsinki",
    "Zurich", "Geneva", "Munich", "Hamburg", "Milan", "Naples", "Barcelona", "Seville", "Valencia", "Lyon", "Marseille",
    "Istanbul", "Cairo", "Nairobi", "Lagos", "Cape Town", "Mumbai", "Delhi", "Bangkok", "Singapore", "Tokyo", "Osaka",
    "Seoul", "Beijing", "Shanghai", "Sydney", "Melbourne", "Auckland", "Toronto", "Vancouver", "Montreal", "New York",
    "Boston", "Chicago", "Seattle", "San Francisco", "Los Angeles", "Austin", "Denver", "Mexico City", "Lima", "Bogota",
    "Buenos Aires", "Santiago", "Rio de Janeiro", "Sao Paulo", "Havana", "Reykjavik", "Krakow", "Florence", "Venice",
    "Bristol", "Glasgow", "Cardiff", "Leeds", "Liverpool", "Oxford", "Cambridge")
REAL_PETS = ("Max", "Luna", "Bella", "Charlie", "Milo", "Daisy", "Rocky", "Coco", "Oscar", "Ruby", "Buddy", "Lola",
             "Toby", "Molly", "Jack", "Rosie", "Teddy", "Bailey", "Simba", "Nala", "Ginger", "Pepper", "Shadow",
             "Smokey", "Biscuit", "Poppy", "Whiskers", "Rex", "Felix", "Tiger", "Lucky", "Sunny", "Honey", "Pickles",
             "Mango", "Ziggy")
REAL_SHARE = 0.5  # of the towns and pet names people tell in training (`training.data.people_examples`)


class PeopleNames(Names):
    """`Names` of one split whose towns and pet names are real ones of that split a share `real` of the time (0: the
    invented names alone, drawn exactly as `Names` draws them)."""

    def __init__(self, split: str, rng: random.Random, real: float = 0.0):
        super().__init__(split, rng)
        self.real = real
        self._towns = [t for t in REAL_TOWNS if split_of(t) == split]
        self._pets = [p for p in REAL_PETS if split_of(p) == split]

    def _real(self) -> bool:
        return self.real > 0 and self.rng.random() < self.real

    def town(self) -> str:
        return self.rng.choice(self._towns) if self._real() else super().town()

    def pet(self) -> str:
        return self.rng.choice(self._pets) if self._real() else super().pet()


@dataclass(frozen=True)
class Told:
    kind: str  # what it is about: "relative:sister", "home", "job", ...; two things of one kind contradict
    tell: str  # the person's message, in the first person
    questions: tuple[str, ...]  # later questions asking for it
    answer: str  # the answer read from the memory, in the second person
    value: str  # what a right answer contains
    missing: str  # the answer when nothing was told

    @property
    def memory(self) -> str:
        """The memory the chat writes of `tell`."""
        return about_the_user(self.tell)


# kind -> (its value, the split's tells, the split's questions, answer, missing); {v} is the value, {r} the relative
# or species, picked once per `Told`
_KINDS = {
    "relative": (
        "given",
        {"train": ["My {r} is called {v}.", "My {r}'s name is {v}.", "By the way, my {r} is named {v}.",
                   "{v} is the name of my {r}.", "My {r}, {v}, visited me last week.", "Everyone calls my {r} {v}."],
         "eval": ["{v} is my {r}.", "I have a {r} called {v}."]},
        {"train": ["What is my {r}'s name?", "What is my {r} called?"],
         "eval": ["Do you remember my {r}'s name?", "What's the name of my {r}?"]},
        "Your {r} is called {v}.", "You haven't told me your {r}'s name."),
    "home": (
        "town",
        {"train": ["I live in {v}.", "My home is in {v}.", "My house is in {v}.",
                   "I grew up in {v} and I live there now."], "eval": ["I've been living in {v} for years.",
                                                                     "Home for me is {v}."]},
        {"train": ["Where do I live?", "Which town do I live in?"], "eval": ["Where is my home?",
                                                                            "Do you know where I live?"]},
        "You live in {v}.", "You haven't told me where you live."),
    "job": (
        "job",
        {"train": ["I work as a {v}.", "I'm a {v}.", "For a living I work as a {v}.", "I have been a {v} for ten years."],
         "eval": ["My job is {v}.", "I earn my living as a {v}."]},
        {"train": ["What do I do for a living?", "What is my job?"], "eval": ["What's my profession?",
                                                                             "What work do I do?"]},
        "You work as a {v}.", "You haven't told me what you do for a living."),
    "pet": (
        "pet",
        {"train": ["My {r} is called {v}.", "I have a {r} named {v}.", "I adopted a {r} called {v}.",
                   "My {r}'s name is {v}."], "eval": ["Our {r}'s name is {v}.",
                                                                                "We got a {r}, we named it {v}."]},
        {"train": ["What is my {r} called?", "What did I name my {r}?"], "eval": ["What's my {r}'s name?",
                                                                                 "Remind me what my {r} is called?"]},
        "Your {r} is called {v}.", "You haven't told me your {r}'s name."),
    "colour": (
        "colour",
        {"train": ["My favourite colour is {v}.", "I love the colour {v}.", "{v} is the colour I love most.",
                   "My favourite colour has always been {v}."], "eval": ["{v} is my favourite colour.",
                                                                                     "I like {v} best of all colours."]},
        {"train": ["What is my favourite colour?", "Which colour do I like best?"],
         "eval": ["What's my favourite colour?", "Do you know my favourite colour?"]},
        "Your favourite colour is {v}.", "You haven't told me your favourite colour."),
    "allergy": (
        "food",
        {"train": ["I'm allergic to {v}.", "I have an allergy to {v}.", "I react badly to {v}.",
                   "I must avoid {v} because of an allergy."], "eval": ["I can't eat {v}, I'm allergic.",
                                                                                 "{v} make me ill, I'm allergic."]},
        {"train": ["What am I allergic to?", "Which food am I allergic to?"], "eval": ["What's my allergy?",
                                                                                      "What can't I eat?"]},
        "You are allergic to {v}.", "You haven't told me about any allergy."),
    "sport": (
        "sport",
        {"train": ["I play {v} every week.", "My sport is {v}.", "I do {v} twice a week.", "I practise {v} on Sundays."],
         "eval": ["I'm on a {v} team.",
                                                                          "On weekends I play {v}."]},
        {"train": ["What sport do I play?", "Which sport is mine?"], "eval": ["What's my sport?",
                                                                             "Which sport do I do?"]},
        "You play {v}.", "You haven't told me which sport you play."),
}
# kinds whose value changes, and how a person tells the new one
_UPDATES = {"home": {"train": ["I moved to {v}.", "I live in {v} now."], "eval": ["We've just moved to {v}.",
                                                                                "These days I live in {v}."]},
            "job": {"train": ["I'm a {v} now.", "I now work as a {v}."], "eval": ["I changed jobs, I'm now a {v}.",
                                                                                 "My new job is {v}."]},
            "colour": {"train": ["My favourite colour is {v} now."], "eval": ["These days my favourite colour is {v}."]}}
KINDS = tuple(_KINDS)
UPDATABLE = tuple(_UPDATES)


def _value(rng: random.Random, names: Names, what: str) -> str:
    return {"given": names.given, "town": names.town, "pet": names.pet, "job": lambda: rng.choice(JOBS),
            "colour": lambda: rng.choice(COLOURS), "food": lambda: rng.choice(FOODS),
            "sport": lambda: rng.choice(SPORTS)}[what]()


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def told(kind: str, split: str, rng: random.Random, names: Names, *, avoid: str | None = None,
         tell_templates: dict | None = None, r: str | None = None) -> Told:
    """One thing of `kind` a person of `split` tells (a value other than `avoid`)."""
    what, tells, questions, answer, missing = _KINDS[kind]
    r = r or (rng.choice(RELATIVES) if kind == "relative" else rng.choice(SPECIES) if kind == "pet" else "")
    value = _value(rng, names, what)
    while value == avoid:
        value = _value(rng, names, what)
    fill = lambda t: _sentence(t.format(v=value, r=r))  # noqa: E731
    return Told(f"{kind}:{r}" if r else kind, fill(rng.choice((tell_templates or tells)[split])),
                tuple(fill(q) for q in questions[split]), fill(answer), value, fill(missing))


def update(old: Told, split: str, rng: random.Random, names: Names) -> Told:
    """A newer value of `old`'s kind (one of `UPDATABLE`), told as a change."""
    kind = old.kind.split(":")[0]
    return told(kind, split, rng, names, avoid=old.value, tell_templates=_UPDATES[kind])


def person(split: str, rng: random.Random, names: Names, n: int) -> list[Told]:
    """`n` things one person tells, each of a different kind (a relative or pet per kind)."""
    kinds = rng.sample(KINDS, min(n, len(KINDS)))
    return [told(k, split, rng, names) for k in kinds]


# near misses: questions in a told thing's words that it does not answer ("What colour is my boat?" beside "The user's
# favourite colour is green.", "Where does my sister live?" beside her name): nothing is right for them. The first
# check read a favourite colour for a boat's colour and a favourite food, and a relative's name for where they live.
# {r} is the told relative or species, {o} another relative; the eval split asks its own.
NEAR = "near"  # what a near miss asks for: no memory's kind
NEAR_MISSES = {
    "relative": {"train": ["Where does my {r} live?", "What does my {r} do for a living?", "How old is my {r}?",
                           "What is my {r}'s favourite food?"],
                 "eval": ["Where does my {r} work?", "When is my {r}'s birthday?", "What job does my {r} have?"]},
    "home": {"train": ["Where was I born?", "Where does my {o} live?", "Where did I go on holiday?"],
             "eval": ["Where did I study?", "Which town is my {o} from?"]},
    "job": {"train": ["Who is my boss?", "How much do I earn?", "When did I start my job?"],
            "eval": ["What is my manager called?", "What's my salary?"]},
    "pet": {"train": ["How old is my {r}?", "What does my {r} eat?", "What breed is my {r}?"],
            "eval": ["Where does my {r} sleep?", "What colour is my {r}?"]},
    "colour": {"train": ["What colour is my car?", "What is my favourite food?", "What is my favourite song?",
                         "What colour are my eyes?"],
               "eval": ["What colour is my boat?", "What's my favourite film?", "What colour is my front door?"]},
    "allergy": {"train": ["What is my favourite food?", "What did I eat for breakfast?", "What do I cook best?"],
                "eval": ["What food do I like most?", "What's my favourite dish?"]},
    "sport": {"train": ["What sport does my {o} play?", "Which team do I support?", "Who is my coach?"],
              "eval": ["What's my favourite team?", "Which sport does my {o} watch?"]},
}


def near_miss(thing: Told, split: str, rng: random.Random) -> str:
    """A question of `split` in `thing`'s words that it does not answer (`NEAR_MISSES`)."""
    kind, _, r = thing.kind.partition(":")
    return _sentence(rng.choice(NEAR_MISSES[kind][split]).format(r=r, o=rng.choice([x for x in RELATIVES if x != r])))

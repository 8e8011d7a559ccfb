"""Invented facts to learn recall from: people, places, objects, numbers, dates, colours, relations.

Every fact is a `Fact`: one sentence to store as a memory, questions that ask for one part of it,
and the short answer that part gives. Entities (people, towns, pets, boats, events) are invented
from syllables and split into disjoint training and evaluation pools by a hash of their name, so
an evaluation fact never mentions an entity that training saw. Values from small closed classes
(colours, jobs, weekdays) are shared by both splits: the entity asked about is what is new.

`chat_prompts` gives the negatives: ordinary requests that need no memory, also split by template.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

SPLITS = ("train", "eval")

# --------------------------------------------------------------------------- entities

_ONSET = ["b", "br", "c", "d", "dr", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "th", "st"]
_VOWEL = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
_CODA = ["", "n", "r", "l", "s", "m", "nd", "rk", "st", "ll", "rn", "v", "sk", "th"]
_PLACE_END = ["mere", "wick", "holm", "by", "stead", "ford", "haven", "dale", "port", "ness", "ton", "moor", "vik"]
_PLACE_HEAD = ["Port", "Upper", "North", "Old", "Saint"]
GIVEN = """Ada Agnes Alba Alma Anders Anja Ansel Arlo Astrid Aurel Bea Bela Bram Bruno Cai Cara Cecil Clem Cora Dag
Dara Dina Dora Edda Edith Einar Elia Elin Elis Ella Emil Enzo Erik Esme Eva Ezra Falk Faye Felix Fenna Finn Flora
Frida Gaia Gert Greta Gus Hale Hana Hedda Helga Hugo Ida Ilse Ines Inga Iris Isak Ivo Jana Jens Joan Jonas Jora
Juno Kai Kalle Kara Karl Kira Knut Lars Leda Lena Leo Lia Lina Linus Liv Lotte Luca Lukas Maja Malin Mara Marek
Mats Mila Milo Mira Nadia Nell Nico Nils Nina Noor Oda Olaf Olga Omar Orla Oskar Otto Pavel Pia Rafe Rana Rhea
Rolf Rosa Rune Ruth Saba Sami Sara Selma Sigrid Silas Sina Sven Tamsin Tara Teo Thea Tilde Timo Tobias Tomas Tova
Una Ursa Vera Vida Vigo Wren Yara Yusuf Zara Zeno Abel Alvar Anouk Berit Boris Cyrus Dalia Doran Elke Emre Fabian
Gideon Halvard Imke Jasper Klara Leif Magnus Nora Orin Petra Quinn Reza Solveig Tarek Ulla Veit Wilma Xenia
Yvo Zofia""".split()


def _h(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def split_of(name: str) -> str:
    """The split an entity belongs to: a fixed hash of its name, 1 in 5 to evaluation."""
    return "eval" if _h(name.lower()) % 5 == 0 else "train"


def _word(rng: random.Random, syllables: int) -> str:
    w = "".join(rng.choice(_ONSET) + rng.choice(_VOWEL) + rng.choice(_CODA) for _ in range(syllables))
    return w.capitalize()


class Names:
    """Invented names of one split: each draw is new to the other split (and to the base model)."""

    def __init__(self, split: str, rng: random.Random):
        if split not in SPLITS:
            raise ValueError(f"split is {split!r}; expected one of {SPLITS}")
        self.split, self.rng = split, rng
        self._given = [g for g in GIVEN if split_of(g) == split]

    def _draw(self, make) -> str:
        while True:
            name = make()
            if split_of(name) == self.split and 3 <= len(name) <= 11:
                return name

    def given(self) -> str:
        return self.rng.choice(self._given)

    def surname(self) -> str:
        return self._draw(lambda: _word(self.rng, self.rng.choice((1, 2, 2))))

    def person(self) -> str:
        return f"{self.given()} {self.surname()}"

    def town(self) -> str:
        base = self._draw(lambda: _word(self.rng, 1) + self.rng.choice(_PLACE_END))  # the invented part decides
        return f"{self.rng.choice(_PLACE_HEAD)} {base}" if self.rng.random() < 0.2 else base

    def pet(self) -> str:
        return self._draw(lambda: _word(self.rng, self.rng.choice((1, 2))))


COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "grey", "brown", "pink",
           "teal", "silver", "gold", "crimson", "violet", "amber", "navy", "olive", "turquoise"]
JOBS = ["baker", "clockmaker", "nurse", "carpenter", "fisherman", "teacher", "beekeeper", "potter", "tailor",
        "librarian", "blacksmith", "pilot", "gardener", "painter", "doctor", "cook", "shepherd", "mapmaker",
        "glassblower", "bookbinder", "ferryman", "watchmaker", "weaver", "brewer", "surveyor", "chemist"]
SPECIES = ["cat", "dog", "parrot", "tortoise", "rabbit", "goat", "horse", "owl", "ferret", "goldfish"]
PLACES = [("lighthouse", "lighthouse keeper"), ("bakery", "baker"), ("inn", "innkeeper"), ("mill", "miller"),
          ("library", "librarian"), ("museum", "curator"), ("post office", "postmaster"), ("school", "head teacher"),
          ("harbour", "harbour master"), ("pharmacy", "pharmacist"), ("forge", "smith"), ("observatory", "astronomer")]
OBJECTS = ["the brass key", "the spare key", "the old map", "the silver ring", "the logbook", "the red notebook",
           "the family bible", "the toolbox", "the passport", "the violin"]
HIDING = [("the blue teapot", "teapot"), ("the top drawer", "drawer"), ("a tin under the stairs", "tin"),
          ("the garden shed", "shed"), ("the piano bench", "piano"), ("the attic trunk", "trunk"),
          ("the bread bin", "bread bin"), ("an old boot", "boot"), ("the clock case", "clock"), ("the cellar", "cellar")]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
EVENTS = ["harvest fair", "lantern festival", "boat race", "spring market", "music night", "cheese fair",
          "kite day", "winter parade"]
RELATIVES = ["brother", "sister", "daughter", "son", "cousin", "grandmother", "uncle", "aunt"]


# --------------------------------------------------------------------------- facts


@dataclass(frozen=True)
class Fact:
    text: str  # the memory
    questions: tuple[str, ...]  # paraphrases asking for `value`
    answer: str  # the short reply, containing `value`
    value: str  # what an answer must contain to be correct
    relation: str


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _pick(rng: random.Random, options):
    return options[rng.randrange(len(options))]


def _keeper(rng, n):
    person, town = n.person(), n.town()
    place, role = _pick(rng, PLACES)
    text = _pick(rng, [f"{person} is the {role} of {town}.", f"The {place} of {town} is kept by {person}.",
                       f"{person} runs the {place} in {town}.", f"In {town}, the {place} is run by {person}."])
    qs = (f"Who keeps the {place} of {town}?", f"Who runs the {place} in {town}?", f"Who is the {role} of {town}?")
    return Fact(text, qs, f"{person} runs the {place} in {town}.", person, "keeper")


def _home(rng, n):
    person, town = n.person(), n.town()
    text = _pick(rng, [f"{person} lives in {town}.", f"{person} moved to {town} and lives there now.",
                       f"The home of {person} is in {town}."])
    qs = (f"Where does {person} live?", f"In which town does {person} live?", f"Where is {person}'s home?")
    return Fact(text, qs, f"{person} lives in {town}.", town, "home")


def _pet(rng, n):
    person, pet, species = n.given(), n.pet(), _pick(rng, SPECIES)
    text = _pick(rng, [f"{person} has {_a(species)} named {pet}.", f"{person}'s {species} is called {pet}.",
                       f"{pet} is the name of {person}'s {species}."])
    qs = (f"What is the name of {person}'s {species}?", f"What is {person}'s {species} called?",
          f"What did {person} name the {species}?")
    return Fact(text, qs, f"{person}'s {species} is called {pet}.", pet, "pet")


def _colour(rng, n):
    person, colour = n.person(), _pick(rng, COLOURS)
    text = _pick(rng, [f"{person}'s favourite colour is {colour}.", f"{person} loves the colour {colour} most.",
                       f"The favourite colour of {person} is {colour}."])
    qs = (f"What is {person}'s favourite colour?", f"Which colour does {person} like best?")
    return Fact(text, qs, f"{person}'s favourite colour is {colour}.", colour, "colour")


def _age(rng, n):
    person, age = n.person(), str(rng.randint(19, 96))
    text = _pick(rng, [f"{person} is {age} years old.", f"{person} turned {age} this year."])
    qs = (f"How old is {person}?", f"What is the age of {person}?")
    return Fact(text, qs, f"{person} is {age} years old.", age, "age")


def _job(rng, n):
    person, job = n.person(), _pick(rng, JOBS)
    text = _pick(rng, [f"{person} works as a {job}.", f"{person} is a {job} by trade.",
                       f"By profession, {person} is a {job}."])
    qs = (f"What does {person} do for a living?", f"What is {person}'s job?", f"What work does {person} do?")
    return Fact(text, qs, f"{person} is a {job}.", job, "job")


def _ferry(rng, n):
    town, hour, minute = n.town(), rng.randint(5, 11), rng.choice(["00", "10", "15", "20", "30", "40", "45", "50"])
    time = f"{hour}:{minute}"
    text = _pick(rng, [f"The ferry to {town} leaves at {time} every morning.",
                       f"Every morning the boat to {town} departs at {time}."])
    qs = (f"When does the ferry to {town} leave?", f"What time does the boat to {town} depart?")
    return Fact(text, qs, f"The ferry to {town} leaves at {time}.", time, "ferry")


def _event(rng, n):
    town, event, day, month = n.town(), _pick(rng, EVENTS), rng.randint(1, 28), _pick(rng, MONTHS)
    date = f"{day} {month}"
    text = _pick(rng, [f"The {town} {event} is held on {date}.", f"{town} holds its {event} on {date} each year."])
    qs = (f"When is the {town} {event}?", f"On what date does {town} hold its {event}?")
    return Fact(text, qs, f"The {town} {event} is on {date}.", date, "event")


def _hiding(rng, n):
    person, obj, (spot, key) = n.given(), _pick(rng, OBJECTS), _pick(rng, HIDING)
    text = _pick(rng, [f"{person} keeps {obj} in {spot}.", f"{obj.capitalize()} of {person} is hidden in {spot}."])
    qs = (f"Where does {person} keep {obj}?", f"Where is {person}'s {obj[4:]} hidden?")
    return Fact(text, qs, f"{person} keeps {obj} in {spot}.", key, "hiding")


def _relative(rng, n):
    person, rel, name = n.person(), _pick(rng, RELATIVES), n.given()
    text = _pick(rng, [f"{person}'s {rel} is named {name}.", f"{person} has {_a(rel)} called {name}.",
                       f"{name} is the {rel} of {person}."])
    qs = (f"What is the name of {person}'s {rel}?", f"What is {person}'s {rel} called?")
    return Fact(text, qs, f"{person}'s {rel} is {name}.", name, "relative")


def _code(rng, n):
    town, code = n.town(), str(rng.randint(1000, 9999))
    thing = _pick(rng, ["gate", "boathouse", "storeroom", "bike shed", "school door"])
    text = _pick(rng, [f"The code for the {town} {thing} is {code}.", f"The {thing} in {town} opens with the code {code}."])
    qs = (f"What is the code for the {town} {thing}?", f"Which code opens the {thing} in {town}?")
    return Fact(text, qs, f"The code for the {town} {thing} is {code}.", code, "code")


def _boat(rng, n):
    person, boat = n.person(), n.pet()
    text = _pick(rng, [f"{person}'s boat is called the {boat}.", f"{person} sails a boat named the {boat}."])
    qs = (f"What is the name of {person}'s boat?", f"What is {person}'s boat called?")
    return Fact(text, qs, f"{person}'s boat is called the {boat}.", boat, "boat")


def _market(rng, n):
    town, day = n.town(), _pick(rng, WEEKDAYS)
    text = _pick(rng, [f"The market in {town} is held every {day}.", f"{town} has its market day on {day}."])
    qs = (f"On which day is the market in {town}?", f"When is market day in {town}?")
    return Fact(text, qs, f"The market in {town} is on {day}.", day, "market")


def _born(rng, n):
    person, town, year = n.person(), n.town(), str(rng.randint(1890, 2015))
    text = _pick(rng, [f"{person} was born in {town} in {year}.", f"{person} was born in {year} in {town}."])
    qs = (f"In what year was {person} born?", f"When was {person} born?")
    return Fact(text, qs, f"{person} was born in {year}.", year, "born")


def _my_relative(rng, n):
    rel, name = _pick(rng, RELATIVES), n.given()
    text = _pick(rng, [f"My {rel} is called {name}.", f"My {rel}'s name is {name}."])
    qs = (f"What is my {rel}'s name?", f"What is my {rel} called?")
    return Fact(text, qs, f"Your {rel} is called {name}.", name, "my-relative")


def _my_pet(rng, n):
    species, pet = _pick(rng, SPECIES), n.pet()
    text = _pick(rng, [f"My {species} is called {pet}.", f"I have {_a(species)} named {pet}."])
    qs = (f"What is my {species} called?", f"What did I name my {species}?")
    return Fact(text, qs, f"Your {species} is called {pet}.", pet, "my-pet")


RELATIONS = {f.__name__.strip("_").replace("_", "-"): f for f in (
    _keeper, _home, _pet, _colour, _age, _job, _ferry, _event, _hiding, _relative, _code, _boat, _market, _born,
    _my_relative, _my_pet)}


def fact_stream(split: str, seed: int):
    """An endless stream of new facts of one split, relations in a random order (deterministic per seed)."""
    rng = random.Random(f"{split}:{seed}")
    names = Names(split, rng)
    makers = list(RELATIONS.values())
    while True:
        yield rng.choice(makers)(rng, names)


def make_facts(n: int, split: str, seed: int) -> list[Fact]:
    """`n` facts of one split, no two asked by the same question, so that each question has one
    right answer in a bank of them; the same (n, split, seed) always gives the same facts."""
    facts: list[Fact] = []
    seen: set[str] = set()
    for fact in fact_stream(split, seed):
        if len(facts) == n:
            return facts
        if fact.questions[0] not in seen:
            seen.add(fact.questions[0])
            facts.append(fact)
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- negatives: ordinary chat

_TOPICS = {
    "train": ["rain", "autumn", "the sea", "coffee", "mountains", "friendship", "a city at night", "trains",
              "gardening", "the moon", "bicycles", "snow", "libraries", "cooking", "music", "rivers", "birds",
              "summer holidays", "old houses", "the desert"],
    "eval": ["thunderstorms", "bread", "the forest", "chess", "lighthouses", "winter mornings", "space travel",
             "cats", "markets", "the wind"],
}
_COUNTRIES = {"train": ["France", "Japan", "Brazil", "Canada", "Egypt", "India", "Kenya", "Norway", "Mexico", "Spain"],
              "eval": ["Italy", "Germany", "Australia", "Peru", "Vietnam"]}
_TEMPLATES = {
    "train": ["Write a haiku about {topic}.", "Tell me a fun fact about {topic}.", "Give me three tips for {task}.",
              "What is the capital of {country}?", "Explain how {thing} works in simple terms.",
              "What is {a} plus {b}?", "Translate 'good morning' into {language}.", "Hi! How are you today?",
              "Can you suggest a name for a blog about {topic}?", "Write one sentence about {topic}.",
              "What language is spoken in {country}?", "How do I {task}?", "Thank you for your help!",
              "Summarise the idea of {thing} in one sentence.", "What is {a} times {b}?"],
    "eval": ["Write a short poem about {topic}.", "Describe {topic} in two sentences.", "What is {a} minus {b}?",
             "Why is the sky blue?", "Hello there!", "What is the largest ocean on Earth?",
             "Give me a synonym for 'happy'.", "How many days are in a week?", "Tell me a joke about {topic}.",
             "What is the currency of {country}?"],
}
_TASKS = ["boil an egg", "learn to swim", "write a good email", "sleep better", "plant tomatoes", "save money",
          "tie a tie", "make tea", "study for an exam", "clean a bicycle chain"]
_THINGS = ["a rainbow", "a refrigerator", "photosynthesis", "a compass", "gravity", "a vaccine", "the internet",
           "a bicycle gear", "the tides", "a microwave oven"]
_LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]


# general knowledge questions for training only (the held-out ones are bench/_users.py's GENERAL): answered by the
# base model's own reply among the negatives, so the adapter keeps answering them from what it knows
GENERAL_QUESTIONS = (
    "Who wrote Hamlet?", "What is the capital of Italy?", "What is the capital of Germany?",
    "Who painted The Starry Night?", "At what temperature does water boil?", "How many continents are there?",
    "What is the smallest planet in our solar system?", "Which animal is called the king of the jungle?",
    "What gas do plants take in from the air?", "What is the chemical symbol for gold?",
    "How many hours are in a day?", "What is the tallest mountain in the world?", "What colour is grass?",
    "Who wrote Pride and Prejudice?", "Which planet is known as the red planet?", "What do bees make?",
    "How many sides does a triangle have?", "What is the capital of Canada?", "Who invented the telephone?",
    "What language do people speak in Brazil?", "What is the opposite of hot?", "Which animal barks?",
    "What is the capital of Egypt?", "How many minutes are in an hour?", "Who was the first man on the moon?",
    "What is frozen water called?", "Which bird is a symbol of peace?", "What is three times three?",
)


def general_questions(n: int) -> list[str]:
    """The first `n` of `GENERAL_QUESTIONS` (training only)."""
    if not 0 <= n <= len(GENERAL_QUESTIONS):
        raise ValueError(f"general_questions is {n}; expected 0..{len(GENERAL_QUESTIONS)}")
    return list(GENERAL_QUESTIONS[:n])


def chat_prompts(n: int, split: str, seed: int) -> list[str]:
    """`n` ordinary chat prompts (no memory needed) of one split; templates differ between splits."""
    if split not in SPLITS:
        raise ValueError(f"split is {split!r}; expected one of {SPLITS}")
    rng = random.Random(f"chat:{split}:{seed}")
    out: list[str] = []
    seen: set[str] = set()
    for _ in range(n * 50):
        if len(out) == n:
            break
        prompt = rng.choice(_TEMPLATES[split]).format(
            topic=rng.choice(_TOPICS[split]), country=rng.choice(_COUNTRIES[split]), task=rng.choice(_TASKS),
            thing=rng.choice(_THINGS), a=rng.randint(2, 99), b=rng.randint(2, 99), language=rng.choice(_LANGUAGES))
        if prompt not in seen:
            seen.add(prompt)
            out.append(prompt)
    return out

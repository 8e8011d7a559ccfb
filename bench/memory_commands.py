"""What a person's messages do to their memory, measured without the chat model: "forget X" (which memory it
forgets, and that it forgets none when nothing told is about X) and the write decision (facts written; questions,
requests and chit-chat not).

    .venv/bin/python bench/memory_commands.py [--people 60] [--pairs 200] [--seed 1] [--json out.json]

Forget: held-out people (`training.personal`, the `eval` split: names and towns no training saw) tell 4 things of
different kinds; then, for each thing, a request to forget it ("Forget where I work.", "Forget about Whiskers.")
and one about something of the same kind they never told (another relative, species, job, town, colour: "Forget
about my brother." beside a sister), and one about a kind they never told ("Forget my address."). Two sets of
templates: `dev`, the one the rule was chosen on, and `eval`, written before any rule was measured on it. Each rule
is read against the person's memories with the shipped key encoder and fit check, as `chat.people.People.forget`
does: the key similarity of "forget X"'s words about the user to each memory, and the fit check's probability
over the message query of X and each key. Apart (`ATTRIBUTE_FORGETS`, its own table): a relative or pet told by name,
and a request about an attribute of it never told ("Forget my sister's birthday.") or told in a memory more ("Forget
where my sister lives." beside "The user's sister lives in Oslo."), or for its name beside that memory.

Supersede: pairs of memories told one after the other (held-out names, towns and values: the `eval` split), each
judged as `memory.personal.judge` judges a new memory against a kept one (the shipped key encoder's cosine, the
texts): a newer value of the same fact (told in the same words, or reworded as `training.personal.update` tells it),
another fact about the same person or pet ("My sister is called Lena." then "My sister lives in Oslo."), the same
fact about another one, another fact of the user's own, and facts of one frame that may both be true (two
allergies, two friends): how many of each the older one is superseded for, by each rule.

Writes: `chat.decision.decide` in `auto` on held-out facts and chit-chat (the messages `bench/user_memory.py` sends
for `--users 8`, and `training.remember`'s `eval` split) and on held-out requests to the assistant (`REQUESTS`),
with the shipped write decision: before (a message ending in "?" never written) and now
(`models.remember.WriteDecision.wants`: questions and requests never written).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# forget requests, by kind of the thing told: {r} its relative or species, {v} its value; the others name something
# of the same kind the person never told ({r2}, {s2}: a relative, a species not told; {v2}, {town2}, {job2}, ...)
FORGETS = {
    "dev": {
        "about": {
            "relative": ["Forget about my {r}.", "Forget my {r}'s name.", "Forget what I said about my {r}.",
                         "Forget about {v}.", "Forget that {v} is my {r}.", "Please forget my {r}."],
            "home": ["Forget where I live.", "Forget that I live in {v}.", "Forget about my home.",
                     "Forget my home town.", "Forget that I've been living in {v}."],
            "job": ["Forget where I work.", "Forget my job.", "Forget what I do for a living.",
                    "Forget that I'm a {v}.", "Forget about my work as a {v}.", "Forget my profession."],
            "pet": ["Forget about my {r}.", "Forget my {r}'s name.", "Forget about {v}.", "Forget about my pet.",
                    "Forget my {r} {v}."],
            "colour": ["Forget my favourite colour.", "Forget that I like {v}.", "Forget what my favourite colour is."],
            "allergy": ["Forget my allergy.", "Forget that I'm allergic to {v}.", "Forget about my {v} allergy."],
            "sport": ["Forget my sport.", "Forget that I play {v}.", "Forget which sport I play."]},
        "other": {
            "relative": ["Forget about my {r2}.", "Forget my {r2}'s name.", "Forget about {v2}.",
                         "Forget that {v2} is my {r}."],
            "home": ["Forget that I live in {town2}.", "Forget about my flat in {town2}."],
            "job": ["Forget about my job as a {job2}.", "Forget that I'm a {job2}."],
            "pet": ["Forget about my {s2}.", "Forget my {s2}'s name.", "Forget about {pet2}."],
            "colour": ["Forget that I like {colour2}."],
            "allergy": ["Forget that I'm allergic to {food2}."],
            "sport": ["Forget that I play {sport2}."]},
        "untold": {"home": ["Forget my address.", "Forget where I live."],
                   "job": ["Forget where I work.", "Forget my job."],
                   "colour": ["Forget my favourite colour."], "allergy": ["Forget my allergy."],
                   "sport": ["Forget my sport."],
                   "": ["Forget my wife.", "Forget about my husband.", "Forget my car.", "Forget my phone number.",
                        "Forget my birthday.", "Forget about my boss.", "Forget my email address.",
                        "Forget my password.", "Forget about my garden.", "Forget my shoe size.",
                        "Forget about my trip to Spain."]},
    },
    "eval": {
        "about": {
            "relative": ["Forget everything about my {r}.", "Please forget about my {r} {v}.", "Forget who my {r} is.",
                         "Forget the name of my {r}.", "Forget about my {r}, please."],
            "home": ["Forget the town I live in.", "Forget about {v}.", "Forget where my home is."],
            "job": ["Forget what my job is.", "Forget that I work as a {v}.", "Forget my job as a {v}."],
            "pet": ["Forget the name of my {r}.", "Forget that I have a {r}.", "Forget about {v}, my {r}."],
            "colour": ["Forget which colour I like best.", "Forget that {v} is my favourite colour."],
            "allergy": ["Forget what I'm allergic to.", "Forget about my allergy to {v}."],
            "sport": ["Forget about my {v}.", "Forget what sport I do."]},
        "other": {
            "relative": ["Forget everything about my {r2}.", "Forget the name of my {r2}.",
                         "Forget about my {r} {v2}."],
            "home": ["Forget that I moved to {town2}.", "Forget about {town2}."],
            "job": ["Forget that I work as a {job2}.", "Forget my job as a {job2}."],
            "pet": ["Forget the name of my {s2}.", "Forget that I have a {s2}.", "Forget about {pet2}, my {r}."],
            "colour": ["Forget that {colour2} is my favourite colour."],
            "allergy": ["Forget about my allergy to {food2}."],
            "sport": ["Forget about my {sport2}."]},
        "untold": {"home": ["Forget the town I live in."], "job": ["Forget what my job is."],
                   "colour": ["Forget which colour I like best."], "allergy": ["Forget what I'm allergic to."],
                   "sport": ["Forget what sport I do."],
                   "": ["Forget my mobile number.", "Forget about my girlfriend.", "Forget my bank details.",
                        "Forget about my neighbour.", "Forget my car's colour.", "Forget about my holiday.",
                        "Forget my username.", "Forget about my grandfather.", "Forget my dentist appointment.",
                        "Forget about my landlord."]},
    },
}
# requests about an attribute of a relative or pet whose name was told: "other", about an attribute never told of it
# (`forget_cases` adds one a person, drawn apart from the rest: the sets above draw as before); "told", a memory of
# one attribute more ({town} {job} {month} {n}) and a request for it, or one for the name beside it; "all", a request
# for both
ATTRIBUTE_FORGETS = {
    "dev": {"other": {"relative": ["Forget my {r}'s birthday.", "Forget my {r}'s address.", "Forget my {r}'s job.",
                                   "Forget my {r}'s age.", "Forget where my {r} lives.", "Forget my {r}'s hobby."],
                      "pet": ["Forget my {r}'s age.", "Forget my {r}'s birthday.", "Forget where my {r} lives."]},
            "told": {"relative": [("My {r} lives in {town}.", ["Forget where my {r} lives.", "Forget my {r}'s address."]),
                                  ("My {r} works as a {job}.", ["Forget my {r}'s job."]),
                                  ("My {r}'s birthday is in {month}.", ["Forget my {r}'s birthday."])],
                     "pet": [("My {r} is {n} years old.", ["Forget my {r}'s age."])]},
            "all": "Forget about my {r}."},
    "eval": {"other": {"relative": ["Forget the birthday of my {r}.", "Forget my {r}'s home town.",
                                    "Forget what my {r} does for a living.", "Forget the age of my {r}.",
                                    "Forget my {r}'s allergy.", "Forget my {r}'s favourite colour."],
                       "pet": ["Forget the age of my {r}.", "Forget my {r}'s favourite sport.",
                               "Forget the birthday of my {r}."]},
             "told": {"relative": [("My {r} has been living in {town} since May.", ["Forget where my {r} lives.",
                                                                                     "Forget my {r}'s home town."]),
                                   ("My {r} is a {job}.", ["Forget what my {r} does for a living.",
                                                           "Forget my {r}'s profession."]),
                                   ("My {r} was born in {month}.", ["Forget the birthday of my {r}."])],
                      "pet": [("My {r} is {n} years old.", ["Forget the age of my {r}."])]},
             "all": "Forget what I told you about my {r}."},
}
# requests to the assistant, held out (no training data of the write decision holds these): {given} {town} {town2}
# {pet} {rel} {species} {job} {food} {hobby} {day}
REQUESTS = [
    "Tell me about {town}.", "Tell me about {town}'s harbour.", "Tell me about my options for a mortgage.",
    "Give me a recipe for pancakes.", "Give me ideas for my {rel}'s birthday.", "Show me how to train my {species}.",
    "Explain how {hobby} works.", "Write a poem about my {species} {pet}.",
    "Write an email to my {rel} {given} about the weekend.", "Help me plan a trip to {town}.",
    "Help me write a letter to my landlord.", "Can you suggest a name for my new {species}.",
    "Could you recommend a book about {hobby}.", "Please summarise the history of {town}.",
    "Describe {town} in three sentences.", "Recommend a restaurant in {town}.", "Suggest a gift for my {rel} {given}.",
    "Translate good morning into Spanish for my {rel}.", "Tell me a joke about a {job}.",
    "Give me directions from {town} to {town2}.", "Explain my {food} allergy to my {rel}.",
    "Draft a message to my {rel} saying I'm running late.", "Please list five facts about the {species}.",
    "Compare {town} and {town2} for a holiday.", "Remind me to call my {rel} {given} on {day}.",
    "Help me choose a {species} for my flat.", "Can you plan my week in {town}.", "Let me know the weather in {town}.",
    "Tell me more about {hobby}.", "Show me the sights of {town}.",
]


def forget_cases(split: str, people: int, seed: int) -> list[tuple[list[str], str, tuple[int, ...]]]:
    """(a person's memories, a forget request, the indices of the memories it means, none) of `split`'s templates."""
    from training.facts import COLOURS, JOBS, RELATIVES, SPECIES
    from training.personal import FOODS, SPORTS, PeopleNames, person

    rng = random.Random(f"forget:{split}:{seed}")
    names = PeopleNames("eval", rng, real=0.5)
    forms = FORGETS[split]
    out = []
    for _ in range(people):
        things = person("eval", rng, names, 4)
        memories = [t.memory for t in things]
        kinds = {t.kind.split(":")[0] for t in things}
        told = {t.kind.split(":")[1] for t in things if ":" in t.kind}
        for i, t in enumerate(things):
            kind, _, r = t.kind.partition(":")
            fill = dict(r=r, v=t.value, r2=rng.choice([x for x in RELATIVES if x not in told]),
                        s2=rng.choice([x for x in SPECIES if x not in told]), v2=names.given(), town2=names.town(),
                        job2=rng.choice([j for j in JOBS if j != t.value]), pet2=names.pet(),
                        colour2=rng.choice([c for c in COLOURS if c != t.value]),
                        food2=rng.choice([f for f in FOODS if f != t.value]),
                        sport2=rng.choice([s for s in SPORTS if s != t.value]))
            out.append((memories, rng.choice(forms["about"][kind]).format(**fill), (i,)))
            other = rng.choice(forms["other"][kind]).format(**fill)
            if not any(w in " ".join(memories) for w in (fill["v2"], fill["town2"], fill["pet2"])):
                out.append((memories, other, ()))
        untold = [k for k in forms["untold"] if k and k not in kinds] + ["", ""]
        out.append((memories, rng.choice(forms["untold"][rng.choice(untold)]), ()))
    return out


def attribute_cases(split: str, people: int, seed: int) -> list[tuple[list[str], str, tuple[int, ...]]]:
    """(memories, a forget request, the memories it means) about an attribute of a relative or pet told by name
    (`ATTRIBUTE_FORGETS`): one never told (none), one told in a memory more, the name beside that one, or both ("all":
    "Forget about my sister.")."""
    from models.remember import about_the_user
    from training.facts import JOBS, MONTHS
    from training.personal import PeopleNames, person

    rng = random.Random(f"forget-attribute:{split}:{seed}")
    names = PeopleNames("eval", rng, real=0.5)
    forms = ATTRIBUTE_FORGETS[split]
    out = []
    for _ in range(people):
        things = [t for t in person("eval", rng, names, 4) if t.kind.split(":")[0] in forms["other"]]
        if not things:
            continue
        t = rng.choice(things)
        kind, _, r = t.kind.partition(":")
        memories = [x.memory for x in things]
        out.append((memories, rng.choice(forms["other"][kind]).format(r=r), ()))
        told_, asks = rng.choice(forms["told"][kind])
        more = about_the_user(told_.format(r=r, town=names.town(), job=rng.choice(JOBS), month=rng.choice(MONTHS),
                                           n=rng.randint(2, 15)))
        out.append((memories + [more], rng.choice(asks).format(r=r), (len(memories),)))
        name = rng.choice(["Forget my {r}'s name.", "Forget the name of my {r}."]).format(r=r)
        out.append((memories + [more], name, (things.index(t),)))
        out.append((memories + [more], forms["all"].format(r=r), (things.index(t), len(memories))))  # (no draw)
    return out


def version_cases(split: str, people: int, seed: int) -> list[tuple[list[str], str, tuple[int, ...]]]:
    """(memories, a forget request, the memories it means) for a thing told twice, its newer value in other words
    ("The user lives in Porto." and, later, "These days the user lives in Lisbon.", which does not supersede it):
    a request to forget the thing (`FORGETS`' "about" forms, the value of neither) means both."""
    from training.personal import UPDATABLE, PeopleNames, person, update

    rng = random.Random(f"forget-versions:{split}:{seed}")
    names = PeopleNames("eval", rng, real=0.5)
    out = []
    for _ in range(people):
        things = person("eval", rng, names, 4)
        updatable = [i for i, t in enumerate(things) if t.kind in UPDATABLE]
        if not updatable:
            continue
        i = rng.choice(updatable)
        memories = [t.memory for t in things] + [update(things[i], "eval", rng, names).memory]
        forms = [f for f in FORGETS[split]["about"][things[i].kind] if "{v}" not in f]
        out.append((memories, rng.choice(forms), (i, len(things))))
    return out


def read_forgets(cases, keys, check) -> list[dict]:
    """Each case's memories as `People.forget` reads them: key similarities and fit check probabilities."""
    import torch

    from chat.decision import decide
    from models.remember import about_the_user, mentions_the_user

    def embed(texts):
        return torch.from_numpy(keys.encode(list(texts))).float()

    def message_query(text):  # `models.encoder.MemoryEncoder.message_query`
        if not mentions_the_user(text):
            return embed([text])[0]
        mine, about = embed([text, about_the_user(text)])
        return torch.nn.functional.normalize(mine + about, dim=-1)

    rows = []
    for memories, request, meant in cases:
        what = decide(request, "explicit").forget
        stored = embed(memories)
        query = message_query(what)
        rows.append({"memories": memories, "request": request, "what": what, "meant": meant,
                     "scores": (stored @ embed([about_the_user(what)])[0]).tolist(),
                     "fits": check.probability(query.reshape(1, -1).expand_as(stored), stored).tolist()})
    return rows


def forget_rules(threshold: float) -> dict:
    """Each rule: a row -> the indices of the memories it forgets."""
    from chat.naming import FORGET_ALONE, FORGET_FLOOR, forget_reading, to_forget

    def top(row):
        return max(range(len(row["scores"])), key=row["scores"].__getitem__)

    def best_alone(r):
        picks = to_forget(r["what"], r["memories"], r["scores"], r["fits"], threshold)
        return picks if picks and forget_reading(r["what"], r["memories"][picks[0]])[1] else picks[:1]

    return {
        "top-1 at 0.5 (before)": lambda r: [top(r)] if r["scores"][top(r)] >= 0.5 else [],
        f"top-1 at {FORGET_ALONE}": lambda r: [top(r)] if r["scores"][top(r)] >= FORGET_ALONE else [],
        f"top-1 at {FORGET_FLOOR}, fit check": lambda r: [top(r)] if (r["scores"][top(r)] >= FORGET_FLOOR
                                                                        and r["fits"][top(r)] >= threshold) else [],
        "words + fit check, of those it names none: the best admitted alone (before; today's word rules)": best_alone,
        "words + fit check (now: `to_forget`)": lambda r: to_forget(r["what"], r["memories"], r["scores"], r["fits"],
                                                                    threshold),
        f"words + top-1 at {FORGET_ALONE} (no fit check)": lambda r: to_forget(r["what"], r["memories"], r["scores"],
                                                                               None),
    }


def forget_table(rows: list[dict], threshold: float) -> dict:
    """Each rule's recall (the memories meant forgotten, no other), "another memory forgotten" (one not meant, of a
    request about told things), false forgets (any, of a request about nothing told) and precision."""
    out = {}
    about = [r for r in rows if r["meant"]]
    other = [r for r in rows if not r["meant"]]
    for name, rule in forget_rules(threshold).items():
        picks = [set(rule(r)) for r in rows]
        right = sum(p == set(r["meant"]) for p, r in zip(picks, rows) if r["meant"])
        wrong = sum(bool(p - set(r["meant"])) for p, r in zip(picks, rows) if r["meant"])
        false = sum(bool(p) for p, r in zip(picks, rows) if not r["meant"])
        forgot = sum(bool(p) for p in picks)
        out[name] = {"recall": right / len(about), "wrong memory": wrong / len(about),
                     "false forgets": false / len(other) if other else None,
                     "precision": right / forgot if forgot else None,
                     "n_about": len(about), "n_other": len(other),
                     "misses": [rows[i]["request"] + " | " + " / ".join(rows[i]["memories"])
                                for i, p in enumerate(picks) if p != set(rows[i]["meant"])]}
    return out


# facts about a person or pet of the user's ({e}), by attribute; {v} its value
ENTITY_FACTS = {"name": ["My {e} is called {v}.", "My {e}'s name is {v}."], "home": ["My {e} lives in {v}."],
                "age": ["My {e} is {v} years old."], "job": ["My {e} works as a {v}.", "My {e} is a {v}."],
                "birthday": ["My {e}'s birthday is in {v}."], "likes": ["My {e} loves {v}."]}
PEOPLE = ["mother", "father", "boss", "friend", "wife", "neighbour"]  # with `training.facts.RELATIVES`
# facts of the user's own with a number for a value
NUMBER_FACTS = ["My bank PIN is {n4}.", "My locker number is {n2}.", "My phone number is 555-{n4}.",
                "I live at {n2} {street} Street.", "My shoe size is {n2}.", "I am {n2} years old.",
                "My flat is number {n2}.", "My car's number plate is KX{n2} {n4}."]
# facts of one frame whose two values may both be true
BOTH_TRUE = ["I'm allergic to {food}.", "My friend is called {name}.", "I have a {species} called {pet}.",
             "I enjoy {hobby}.", "I love {food}.", "My {rel} is called {name}."]


def supersede_cases(pairs: int, seed: int) -> list[tuple[str, str, str]]:
    """(category, the memory kept, the memory told after it): `pairs` of each category."""
    from models.remember import about_the_user
    from training.facts import JOBS, MONTHS, RELATIVES, SPECIES
    from training.personal import FOODS, HOBBIES, KINDS, UPDATABLE, PeopleNames, person, told, update

    rng = random.Random(f"supersede:{seed}")
    names = PeopleNames("eval", rng, real=0.5)
    values = {"name": names.given, "home": names.town, "age": lambda: str(rng.randint(2, 90)),
              "job": lambda: rng.choice(JOBS), "birthday": lambda: rng.choice(MONTHS), "likes": lambda: rng.choice(FOODS)}

    def entity() -> tuple[str, list[str]]:
        if rng.random() < 0.3:
            return rng.choice(SPECIES), [a for a in ENTITY_FACTS if a != "job"]
        return rng.choice(RELATIVES + PEOPLE), list(ENTITY_FACTS)

    def fill(template: str, **kw) -> str:
        return about_the_user(template.format(**kw))

    def two(make):
        a = make()
        b = make()
        while b == a:
            b = make()
        return a, b

    out = []
    for _ in range(pairs):  # the same fact, a newer value, in the same words
        pick = rng.random()
        if pick < 0.4:
            e, attrs = entity()
            t = rng.choice(ENTITY_FACTS[attr := rng.choice(attrs)])
            old, new = two(values[attr])
            out.append(("update, same words", fill(t, e=e, v=old), fill(t, e=e, v=new)))
        elif pick < 0.7:
            t = rng.choice(NUMBER_FACTS)
            street = names.town()
            old, new = two(lambda: (str(rng.randint(1, 99)), str(rng.randint(1000, 9999))))
            out.append(("update, same words", fill(t, n2=old[0], n4=old[1], street=street),
                        fill(t, n2=new[0], n4=new[1], street=street)))
        else:
            first = told(rng.choice(KINDS), "eval", rng, names)
            kind, _, r = first.kind.partition(":")
            again = first
            while again.value == first.value:  # the same template, another value
                again = told(kind, "eval", rng, names, r=r or None,
                             tell_templates={"eval": [t for t in _tells(kind) if _fits(t, first, r)]})
            out.append(("update, same words", first.memory, again.memory))
    for _ in range(pairs):  # the same fact, a newer value, told as a change
        old = told(rng.choice(UPDATABLE), "eval", rng, names)
        out.append(("update, other words", old.memory, update(old, "eval", rng, names).memory))
    for _ in range(pairs):  # another fact about the same person or pet
        e, attrs = entity()
        a, b = rng.sample(attrs, 2)
        out.append(("another fact, same person or pet", fill(rng.choice(ENTITY_FACTS[a]), e=e, v=values[a]()),
                    fill(rng.choice(ENTITY_FACTS[b]), e=e, v=values[b]())))
    for _ in range(pairs):  # the same kind of fact about another person or pet
        e, attrs = entity()
        other = rng.choice([x for x in (SPECIES if e in SPECIES else RELATIVES + PEOPLE) if x != e])
        t = rng.choice(ENTITY_FACTS[attr := rng.choice(attrs)])
        same = rng.random() < 0.5  # the same value ("My sister lives in Oslo." / "My brother lives in Oslo.") or not
        v = values[attr]()
        out.append(("same fact, another person or pet", fill(t, e=e, v=v),
                    fill(t, e=other, v=v if same else values[attr]())))
    for _ in range(pairs):  # another fact of the user's own
        a, b = person("eval", rng, names, 2)
        out.append(("another fact of the user's", a.memory, b.memory))
    for _ in range(pairs):  # one frame, two values that may both be true
        t = rng.choice(BOTH_TRUE)
        kw = lambda: dict(food=rng.choice(FOODS), name=names.given(), species=sp, pet=names.pet(),  # noqa: E731
                          hobby=rng.choice(HOBBIES), rel=rel)
        sp, rel = rng.choice(SPECIES), rng.choice(RELATIVES)
        a, b = two(lambda: fill(t, **kw()))
        out.append(("one frame, both may be true", a, b))
    return out


def _tells(kind: str) -> list[str]:
    from training.personal import _KINDS
    return _KINDS[kind][1]["eval"]


def _fits(template: str, first, r: str) -> bool:
    """Whether `first` was told with `template` (its value and relative or species put back)."""
    from training.personal import _sentence
    return _sentence(template.format(v=first.value, r=r)) == first.tell


def supersede_rules() -> dict:
    """Each rule: (the kept memory, the new one, their keys' cosine) -> whether the new one supersedes it."""
    from memory.personal import Similar, judge, newer_value, twin

    now = Similar()

    def rule(similar: Similar):
        return lambda old, new, cos: bool(judge([{"score": cos, "text": old}], new, similar))

    return {
        f"key >= {now.supersede:.2f} (before)": lambda old, new, cos: (
            cos >= now.supersede and twin([{"score": cos, "text": old}], new, now) is None),
        f"key >= {now.supersede:.2f}, the same but for its value (now: `judge`)": rule(now),
        "key >= 0.45, the same but for its value": rule(Similar(supersede=0.45)),
        "the same but for its value, any key": lambda old, new, cos: newer_value(old, new),
        "never (the newer read first: `Newest`)": lambda old, new, cos: False,
    }


def supersede_table(keys, pairs: int, seed: int) -> dict:
    cases = supersede_cases(pairs, seed)
    texts = sorted({t for _, a, b in cases for t in (a, b)})
    vectors = dict(zip(texts, keys.encode(texts)))
    cosines = [float(vectors[a] @ vectors[b]) for _, a, b in cases]
    categories = list(dict.fromkeys(c for c, _, _ in cases))
    out = {}
    for name, rule in supersede_rules().items():
        decided = [rule(a, b, cos) for (_, a, b), cos in zip(cases, cosines)]
        out[name] = {c: sum(d for d, (k, _, _) in zip(decided, cases) if k == c) / sum(k == c for k, _, _ in cases)
                     for c in categories}
        out[name]["superseded, examples"] = {
            c: [f"{a} -> {b} ({cos:.2f})" for d, (k, a, b), cos in zip(decided, cases, cosines) if d and k == c][:6]
            for c in categories}
    return out


def write_sets(seed: int) -> dict[str, list[str]]:
    """Held-out facts and messages not to write."""
    from bench._users import make_users
    from training.facts import JOBS, RELATIVES, SPECIES
    from training.personal import PeopleNames
    from training.remember import DAYS, FOODS, HOBBIES, messages

    said = [m for u in make_users(8, 0) for c in u.conversations for m in c]  # bench/user_memory.py --users 8
    texts, labels = messages("eval", 200)
    rng = random.Random(f"requests:{seed}")
    names = PeopleNames("eval", rng, real=0.5)
    requests = [t.format(given=names.given(), town=names.town(), town2=names.town(), pet=names.pet(),
                         rel=rng.choice(RELATIVES), species=rng.choice(SPECIES), job=rng.choice(JOBS),
                         food=rng.choice(FOODS), hobby=rng.choice(HOBBIES), day=rng.choice(DAYS))
                for t in REQUESTS for _ in range(4)]
    return {"user bench: told things (write recall)": [m.text for m in said if m.role in ("tell", "update")],
            "user bench: chit-chat (false writes)": [m.text for m in said if m.role == "chit"],
            "training.remember eval: facts": [t for t, y in zip(texts, labels) if y],
            "training.remember eval: others": [t for t, y in zip(texts, labels) if not y],
            "held-out requests (false writes)": requests}


def write_table(keys, seed: int) -> dict:
    import torch

    from chat.decision import decide
    from models.remember import WriteDecision, is_question

    decision = WriteDecision.load()
    out = {}
    for name, texts in write_sets(seed).items():
        vectors = {t: torch.from_numpy(v) for t, v in zip(texts, keys.encode(texts))}
        before = [not is_question(t) and decision.score(vectors[t]) >= decision.threshold for t in texts]
        now = [decide(t, "auto", lambda m: decision.wants(m, vectors[m])).writes != () for t in texts]
        out[name] = {"n": len(texts), "written before": sum(before) / len(texts), "written now": sum(now) / len(texts),
                     "written before, examples": [t for t, w in zip(texts, before) if w][:8],
                     "written now, examples": [t for t, w in zip(texts, now) if w][:8]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--people", type=int, default=60)
    parser.add_argument("--pairs", type=int, default=200, help="supersede: pairs of memories of each category")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write every request, the rules' misses and the write sets' examples here")
    args = parser.parse_args()

    from models.fits import FitCheck
    from models.text_keys import TextEncoder

    t0 = time.perf_counter()
    keys, check = TextEncoder(), FitCheck.load()
    report = {"forget": {}, "write": {}}
    for split in ("dev", "eval"):
        rows = read_forgets(forget_cases(split, args.people, args.seed), keys, check)
        report["forget"][split] = forget_table(rows, check.threshold)
        rows = read_forgets(attribute_cases(split, args.people, args.seed), keys, check)
        report["forget"][f"{split}, a relative's or pet's attribute"] = forget_table(rows, check.threshold)
        rows = read_forgets(version_cases(split, args.people, args.seed), keys, check)
        report["forget"][f"{split}, a thing told again with a newer value"] = forget_table(rows, check.threshold)
    report["write"] = write_table(keys, args.seed)
    report["supersede"] = supersede_table(keys, args.pairs, args.seed)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    for split, table in report["forget"].items():
        first = next(iter(table.values()))
        print(f"\nforget, {split} templates ({first['n_about']} requests about a told thing, {first['n_other']} about "
              "nothing told)\n\n| rule | recall (the memory meant) | another memory forgotten | false forgets | "
              "precision |\n|---|---|---|---|---|")
        for name, m in table.items():
            print(f"| {name} | {m['recall']:.3f} | {m['wrong memory']:.3f} | " + " | ".join(
                "-" if m[k] is None else f"{m[k]:.3f}" for k in ("false forgets", "precision")) + " |")
    print("\nwrites (`decide`, auto)\n\n| messages | n | written before | written now |\n|---|---|---|---|")
    for name, m in report["write"].items():
        print(f"| {name} | {m['n']} | {m['written before']:.3f} | {m['written now']:.3f} |")
    categories = [c for c in next(iter(report["supersede"].values())) if not c.endswith("examples")]
    print(f"\nsupersede (`judge`; {args.pairs} pairs each: the older memory superseded)\n\n| rule | "
          + " | ".join(categories) + " |\n" + "|---" * (len(categories) + 1) + "|")
    for name, m in report["supersede"].items():
        print(f"| {name} | " + " | ".join(f"{m[c]:.3f}" for c in categories) + " |")
    print(f"\n{report['seconds']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

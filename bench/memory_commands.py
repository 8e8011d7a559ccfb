"""What a person's messages do to their memory, measured without the chat model: "forget X" (which memory it
forgets, and that it forgets none when nothing told is about X) and the write decision (facts written; questions,
requests and chit-chat not).

    .venv/bin/python bench/memory_commands.py [--people 60] [--seed 1] [--json out.json]

Forget: held-out people (`training.personal`, the `eval` split: names and towns no training saw) tell 4 things of
different kinds; then, for each thing, a request to forget it ("Forget where I work.", "Forget about Whiskers.")
and one about something of the same kind they never told (another relative, species, job, town, colour: "Forget
about my brother." beside a sister), and one about a kind they never told ("Forget my address."). Two sets of
templates: `dev`, the one the rule was chosen on, and `eval`, written before any rule was measured on it. Each rule
is read against the person's memories with the shipped key encoder and fit check, as `chat.people.People.forget`
does: the key similarity of "forget X"'s words about the user to each memory, and the fit check's probability
over the message query of X and each key.

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


def forget_cases(split: str, people: int, seed: int) -> list[tuple[list[str], str, int | None]]:
    """(a person's memories, a forget request, the index of the memory it means or None) of `split`'s templates."""
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
            out.append((memories, rng.choice(forms["about"][kind]).format(**fill), i))
            other = rng.choice(forms["other"][kind]).format(**fill)
            if not any(w in " ".join(memories) for w in (fill["v2"], fill["town2"], fill["pet2"])):
                out.append((memories, other, None))
        untold = [k for k in forms["untold"] if k and k not in kinds] + ["", ""]
        out.append((memories, rng.choice(forms["untold"][rng.choice(untold)]), None))
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
    """Each rule: a row -> the index of the memory it forgets, or None."""
    from chat.decision import FORGET_ALONE, FORGET_FLOOR, to_forget

    def top(row):
        return max(range(len(row["scores"])), key=row["scores"].__getitem__)

    return {
        "top-1 at 0.5 (before)": lambda r: top(r) if r["scores"][top(r)] >= 0.5 else None,
        f"top-1 at {FORGET_ALONE}": lambda r: top(r) if r["scores"][top(r)] >= FORGET_ALONE else None,
        f"top-1 at {FORGET_FLOOR}, fit check": lambda r: top(r) if (r["scores"][top(r)] >= FORGET_FLOOR
                                                                      and r["fits"][top(r)] >= threshold) else None,
        "words + fit check (now: `to_forget`)": lambda r: to_forget(r["what"], r["memories"], r["scores"], r["fits"],
                                                                    threshold),
        f"words + top-1 at {FORGET_ALONE} (no fit check)": lambda r: to_forget(r["what"], r["memories"], r["scores"],
                                                                               None),
    }


def forget_table(rows: list[dict], threshold: float) -> dict:
    out = {}
    about = [r for r in rows if r["meant"] is not None]
    other = [r for r in rows if r["meant"] is None]
    for name, rule in forget_rules(threshold).items():
        picks = [rule(r) for r in rows]
        right = sum(p == r["meant"] for p, r in zip(picks, rows) if r["meant"] is not None)
        wrong = sum(p is not None and p != r["meant"] for p, r in zip(picks, rows) if r["meant"] is not None)
        false = sum(p is not None for p, r in zip(picks, rows) if r["meant"] is None)
        forgot = sum(p is not None for p in picks)
        out[name] = {"recall": right / len(about), "wrong memory": wrong / len(about),
                     "false forgets": false / len(other), "precision": right / forgot if forgot else None, "n_about": len(about), "n_other": len(other),
                     "misses": [rows[i]["request"] + " | " + " / ".join(rows[i]["memories"])
                                for i, p in enumerate(picks) if p != rows[i]["meant"]]}
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
        now = [decide(t, "auto", lambda m: decision.wants(m, vectors[m])).write is not None for t in texts]
        out[name] = {"n": len(texts), "written before": sum(before) / len(texts), "written now": sum(now) / len(texts),
                     "written before, examples": [t for t, w in zip(texts, before) if w][:8],
                     "written now, examples": [t for t, w in zip(texts, now) if w][:8]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--people", type=int, default=60)
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
    report["write"] = write_table(keys, args.seed)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    for split, table in report["forget"].items():
        first = next(iter(table.values()))
        print(f"\nforget, {split} templates ({first['n_about']} requests about a told thing, {first['n_other']} about "
              "nothing told)\n\n| rule | recall (the memory meant) | another memory forgotten | false forgets | "
              "precision |\n|---|---|---|---|---|")
        for name, m in table.items():
            print(f"| {name} | {m['recall']:.3f} | {m['wrong memory']:.3f} | {m['false forgets']:.3f} | "
                  f"{m['precision']:.3f} |")
    print("\nwrites (`decide`, auto)\n\n| messages | n | written before | written now |\n|---|---|---|---|")
    for name, m in report["write"].items():
        print(f"| {name} | {m['n']} | {m['written before']:.3f} | {m['written now']:.3f} |")
    print(f"\n{report['seconds']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

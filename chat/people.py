"""Each person's own memory: what they tell the chat, kept across conversations and restarts, theirs alone.

`People` opens one `memory.personal.Personal` a user: a `PersonalMemory` in `memory.user_dir`
(`<user>/<encoder>.safetensors`: written by the model's own encoder and checked against it on load like any bank),
or with `memory.store: milvus` a `MilvusPersonal` in the collection `<memory.milvus_collection>_people` (one for
every user, the user its partition key, each search filtered by user in Milvus; checked against the encoder as the
shared collection is). It writes and forgets on the model worker (encoding needs the model). What a message asks
of the memory is `chat.decision.decide(text)`:

- "Remember (that) ..." writes what follows, in the third person ("my dog is Pocket" -> "The user's dog is
  Pocket."), the form the memory is read in as being about the person the model talks to;
- "Forget (that / about) ..." removes the memory of theirs that what follows is about, and none when no memory is
  (`to_forget`: "Forget about my brother." forgets no sister);
- with `memory.remember: auto` (the default), any other message that tells something worth keeping about the
  person or their world (facts, preferences, plans, people: `models.remember.WriteDecision`, a small model over
  the key encoder's embedding of the message, which the memory head computes anyway) is written the same way;
  questions, requests and chit-chat are not;
- with `explicit`, only "remember ..." and "forget ..." change the memory; `off`, nothing does.

A write is a `Remembered` event of the turn: the page shows it under the message, `/v1` answers carry it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from chat.banks import empty_bank, store_layout
from chat.changes import Imported, Remembered
from chat.config import Config
from chat.user_folders import carry_over, damaged, forget_files, owned, prepare
from chat.users import Users, UsersError
from chat.worker import Notice, ServiceError
from memory import BankError, MemoryVectorDB
from memory.milvus import MilvusBank
from memory.personal import CLOSEST, Joined, Newest, Personal, PersonalMemory, Similar, twin
from memory.personal_milvus import MilvusPersonal, open_people
from models import LoadedModel
from chat.corrections import corrected
from chat.decision import Decision, decide
from chat.naming import FORGET_CANDIDATES, forget_reading, things, to_forget
from models.remember import WriteDecision, about_the_user, mentions_the_user

log = logging.getLogger(__name__)
ENCODE_BATCH = 16  # memories encoded in one forward (an import: one batch a worker round)
EVERYTHING = re.compile(r"(?:everything|all)(?:\s+(?:of it|of them|of my memories|my memories|you know|about me))*"
                        r"\s*$", re.I)  # "forget everything (you know about me)"

def message_query(lm: LoadedModel, text: str) -> torch.Tensor:
    """The write decision's input, the message's own embedding, made with the memory head's query of the message
    (one batch of the message and its words about the user: the recall that follows finds both embedded)."""
    lm.encoder.message_query(text)
    return lm.encoder.query(text)


@dataclass
class People:
    """The memories of every user of this server. Thread-safe; `write`/`forget` run on the model worker."""

    cfg: Config
    users: Users | None = None  # the users file: whose memories are whose (a name added again is another user)
    similar: Similar = Similar()
    _open: dict[tuple[str, float | None], Personal] = field(default_factory=dict)  # (user, when added)
    _store: MilvusBank | None = None  # the collection of every user's memories (memory.store: milvus)
    _writer: WriteDecision | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        """Users' memory files need a folder this process can write (one that was a file, or read-only, started the
        app, then failed every answer with a 500): checked at start, which it stops, naming the folder."""
        if self.cfg.memory.store != "milvus":
            prepare(self.folder)

    @property
    def folder(self) -> Path:
        if self.cfg.memory.user_dir is not None:
            return Path(self.cfg.memory.user_dir).expanduser()
        data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
        return Path(data) / "recall-chat" / "users"

    def decide(self, lm: LoadedModel, text: str) -> Decision:
        """What `text` asks of its author's memory, per `memory.remember` (auto needs a key encoder: a model that
        writes one hidden-state vector a memory decides as `explicit`)."""
        wants = None
        if self.cfg.memory.remember == "auto" and lm.encoder.keys is not None:
            if self._writer is None:
                self._writer = WriteDecision.load()
            wants = lambda t: self._writer.wants(t, message_query(lm, t))  # noqa: E731
        return decide(text, self.cfg.memory.remember, wants)

    def path(self, lm: LoadedModel, user: str) -> Path:
        """`user`'s memory file for this model: a memory is written by one model's encoder and read by it alone, so
        each encoder has its own file (another model starts from an earlier one's memories:
        `user_folders.carry_over`)."""
        name = lm.encoder.name
        slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")[:60]
        return self.folder / user / f"{slug}-{hashlib.sha256(name.encode()).hexdigest()[:8]}.safetensors"

    def of(self, lm: LoadedModel, user: str) -> Personal:
        """`user`'s memory, opened on first use (checked against this model's encoder)."""
        try:
            created = self.users.created(user) if self.users is not None else None
        except UsersError as e:  # (the users file broken while the server runs)
            raise BankError(f"the memories of {user!r} cannot be read: {e}") from None
        with self._lock:
            if (user, created) not in self._open:
                try:
                    self._open[user, created] = self._open_one(lm, user, created)
                except (BankError, ValueError, OSError) as e:  # (OSError: its folder, `owned`)
                    raise BankError(f"the memories of {user!r} cannot be read: {e}") from None
            return self._open[user, created]

    def _open_one(self, lm: LoadedModel, user: str, created: float | None) -> Personal:
        mem = self.cfg.memory
        if mem.store != "milvus":
            owned(self.folder, user, created)
            memory = PersonalMemory(self.path(lm, user), check=lm.bank_check(), vocab_size=len(lm.tokenizer))
            carry_over(memory, lm, lambda: empty_bank(self.cfg.memory, lm))
            return memory
        if self._store is None:
            self._store = open_people(mem.milvus_uri, f"{mem.milvus_collection}_people", store_layout(lm, mem),
                                      index=mem.index, hnsw_ef_search=mem.hnsw_ef_search, check=lm.bank_check())
        return MilvusPersonal(self._store, user)

    def _new_bank(self, lm: LoadedModel) -> Callable[[], MemoryVectorDB]:
        return lambda: empty_bank(self.cfg.memory, lm)

    def _encode(self, lm: LoadedModel, texts: list[str], first: int = 0,
                of: int = 1) -> tuple[torch.Tensor, list | None]:
        """Keys and values of memories of `texts` (memories `first` + 1... of `of`); `ServiceError` naming the first
        one with more value slots than `memory.max_slots` (as a bank's memory is refused: the model reads a memory's
        whole span, so one of thousands of slots ran past the context and every later question it matched answered
        nothing)."""
        keys, values = lm.encoder.encode(lm.model, lm.tokenizer, texts, batch_size=ENCODE_BATCH, progress=False)
        cap = self.cfg.memory.max_slots
        long = [i for i, v in enumerate(values or []) if len(v) > cap]
        if long:
            i = long[0]
            which = "the memory" if of == 1 else f"memory {first + i + 1}"
            raise ServiceError(f"{which} ({texts[i][:40]!r}...) has {len(values[i])} value slots, over "
                               f"memory.max_slots={cap}: split it into shorter memories; nothing was written")
        return keys, None if values is None else list(values)

    def encoding(self, lm: LoadedModel, texts: list[str]) -> Generator[Notice, None, tuple[torch.Tensor, list | None]]:
        """Keys and values of memories of `texts` (the generator's value), `ENCODE_BATCH` of them a step: an import
        run as a worker request yields between batches, so every other answer goes on meanwhile (500 long memories
        held every user's chat for 15 s)."""
        keys, values = [], []
        for first in range(0, len(texts), ENCODE_BATCH):
            k, v = self._encode(lm, texts[first:first + ENCODE_BATCH], first, len(texts))
            keys.append(k)
            values = None if v is None else [*values, *v]
            yield Notice(f"encoded {min(first + ENCODE_BATCH, len(texts))} of {len(texts)} memories")
        return torch.cat(keys), values

    def reading(self, lm: LoadedModel, user: str, bank, label: str, text: str) -> Generator[Notice, None, object]:
        """What the memory head searches for `user`'s message `text` (the generator's value; a notice on the way
        when their memories cannot be read): `bank` (the session's, named `label`), joined by the user's own
        memories when the message speaks of its author ("What is my dog's name?"; each recall names the bank it
        came from). A message that does not ("What colour is the sky?") never reads a memory about the person."""
        if not mentions_the_user(text):
            return bank
        try:  # (the file is read again when it changed: a damaged one is said, and the answer goes on)
            mine = self.of(lm, user).bank
            if mine is None or not len(mine):
                return bank
        except (ServiceError, BankError) as e:
            yield Notice(f"{e}; answering without your memories")
            return bank
        try:
            return Joined([("yours", Newest(mine)), (label, bank)])
        except ValueError as e:  # the session's bank is of another layout (an upload of bare vectors): no answer came
            yield Notice(f"{e}: the two cannot be searched as one, so this message reads your own memories alone")
            return Newest(mine)

    def unread(self, lm: LoadedModel, user: str, text: str) -> bool:
        """Whether `user` has memories of their own that `text`, not speaking of them, does not read."""
        if mentions_the_user(text):
            return False
        try:
            return bool(len(self.of(lm, user)))
        except (ServiceError, BankError):
            return False

    def carry_out(self, lm: LoadedModel, user: str, decision: Decision, recent: Collection[str] = (),
                  **meta) -> Remembered:
        """Carry out a write decision on `user`'s memory: its forget or its correction (of the `recent` memories: the
        texts the last turn wrote or recalled) first, then its writes, as one change (one undo); a write that fails
        takes back what the decision did."""
        done, writes = Remembered(), decision.writes
        try:
            if decision.forget:
                done = self.forget(lm, user, decision.forget)
            if decision.correct:
                done = done + self.correct(lm, user, *decision.correct, recent, **{**meta, "source": "correction"})
                writes = writes if done.forgotten else writes + decision.unless_corrected
            if writes:  # (all of them at once: one at a time, a refusal named the count after the first)
                self.check_room(lm, user, len(writes))
            for text in writes:
                done = done + self.write(lm, user, text, **meta)
        except BaseException:
            if done.written or done.forgotten:
                self.undo(lm, user, done)
            raise
        return done

    def check_room(self, lm: LoadedModel, user: str, more: int) -> None:
        """`ServiceError` when `more` memories would take `user` past `memory.max_user_memories`."""
        held, cap = len(self.of(lm, user)), self.cfg.memory.max_user_memories
        if held + more > cap:
            raise ServiceError(f"your memory holds {held} memories, at most {cap} (memory.max_user_memories)"
                               f"{f': these {more} do not fit' if more > 1 else ''}; delete some under About you (or "
                               "DELETE /v1/memories/ID); nothing was written")

    def write(self, lm: LoadedModel, user: str, text: str, **meta) -> Remembered:
        """Encode and keep one memory of `user` (not twice; a newer value of the same thing supersedes the older);
        `ServiceError` for one longer than `memory.max_slots` value slots (`carry_out` checks the room)."""
        keys, values = self._encode(lm, [text])
        entry, superseded = self.of(lm, user).add(keys, None if values is None else values[0], text,
                                                   similar=self.similar, make_bank=self._new_bank(lm), **meta)
        if entry is None:  # the note names the memory kept (its words may differ from these a little)
            bank = self.of(lm, user).bank
            kept = None if bank is None else twin(bank.search(keys[0], CLOSEST), text, self.similar)
            return Remembered(note=f"Already remembered: {kept.get('text') if kept is not None else text}")
        return Remembered(written=(entry,), superseded=tuple(superseded))

    def write_many(self, lm: LoadedModel, user: str, texts: list[str], encoded: tuple | None = None,
                   **meta) -> Imported:
        """Encode (unless `encoded`: `encoding`'s value) and keep memories of `user` (an import), judged in order as
        `write` judges one; with the file store all or none (one write of the file), and none when any is longer
        than `memory.max_slots` or when they do not fit in `memory.max_user_memories` (checked before anything is
        written)."""
        self.check_room(lm, user, len(texts))
        keys, values = encoded if encoded is not None else self._encode(lm, texts, of=len(texts))
        items = [(keys[i:i + 1], None if values is None else values[i], t, meta) for i, t in enumerate(texts)]
        done = self.of(lm, user).add_many(items, similar=self.similar, make_bank=self._new_bank(lm))
        ours = {e["id"] for e, _ in done if e is not None}
        replaced = {o["id"] for _, sup in done for o in sup}
        return Imported(kept=len([e for e, _ in done if e is not None and e["id"] not in replaced]),
                        items=len(texts), duplicates=sum(e is None for e, _ in done),
                        replaced=len(replaced - ours), shadowed=len(replaced & ours))

    def undo(self, lm: LoadedModel, user: str, change: Remembered) -> Remembered:
        """Undo one turn's change to `user`'s memory: what it wrote is removed, what it superseded or forgot is put
        back as it was, in one write of the file: all of it or, on any failure, nothing (with Milvus, which has no
        transactions, what comes back is written first). Memories the user has since deleted are left as they are; a
        memory whose same fact came back meanwhile (another tab, the API) is not put back twice."""
        memory = self.of(lm, user)
        back = [e for e in (*change.superseded, *change.forgotten) if e.get("text")]
        restore = []
        if back:  # encoded before anything changes
            keys, values = lm.encoder.encode(lm.model, lm.tokenizer, [e["text"] for e in back], batch_size=8,
                                             progress=False)
            restore = [(keys[i:i + 1], None if values is None else values[i], e) for i, e in enumerate(back)]
        done = memory.undo([e["id"] for e in change.written], restore, similar=self.similar,
                           make_bank=self._new_bank(lm))
        notes = [f"Not restored, already remembered: {e['text']}" for e in done.kept]
        if not (done.removed or done.restored or done.kept):
            notes.append("Nothing to undo: the memories that change made have changed since")
        return Remembered(removed=done.removed, restored=done.restored, note=" · ".join(notes))

    def forget_all(self, lm: LoadedModel, user: str) -> int:
        """Delete every memory of `user` and their history: this model's, and the files earlier models wrote
        (what a later model would carry over); how many this model's memory held (0 for a file that cannot be read:
        it is deleted too, as asked, where a damaged file refused every request of its user, this one too)."""
        try:
            n = self.of(lm, user).clear()
        except BankError:
            if self.cfg.memory.store == "milvus" or not damaged(self.path(lm, user)):
                raise
            log.warning("the memories of %r could not be read; deleted as they asked (forget everything)", user)
            self.path(lm, user).unlink(missing_ok=True)  # (another replica may have deleted it)
            n = 0
        if self.cfg.memory.store != "milvus":
            forget_files(self.folder / user)
        return n

    def forget(self, lm: LoadedModel, user: str, what: str) -> Remembered:
        """Remove the memories of `user` that "forget `what`" is about (`to_forget`: none when no memory is), of
        each thing it names ("my sister and my dog": `things`), at once."""
        memory = self.of(lm, user)
        if not len(memory):
            return Remembered(note="Nothing to forget: you have not told me anything to remember yet")
        ids = list(dict.fromkeys(i for part in things(what) for i in self._meant(lm, memory, part)))
        if not ids:
            if EVERYTHING.match(what):  # (what a message names here: all of them is a button, and a confirmation)
                return Remembered(note="Nothing forgotten: a message forgets what it names; to forget all of yours, "
                                       "use Forget everything under About you (or DELETE /v1/memories)")
            shown = what if len(what) <= 80 else what[:80] + "…"  # (a whole long message said back is noise)
            return Remembered(note=f"Nothing to forget: no memory of yours is about {shown!r}")
        return Remembered(forgotten=tuple(memory.remove(ids)))

    def correct(self, lm: LoadedModel, user: str, old: str, new: str, recent: Collection[str], **meta) -> Remembered:
        """Each memory of `user` among the `recent` texts (what the last turn wrote or recalled: what a correction
        answers) that says `old` says `new` instead (`corrected`: "The user's dog is called Rocket." for "Actually
        it's Pocket, not Rocket."): the memory forgotten and its corrected text written, all of them as one change;
        no change when none says `old` (the message was about something else: "It's red, not blue." after an
        answer about paint leaves "The user's car is blue." as it is)."""
        memory = self.of(lm, user)
        fixes = [(e["id"], e["text"], text) for e in memory.entries()
                 if e["text"] in recent and (text := corrected(e["text"], old, new)) is not None]
        if not fixes:
            return Remembered()
        # first, as an edit does: the corrected text may read as a duplicate of the one it replaces
        done = Remembered(forgotten=tuple(memory.remove([i for i, _, _ in fixes])))
        try:
            for _, old_text, text in fixes:
                wrote = self.write(lm, user, text, **meta)
                new_text = wrote.written[0]["text"] if wrote.written else f"{text} (already remembered)"
                done = done + dataclasses.replace(wrote, note="", corrected=((old_text, new_text),))
        except BaseException:
            self.undo(lm, user, done)
            raise
        return done

    @staticmethod
    def _meant(lm: LoadedModel, memory: Personal, what: str) -> list[str]:
        """The ids of the memories "forget `what`" means (`to_forget`), among the closest `FORGET_CANDIDATES`."""
        keys, _ = lm.encoder.encode(lm.model, lm.tokenizer, [about_the_user(what)], batch_size=1, progress=False)
        bank = memory.bank
        scores, ids = bank.topk(keys[0], min(len(bank), FORGET_CANDIDATES))
        by_index = {e["index"]: e for e in memory.entries()}
        found = [(float(sc), by_index[int(i)]) for sc, i in zip(scores, ids)
                 if int(i) in by_index and forget_reading(what, by_index[int(i)]["text"])[0]]  # (the rest: never)
        check = lm.encoder.fit_check if lm.encoder.keys is not None else None
        fits = None
        if check is not None and found:
            query = lm.encoder.message_query(what)
            vectors = torch.nn.functional.normalize(torch.stack([bank.vector(e["index"]) for _, e in found]), dim=-1)
            fits = check.probability(query.reshape(1, -1).expand_as(vectors), vectors).tolist()
        picked = to_forget(what, [e["text"] for _, e in found], [sc for sc, _ in found], fits,
                           check.threshold if check is not None else 0.5)
        return [found[i][1]["id"] for i in picked]

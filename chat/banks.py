"""Memory banks per session: the shared bank, the example bank, a session's own; and their operations.

A session uses one of three banks: the shared bank (`memory.bank` of the config), the example bank
(built once from `assets/example_memories.txt`, shared), or its own (uploaded, or a copy made on its
first edit of a shared bank: a session's edits never reach other sessions). Encoding and edits run
on the model worker, between requests; every bank is written by the model's own memory encoder and
a bank from another encoder is refused.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from chat.config import Config, MemoryConfig
from chat.inputs import memory_lines, no_questions
from chat.session import Session
from chat.textsearch import TextSearch
from chat.worker import Request, ServiceError, Worker, describe
from memory import BankError, DimensionError, MemoryVectorDB
from memory.milvus import MilvusBank, StoreLayout, load_into
from models import LoadedModel
from models.vision import IMAGE_PAD, VISION_END, VISION_START, encode_with_images

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EXAMPLE_MEMORIES = ASSETS / "example_memories.txt"
BANK_TYPES = (".pt", ".safetensors", ".npy")
MAX_WRITE = 500  # the most memories one write of the page adds (it holds the model worker, as an import: limits.md)


MAX_ID = 2 ** 62

log = logging.getLogger(__name__)


def parse_ids(text: str) -> list[int]:
    """`"3, 5-7"` -> [3, 5, 6, 7] (ASCII digits only; ids below 2**62)."""
    ids: list[int] = []
    for part in filter(None, (p.strip() for p in re.split(r"[,\s]+", text or ""))):
        m = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part, flags=re.ASCII)
        if m is None:
            raise ServiceError(f"{part[:40]!r} is not a memory id: give ids like 3, 5-7 (digits 0-9)")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo:
            raise ServiceError(f"{part!r} is not a valid id range: expected the first id before the last, got "
                               f"{lo} after {hi}")
        if hi - lo > 100_000 or hi >= MAX_ID:
            raise ServiceError(f"{part!r} is not a valid id range (ids are below {MAX_ID}, ranges under 100,000)")
        ids += range(lo, hi + 1)
    if not ids:
        raise ServiceError("give the ids of the memories to delete, e.g. 3, 5-7")
    return ids


def store_layout(lm: LoadedModel, mem: MemoryConfig) -> StoreLayout:
    """The Milvus collection this model's encoder writes (keys, and values of their own or token ids)."""
    keyed, tokens = lm.encoder.values.keyed, lm.encoder.values.kind == "tokens"
    return StoreLayout(lm.encoder.keys.dim if keyed else lm.hidden_size,
                       value_dim=lm.hidden_size if keyed and not tokens else None, value_dtype=mem.value_dtype,
                       token_values=tokens, info=lm.encoder.describe())


def empty_bank(mem: MemoryConfig, lm: LoadedModel) -> MemoryVectorDB:
    """An empty bank of the kind this model's encoder writes (the index and value precision of `memory`)."""
    keyed, tokens = lm.encoder.values.keyed, lm.encoder.values.kind == "tokens"
    db = MemoryVectorDB(lm.encoder.keys.dim if keyed else lm.hidden_size, mem.index,
                        value_dim=lm.hidden_size if keyed and not tokens else None, token_values=tokens,
                        value_dtype=mem.value_dtype, hnsw_ef_search=mem.hnsw_ef_search)
    db.info = lm.encoder.describe()
    return db


class Written(list):
    """The ids of the memories a write added, and `skipped`: how many of its lines were not written, their text
    being in the bank already. Shown as "2 memories [3, 4]; 1 already in the bank"."""

    def __init__(self, ids: Sequence[int], skipped: int = 0):
        super().__init__(ids)
        self.skipped = skipped

    def __str__(self) -> str:
        ids = list.__repr__(self) if len(self) <= 8 else f"[{', '.join(map(str, self[:5]))}, ..., {self[-1]}]"
        written = f"{len(self)} {'memory' if len(self) == 1 else 'memories'} {ids}" if self else "nothing"
        return f"{written}; {self.skipped} already in the bank" if self.skipped else written


def texts_in(bank: MemoryVectorDB | MilvusBank, lines: Sequence[str]) -> set[str]:
    """Those of `lines` that are the text of a memory of `bank`."""
    wanted = set(lines)
    if not wanted:
        return set()
    if isinstance(bank, MilvusBank):  # asked of the store (the bank may be larger than any session's)
        view = bank.scoped(f"text in {json.dumps(sorted(wanted), ensure_ascii=False)}")
        return wanted & {e["text"] for e in view.entries(0, len(view))}
    return wanted.intersection(bank.texts())


def unstamped_note(lm: LoadedModel, db: MemoryVectorDB) -> str:
    """Why this model may recall the wrong memories from `db`, or "": a bank of bare vectors (key = value) that
    records no encoder, on a model whose memories have values and keys of their own (the embedded model reads token
    values found by text keys: a state vector is neither, and nothing says what wrote it)."""
    if db.has_values or db.info.get("encoder") is not None or not lm.encoder.values.keyed:
        return ""
    return (f"this bank holds bare vectors (key = value) with no record of what wrote them, and {lm.name} reads "
            f"memories of {lm.encoder.values} values found by text keys: it may recall the wrong ones; build a bank "
            "from texts with Write to bank or recall-memory build")


def dimension_note(lm: LoadedModel, e: DimensionError) -> str:
    """What a dimension refusal adds: the model's hidden size, and where vectors of its key encoder's size go."""
    key_dim = lm.bank_check().key_dim
    if e.expected is not None and e.expected == key_dim != lm.hidden_size:  # (the keys of a bank with values)
        return f"the model {lm.name} reads keys of dimension {key_dim}, its text key encoder's"
    note = f"the model {lm.name} has hidden size {lm.hidden_size}"
    if e.got is not None and e.got == key_dim and key_dim != lm.hidden_size:
        note += (f"; {key_dim} is the size of its text keys, which a bank holds as a dict with `embeddings` (the "
                 "keys) beside the memories' `values`, as `recall-memory build` writes it (docs/memory.md, Files)")
    return note


class Banks:
    """The banks of every session. Thread-safe; model work is queued on `worker`."""

    def __init__(self, cfg: Config, worker: Worker, model: Callable[[], LoadedModel],
                 wait_model: Callable[[], LoadedModel], files: Path, text_search: TextSearch | None = None):
        self.cfg, self.worker, self.files = cfg, worker, files
        self._model, self._wait_model = model, wait_model
        self.shared: MemoryVectorDB | None = None
        self.shared_note = ""
        self.example: MemoryVectorDB | None = None
        self._text_search = text_search

    def load_shared(self, lm: LoadedModel) -> None:
        if self.cfg.memory.store == "milvus":
            self.shared = self._open_store(lm)
            self.shared_note = f"Milvus {self.cfg.memory.milvus_collection} at {self.cfg.memory.milvus_uri}"
            return
        path = self.cfg.memory.bank
        if path is None:
            return
        try:  # the operator's own file: no upload limit; one that cannot be used stops the start
            self.shared = self._load(lm, path)
        except DimensionError as e:
            raise ServiceError(f"memory.bank {str(path)!r} cannot be loaded: {e} ({dimension_note(lm, e)})") from None
        except (BankError, FileNotFoundError) as e:
            raise ServiceError(f"memory.bank {str(path)!r} cannot be loaded: {describe(e)}") from None
        self.shared_note = Path(path).name
        if note := unstamped_note(lm, self.shared):
            log.warning("memory.bank %s: %s", path, note)

    def _open_store(self, lm: LoadedModel) -> MilvusBank:
        """The shared bank in Milvus: the collection as it is, or made for this model's encoder (and filled from
        `memory.bank` when one is set) when it does not exist yet. Its writes reach every session and replica."""
        mem = self.cfg.memory
        client = MilvusBank.connect(mem.milvus_uri)
        if mem.bank is not None and not client.has_collection(mem.milvus_collection):
            load_into(self._load(lm, mem.bank), mem.milvus_uri, mem.milvus_collection, index=mem.index, client=client)
        return MilvusBank.open(mem.milvus_uri, mem.milvus_collection, create=store_layout(lm, mem), index=mem.index,
                               hnsw_ef_search=mem.hnsw_ef_search, check=lm.bank_check(), client=client)

    def empty(self, lm: LoadedModel) -> MemoryVectorDB:
        return empty_bank(self.cfg.memory, lm)

    def _load(self, lm: LoadedModel, path: str | Path, max_bytes: int | None = None) -> MemoryVectorDB:
        """A bank file checked against this model; `max_bytes` for files strangers send (uploads)."""
        return MemoryVectorDB.load(path, check=lm.bank_check(), index=self.cfg.memory.index,
                                   max_slots=self.cfg.memory.max_slots, max_bytes=max_bytes,
                                   vocab_size=len(lm.tokenizer), hnsw_ef_search=self.cfg.memory.hnsw_ef_search)

    def of(self, s: Session) -> MemoryVectorDB | None:
        return {"shared": self.shared, "example": self.example, "own": s.own_bank}[s.bank_use]

    def label(self, s: Session) -> str:
        if s.bank_use == "own":
            return s.own_label
        if s.bank_use == "example":
            return "the example bank (shared)"
        return f"the shared bank ({self.shared_note})" if self.cfg.memory.bank or self.shared is not None else "none"

    def upload(self, s: Session, path: str | Path) -> str:
        """Make an uploaded file this session's bank; on any problem raise and keep the current one. What the page
        says of it: how many memories, and `unstamped_note`."""
        lm = self._wait_model()
        name = Path(path).name
        if Path(path).suffix.lower() not in BANK_TYPES:
            raise ServiceError(f"{name}: expected a memory bank file ending in .pt, .safetensors or .npy")
        try:
            db = self._load(lm, path, max_bytes=self.cfg.memory.max_upload_mb * 2 ** 20)
        except DimensionError as e:  # (a bank of another model: the size this one has)
            raise ServiceError(f"{e} ({dimension_note(lm, e)}); the current bank is kept") from None
        except BankError as e:
            raise ServiceError(f"{e}; the current bank is kept") from None
        cap = self.cfg.memory.max_memories_per_session
        if len(db) > cap:
            raise ServiceError(f"{name}: expected at most {cap} memories (memory.max_memories_per_session), "
                               f"got {len(db)}; the current bank is kept")
        s.own_bank, s.own_label, s.bank_use = db, f"your upload {name}", "own"
        s.bank_chosen += 1
        note = unstamped_note(lm, db)
        return f"bank uploaded: {name}, {len(db)} memories" + (f" · ⚠ {note}" if note else "")

    def use(self, s: Session, which: str) -> None:
        if which not in ("shared", "example", "own"):
            raise ServiceError(f"bank {which!r}: choose shared, example or own")
        if which == "example" and self.example is None:
            raise ServiceError("the example bank is not built yet: press Build example bank")
        if which == "own" and s.own_bank is None:
            raise ServiceError("this session has no bank of its own: upload one or write memories")
        s.bank_use, s.bank_chosen = which, s.bank_chosen + 1

    def build_example(self, s: Session) -> Request:
        """Queue building the example bank (once per server) and switching this session to it."""
        def run(_: threading.Event) -> int:
            if self.example is None:
                lines = [line for _, line in memory_lines(EXAMPLE_MEMORIES.read_text())]
                db = self.empty(self._model())
                db.add(*self._encode_texts(lines, lines))
                db.info["source"] = EXAMPLE_MEMORIES.name
                self.example = db
            s.bank_use, s.bank_chosen = "example", s.bank_chosen + 1
            return len(self.example)

        return self.worker.submit(Request("build_example_bank", run, s.id))

    def write(self, s: Session, text: str, images: Sequence[str] = ()) -> Request:
        """Queue encoding typed memories (one a line) and images, and adding them to this session's bank; a line
        whose text a memory of the bank already has is not written again (`Written.skipped`)."""
        numbered, images = memory_lines(text or ""), [str(p) for p in images or ()]
        lines = [line for _, line in numbered]
        if not lines and not images:
            raise ServiceError("type the memories to write, one a line (or attach images)")
        if len(lines) + len(images) > MAX_WRITE:
            raise ServiceError(f"expected at most {MAX_WRITE} memories in one write (it holds the model, and every "
                               f"user's chat waits for it), got {len(lines) + len(images)}; write them in parts, or "
                               "build a bank with recall-memory build and upload it; nothing was written")
        try:
            no_questions(numbered, "the memories typed:")
        except ValueError as e:
            raise ServiceError(str(e)) from None
        chosen = s.bank_chosen  # (an upload while the write waits replaces the bank: the write is refused, not lost)

        def run(_: threading.Event) -> Written:
            if s.bank_chosen != chosen:
                raise ServiceError("the session's bank changed while the memories waited to be written (an upload, "
                                   "or another bank chosen): nothing was written; write them again")
            lm = self._model()
            if images and not lm.is_vision:
                raise ServiceError(f"{lm.name} reads text only: memories from images need a vision-language "
                                   "model (Qwen3-VL); nothing was written")
            if images and lm.encoder.values.keyed:
                raise ServiceError(f"memories from images are one hidden-state vector each, and this model writes "
                                   f"{lm.encoder.values} values with text keys: set memory.values to state to write "
                                   "image memories; nothing was written")
            current = self.of(s)  # (a shared bank is copied below, texts and all: what it holds is what it will)
            there = set() if current is None else texts_in(current, lines)
            new = list(dict.fromkeys(ln for ln in lines if ln not in there))  # (a line typed twice: written once)
            if not new and not images:
                return Written([], len(lines))
            texts = new + [f"[image] {Path(p).name}" for p in images]
            bank, cap = self._writable(s), self.cfg.memory.max_memories_per_session
            if len(bank) + len(texts) > cap:
                raise ServiceError(f"the bank would hold {len(bank) + len(texts)} memories, over the limit of {cap} "
                                   "(memory.max_memories_per_session); nothing was written")
            if images:
                parts = [self._encode_texts(new, new)[0]] if new else []
                parts += [self._encode_image(p) for p in tqdm(images, desc="encoding images", unit="image")]
                return Written(bank.add(torch.cat(parts), texts), len(lines) - len(new))
            return Written(bank.add(*self._encode_texts(new, texts)), len(lines) - len(new))

        return self.worker.submit(Request("write_memories", run, s.id))

    def delete(self, s: Session, ids_text: str) -> Request:
        ids = parse_ids(ids_text)
        if self.of(s) is None:
            raise ServiceError("there is no bank to delete from")

        def run(_: threading.Event) -> int:
            try:
                return self._writable(s).remove(ids)
            except KeyError as e:  # unknown ids: nothing was removed
                raise ServiceError(e.args[0]) from None

        return self.worker.submit(Request("delete_memories", run, s.id))

    def _writable(self, s: Session) -> MemoryVectorDB | MilvusBank:
        """This session's own bank; a shared one is copied first (worker thread only). The shared bank in
        Milvus is written in place: it is there to be shared."""
        if s.bank_use == "shared" and isinstance(self.shared, MilvusBank):
            return self.shared
        if s.bank_use != "own":
            shared = self.of(s)
            if shared is None:
                s.own_bank, s.own_label = self.empty(self._model()), "your own bank (written here)"
            else:
                s.own_bank = shared.copy()
                s.own_label = f"your copy of {self.label(s).removesuffix(' (shared)')}"  # (it is no longer shared)
            s.bank_use = "own"
        return s.own_bank

    def _encode_texts(self, lines: list[str], texts: list[str]) -> tuple:
        """`MemoryVectorDB.add`'s arguments for memories of `lines` labelled `texts`: keys, texts, metadata,
        values (None: the keys are the values); a memory longer than `memory.max_slots` slots is refused."""
        lm = self._model()
        keys, values = lm.encoder.encode(lm.model, lm.tokenizer, lines, batch_size=8)
        cap = self.cfg.memory.max_slots
        long = [i for i, v in enumerate(values or []) if len(v) > cap]
        if long:
            raise ServiceError(f"memory {long[0] + 1} ({lines[long[0]][:40]!r}...) has {len(values[long[0]])} value "
                               f"slots, over memory.max_slots={cap}: split it into shorter memories; nothing was written")
        return keys, texts, None, values

    def _encode_image(self, path: str) -> torch.Tensor:
        lm = self._model()
        inputs = encode_with_images(lm.tokenizer, lm.image_processor, VISION_START + IMAGE_PAD + VISION_END, [path])
        with torch.no_grad():
            return lm.encoder.state(lm.model, inputs).cpu()

    def save(self, s: Session, fmt: str = ".pt") -> Path:
        db = self.of(s)
        if db is None or len(db) == 0:
            raise ServiceError("there is no bank to download")
        if fmt not in BANK_TYPES:
            raise ServiceError(f"format {fmt!r}: choose one of {', '.join(BANK_TYPES)}")
        path = s.files / f"memory-bank-{len(db)}{fmt}"  # (the session's folder: freed with it)
        db.save(path)
        return path

    def find(self, s: Session, query: str, top_k: int = 5) -> list[dict[str, Any]]:
        """The memories whose texts read closest to `query` (sentence-transformers), best first."""
        db = self.of(s)
        if db is None:
            raise ServiceError("there is no bank to search: build the example bank or upload one")
        if self._text_search is None:  # the model's own key encoder, when it has one
            self._text_search = TextSearch(self._wait_model().encoder.keys)
        return self._text_search.search(db, query, int(top_k))

"""Command line for memory banks: build one from texts, show it, search it.

    python -m chat.bankcli build memories.txt bank.pt [--model PATH] [--adapter auto|none|PATH]
    python -m chat.bankcli show bank.pt [--n 5]
    python -m chat.bankcli search bank.pt "what did I say about tea?" [--model PATH] [--k 5]
    python -m chat.bankcli load bank.pt URI [--collection memories] [--index flat]   (a file into Milvus)
    python -m chat.bankcli export URI bank.pt [--collection memories]               (Milvus into a file)

URI: a local path (milvus-lite) or http://host:19530 (a Milvus server), as `memory.milvus_uri`.

Memories are written by the model's own memory encoder (the recall adapter's, for the embedded
model); `--layer` / `--pooling` choose the hidden state of a model never trained to recall.

Errors print one line to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import codecs
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from chat.config import MemoryConfig
from chat.inputs import memory_lines, no_questions
from memory import BankError, MemoryVectorDB
from memory.files import FORMATS


_JSON_TYPES = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}


def _read_text(path: Path) -> str:
    """A UTF-8 file's text (without the byte order mark some editors write); a ValueError naming the line of the
    first byte that is not UTF-8."""
    if path.is_dir():
        raise ValueError(f"{path}: expected a text file of memories, got a folder")
    data = path.read_bytes()
    data = data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = len(re.split(r"\r\n|\r|\n", data[:e.start].decode("utf-8")))  # (counted as `memory_lines` does)
        raise ValueError(f"{path.name} line {line}: expected UTF-8 text, got byte 0x{data[e.start]:02x}; "
                         "save the file as UTF-8") from None


def read_memories(path: Path) -> tuple[list[str], list[dict | None] | None, list[int]]:
    """Texts (and metadata) from a .txt (one memory per non-empty line) or .jsonl ({"text", "metadata"?}), and the
    line of the file each came from."""
    numbered = memory_lines(_read_text(path))
    numbers = [number for number, _ in numbered]
    if path.suffix.lower() == ".txt":
        texts, metadata = [line for _, line in numbered], None
    elif path.suffix.lower() == ".jsonl":
        texts, metadata = [], []
        for number, line in numbered:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path.name} line {number}: expected a JSON object, got invalid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f"{path.name} line {number}: expected an object with a string 'text', "
                                 f"got {line[:80]!r}")
            meta = obj.get("metadata")
            if meta is not None and not isinstance(meta, dict):
                raise ValueError(f"{path.name} line {number}: expected 'metadata' as a JSON object (or left out), "
                                 f"got {_JSON_TYPES.get(type(meta), type(meta).__name__)}")
            if not any(ch.strip() for ch in obj["text"]):  # (refused later as "rows [2]", counted from 0)
                raise ValueError(f"{path.name} line {number}: expected a 'text' to remember, got {obj['text']!r}")
            texts.append(obj["text"])
            metadata.append(meta)
        metadata = metadata if any(m is not None for m in metadata) else None
    else:
        raise ValueError(f"{path.name}: expected a .txt or .jsonl file of memories, "
                         f"got {path.suffix or 'no extension'!r}")
    if not texts:
        raise ValueError(f"{path.name}: expected at least one memory, got none")
    no_questions(list(zip(numbers, texts)), path.name)
    return texts, metadata, numbers


def _load_model(args: argparse.Namespace, values: str = "auto", layer: int = -1, pooling: str = "last"):
    from models import HiddenStateSpec, LoadOptions, load_model  # imported after main() has set offline mode

    adapter = None if args.adapter == "none" else args.adapter
    return load_model(
        args.model,
        LoadOptions(
            adapter=adapter,
            device="cpu",
            hidden_state=HiddenStateSpec(layer, pooling),
            values=values,
            keys=None if args.key_encoder == "none" else args.key_encoder,
        ),
    )


def _check_folder(out: str) -> None:
    """Refuse an output file of another type, a folder, or a place that cannot be written, before any work (it is
    written last: a 5,000-line bank was encoded for 28 s before "[Errno 21] Is a directory")."""
    if Path(out).suffix.lower() not in FORMATS:
        raise ValueError(f"{Path(out).name}: expected a memory bank file ending in .pt, .safetensors or .npy, got "
                         f"{Path(out).suffix or 'no extension'!r}")
    if Path(out).is_dir():
        raise ValueError(f"{out}: expected a file name for the output, got a folder")
    folder = Path(out).parent
    if not folder.is_dir():
        raise ValueError(f"{folder}: expected an existing folder for the output, got "
                         f"{'a file' if folder.exists() else 'none'}")
    try:  # (the bank is written as a file beside it, then renamed: `memory.files.atomic_write`)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"{folder}: expected a folder the output can be written in, got one that refuses it "
                         f"({e.strerror or e})") from None


def cmd_build(args: argparse.Namespace) -> None:
    from models import build_bank

    source = Path(args.input)
    _check_folder(args.out)
    texts, metadata, numbers = read_memories(source)
    seen: set[str] = set()  # (a line given twice is one memory, as the page's Write to bank keeps it)
    keep = [i for i, t in enumerate(texts) if not (t in seen or seen.add(t))]
    if len(keep) < len(texts):
        again = [numbers[i] for i in sorted(set(range(len(texts))) - set(keep))]
        print(f"{len(again)} line(s) repeat an earlier one and are kept once: line(s) "
              f"{', '.join(map(str, again[:10]))}{' ...' if len(again) > 10 else ''}")
        texts, numbers = [texts[i] for i in keep], [numbers[i] for i in keep]
        metadata = None if metadata is None else [metadata[i] for i in keep]
    asked = {"--layer": args.layer, "--pooling": args.pooling}
    loaded = _load_model(args, args.values, -1 if args.layer is None else args.layer, args.pooling or "last")
    encoder = loaded.encoder
    given = [f"{flag} {value}" for flag, value in asked.items() if value is not None]
    if given and encoder.values.keyed:  # (they were ignored: the values were the adapter's tokens)
        raise ValueError(f"{' '.join(given)}: these choose the hidden state of state values, and these memories are "
                         f"{encoder.values} values with keys of their own (--values {args.values}): drop them, or "
                         "build state values (--values state, with --adapter none for a model's own hidden states)")
    mine = {"--layer": encoder.spec.layer, "--pooling": encoder.spec.pooling}
    if other := [f"{flag} {asked[flag]}" for flag in mine if asked[flag] not in (None, mine[flag])]:
        raise ValueError(f"{' '.join(other)}: the recall adapter's encoder reads layer {encoder.spec.layer}, "
                         f"{encoder.spec.pooling} pooling; drop them, or pass --adapter none")
    if Path(args.out).suffix.lower() == ".npy" and loaded.encoder.values.keyed:  # (refused at the save: after the work)
        raise ValueError(f"{Path(args.out).name}: a .npy bank holds one vector a memory, and these memories have "
                         f"values of their own (memory.values {loaded.encoder.values}): save as .pt or .safetensors")
    db = build_bank(loaded.model, loaded.tokenizer, texts, loaded.encoder, metadata=metadata,
                    batch_size=args.batch_size, value_dtype=args.value_dtype)
    slots = [e["slots"] for e in db.entries(0, len(db))] if db.has_values else []
    long = [(n, k) for n, k in zip(numbers, slots) if k > args.max_slots]
    if long:  # (the app refuses a bank with such a memory: memory.max_slots)
        where = ", ".join(f"line {n} ({k} slots)" for n, k in long[:5]) + (" and more" if len(long) > 5 else "")
        raise ValueError(f"{source.name}: expected memories of at most {args.max_slots} value slots (--max-slots, "
                         f"the app's memory.max_slots), got {len(long)} longer: {where}; split those lines into "
                         f"shorter memories. Nothing was written")
    db.info["model"] = loaded.name
    db.save(args.out)
    size = Path(args.out).stat().st_size
    print(f"saved {len(db)} memories to {args.out} ({size / 2 ** 20:.1f} MB, {size / max(1, len(db)) / 1024:.1f} KB a "
          f"memory on disk): {describe(db)}")


def describe(db: MemoryVectorDB) -> str:
    if not db.has_values:
        return f"one vector of dimension {db.dim} each (key = value)"
    slots = [e["slots"] for e in db.entries(0, len(db))]
    what = "values (token ids)" if db.token_values else f"values of dimension {db.value_dim}"
    kind = db.info.get("values")  # (none in a bank written elsewhere: "values values" was shown)
    return (f"{f'{kind} ' if kind else ''}{what}, {min(slots)}-{max(slots)} slots, keys of dimension {db.dim} "
            f"({db.info.get('keys')}), {db.bytes_per_memory() / 1024:.1f} KB a memory in RAM")


def _short(text: Any, width: int = 80) -> str:
    if text is None:
        return "(no text)"
    return text if len(text) <= width else text[:width - 3] + "..."


def cmd_show(args: argparse.Namespace) -> None:
    db = MemoryVectorDB.load(args.bank)
    print(f"{args.bank}: {len(db)} memories, {describe(db)}")
    if db.info:
        print("info: " + json.dumps(db.info))
    for e in db.entries(0, args.n):
        print(f"  [{e['index']}] slots={e['slots']} key norm={e['norm']:.3f} {_short(e['text'])}")


def cmd_search(args: argparse.Namespace) -> None:
    info = MemoryVectorDB.load(args.bank).info
    loaded = _load_model(args, info.get("values", "state"), info.get("layer", -1), info.get("pooling", "last"))
    db = MemoryVectorDB.load(args.bank, check=loaded.bank_check())
    query = (loaded.encoder.query(args.query) if db.has_values else
             loaded.encoder.encode_states(loaded.model, loaded.tokenizer, [args.query], progress=False)[0])
    for rank, hit in enumerate(db.search(query, args.k), 1):
        print(f"{rank}. score={hit['score']:.4f} [{hit['index']}] {_short(hit.get('text'))}")


def cmd_load(args: argparse.Namespace) -> None:
    from memory.milvus import load_into

    db = MemoryVectorDB.load(args.bank)  # checked as the app checks a file: dims, values, finite, labels
    store = load_into(db, args.uri, args.collection, index=args.index)
    print(f"loaded {len(store)} memories from {args.bank} into {args.collection!r} at {args.uri}: {describe(db)}")


def cmd_export(args: argparse.Namespace) -> None:
    from memory.milvus import MilvusBank

    _check_folder(args.out)
    if "://" not in args.uri and not Path(args.uri).exists():  # (milvus-lite made an empty store there)
        raise ValueError(f"{args.uri}: expected a milvus-lite file or http://host:19530, got nothing there")
    store = MilvusBank.open(args.uri, args.collection)
    db = store.to_bank()
    if not len(db):  # (an empty bank was written over the file there, then "min() arg is an empty sequence")
        raise ValueError(f"collection {args.collection!r} at {args.uri} holds no memories: nothing to export "
                         f"({args.out} is as it was)")
    db.save(args.out)
    print(f"saved {len(db)} memories of {args.collection!r} at {args.uri} to {args.out}: {describe(db)}")


def _collection(name: str) -> str:
    """An argparse type: a collection name the app's configuration takes (`memory.milvus_collection`)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,200}", name):
        raise argparse.ArgumentTypeError(f"expected a name of letters, digits and _ (not starting with a digit), as "
                                         f"memory.milvus_collection takes, got {name!r}")
    return name


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `minimum` (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="recall-memory", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="encode texts into a memory bank file")
    b.add_argument("input", help=".txt (one memory a line) or .jsonl ({'text', 'metadata'})")
    b.add_argument("out", help="bank file to write: .pt, .safetensors or .npy (vectors only)")
    b.add_argument("--model", help="local model folder (default: the embedded SmolLM2)")
    b.add_argument("--adapter", default="auto", help="PEFT adapter folder, auto (the shipped recall adapter for "
                   "the embedded model) or none")
    b.add_argument("--key-encoder", default="auto", help="the text encoder of keys: auto (with the shipped adapter), "
                   "none (stock) or an adapter folder")
    b.add_argument("--values", default="auto", help="what a memory's value is: auto (the model's), tokens, "
                   "chunks:N, mean, hidden:L or state")
    b.add_argument("--value-dtype", choices=("float16", "float32"), default="float16")
    b.add_argument("--layer", type=int, help="hidden-state index of state values (default -1, the final layer)")
    b.add_argument("--pooling", choices=("last", "mean"), help="of state values' hidden states (default last)")
    b.add_argument("--batch-size", type=_at_least(1), default=8)
    b.add_argument("--max-slots", type=_at_least(1), default=MemoryConfig.max_slots,
                   help="the most value slots a memory may have: the app's memory.max_slots (default %(default)s)")
    b.set_defaults(run=cmd_build)
    s = sub.add_parser("show", help="print the size, dimension and a few entries of a bank")
    s.add_argument("bank")
    s.add_argument("--n", type=_at_least(0), default=5, help="entries to show (0 or more)")
    s.set_defaults(run=cmd_show)
    q = sub.add_parser("search", help="encode a query text and print the closest memories")
    q.add_argument("bank")
    q.add_argument("query")
    q.add_argument("--model", help="local model folder (default: the embedded SmolLM2)")
    q.add_argument("--adapter", default="auto", help="as for build: the bank's encoder must be this model's")
    q.add_argument("--key-encoder", default="auto", help="as for build")
    q.add_argument("--k", type=_at_least(1), default=5, help="memories to print, best first: 1 or more "
                   "(0 is refused; a bank of fewer prints them all)")
    q.set_defaults(run=cmd_search)
    ld = sub.add_parser("load", help="copy a bank file into a new Milvus collection (memory.store: milvus)")
    ld.add_argument("bank")
    ld.add_argument("uri", help="a local path (milvus-lite) or http://host:19530")
    ld.add_argument("--collection", default="memories", type=_collection,
                    help="the collection to create (memory.milvus_collection)")
    ld.add_argument("--index", choices=("flat", "hnsw", "ivf"), default="flat", help="the keys' index (memory.index)")
    ld.set_defaults(run=cmd_load)
    ex = sub.add_parser("export", help="write a Milvus collection to a bank file")
    ex.add_argument("uri", help="a local path (milvus-lite) or http://host:19530")
    ex.add_argument("out", help="bank file to write: .pt, .safetensors or .npy (vectors only)")
    ex.add_argument("--collection", default="memories")
    ex.set_defaults(run=cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from local folders only
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except (BankError, ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (a traceback before; a build writes its file at the end, atomically)
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command line for memory banks: build one from texts, show it, search it.

    python -m chat.memory_cli build memories.txt bank.pt [--model PATH] [--layer -1] [--pooling last]
    python -m chat.memory_cli show bank.pt [--n 5]
    python -m chat.memory_cli search bank.pt "what did I say about tea?" [--model PATH] [--k 5]

Errors print one line to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from memory import BankError, HiddenStateSpec, MemoryVectorDB, build_bank, encode_texts


def read_memories(path: Path) -> tuple[list[str], list[dict | None] | None]:
    """Texts (and metadata) from a .txt (one memory per non-empty line) or .jsonl ({"text", "metadata"?})."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix.lower() == ".txt":
        texts, metadata = [ln.strip() for ln in lines if ln.strip()], None
    elif path.suffix.lower() == ".jsonl":
        texts, metadata = [], []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path.name} line {number}: expected a JSON object, got invalid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f"{path.name} line {number}: expected an object with a string 'text', "
                                 f"got {line[:80]!r}")
            texts.append(obj["text"])
            metadata.append(obj.get("metadata"))
        metadata = metadata if any(m is not None for m in metadata) else None
    else:
        raise ValueError(f"{path.name}: expected a .txt or .jsonl file of memories, "
                         f"got {path.suffix or 'no extension'!r}")
    if not texts:
        raise ValueError(f"{path.name}: expected at least one memory, got none")
    return texts, metadata


def _load_model(path: str | None):
    from chat.models import load_model

    return load_model(path, device="cpu")


def cmd_build(args: argparse.Namespace) -> None:
    texts, metadata = read_memories(Path(args.input))
    spec = HiddenStateSpec(args.layer, args.pooling)
    loaded = _load_model(args.model)
    db = build_bank(loaded.model, loaded.tokenizer, texts, spec, metadata=metadata, batch_size=args.batch_size)
    db.info["model"] = loaded.name
    db.save(args.out)
    print(f"saved {len(db)} memories of dimension {db.dim} to {args.out}")


def _short(text: Any, width: int = 80) -> str:
    if text is None:
        return "(no text)"
    return text if len(text) <= width else text[:width - 3] + "..."


def cmd_show(args: argparse.Namespace) -> None:
    db = MemoryVectorDB.load(args.bank)
    print(f"{args.bank}: {len(db)} memories, dimension {db.dim}")
    if db.info:
        print("info: " + json.dumps(db.info))
    for e in db.entries(0, args.n):
        print(f"  [{e['index']}] norm={e['norm']:.3f} {_short(e['text'])}")


def cmd_search(args: argparse.Namespace) -> None:
    db = MemoryVectorDB.load(args.bank)
    spec = HiddenStateSpec(args.layer if args.layer is not None else db.info.get("layer", -1),
                           args.pooling or db.info.get("pooling", "last"))
    loaded = _load_model(args.model)
    if db.dim != loaded.hidden_size:
        raise ValueError(f"{args.bank} has vectors of dimension {db.dim}, but the model {loaded.name} "
                         f"has hidden size {loaded.hidden_size}: search with the model the bank was built with")
    query = encode_texts(loaded.model, loaded.tokenizer, [args.query], spec, progress=False)[0]
    for rank, hit in enumerate(db.search(query, args.k), 1):
        print(f"{rank}. score={hit['score']:.4f} [{hit['index']}] {_short(hit.get('text'))}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chat.memory_cli", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="encode texts into a memory bank file")
    b.add_argument("input", help=".txt (one memory a line) or .jsonl ({'text', 'metadata'})")
    b.add_argument("out", help="bank file to write: .pt, .safetensors or .npy (vectors only)")
    b.add_argument("--model", help="local model folder (default: the embedded SmolLM2)")
    b.add_argument("--layer", type=int, default=-1, help="hidden-state index (-1 = final layer)")
    b.add_argument("--pooling", choices=("last", "mean"), default="last")
    b.add_argument("--batch-size", type=int, default=8)
    b.set_defaults(run=cmd_build)
    s = sub.add_parser("show", help="print the size, dimension and a few entries of a bank")
    s.add_argument("bank")
    s.add_argument("--n", type=int, default=5, help="entries to show")
    s.set_defaults(run=cmd_show)
    q = sub.add_parser("search", help="encode a query text and print the closest memories")
    q.add_argument("bank")
    q.add_argument("query")
    q.add_argument("--model", help="local model folder (default: the embedded SmolLM2)")
    q.add_argument("--k", type=int, default=5)
    q.add_argument("--layer", type=int, default=None, help="default: the layer the bank was built with")
    q.add_argument("--pooling", choices=("last", "mean"), default=None, help="default: as the bank was built")
    q.set_defaults(run=cmd_search)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except (BankError, ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Building a bank with the CLI: memories a second beside the key encoder alone, and the bytes a memory.

    .venv/bin/python bench/bank_build.py [--sizes 5000,50000] [--threads 2]

For each size N: a text file of the 36 example memories + N one-line invented facts (the evaluation
split of `training.facts`, a fixed seed), then, in one run, side by side:
  keys alone   the key encoder (all-MiniLM-L6-v2 with the shipped LoRA, batch 64) on the same texts, in
               this process, nothing cached: the floor a build cannot go below
  build        `recall-memory build facts.txt bank.safetensors` as a user runs it (a new process: the
               model, the tokenizer and the key encoder loaded, every memory encoded, the file written)
and the file's size: bytes a memory (key, token ids, text), beside what the same file held when `tokens`
values were stored as float16 input embeddings (before issue 29: 576 x 2 bytes a slot instead of 4).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from memory import MemoryVectorDB  # noqa: E402
from models.text_keys import TextEncoder  # noqa: E402
from training.facts import make_facts  # noqa: E402


def facts_file(folder: Path, n: int) -> tuple[Path, list[str]]:
    example = [ln.strip() for ln in (ROOT / "assets" / "example_memories.txt").read_text().splitlines() if ln.strip()]
    texts = example + [f.text for f in make_facts(n, "eval", seed=29)]
    path = folder / f"facts-{n}.txt"
    path.write_text("\n".join(texts) + "\n")
    return path, texts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="5000,50000")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    print("| memories | keys alone, memories/s | `recall-memory build`, memories/s (s) | build / keys | "
          "file | bytes a memory | before (float16 embeddings) |")
    print("|---|---|---|---|---|---|---|")
    for n in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            src, texts = facts_file(Path(tmp), n)
            encoder = TextEncoder()
            encoder.model  # loaded before the clock starts, as the build's own load is in its time
            t = time.perf_counter()
            encoder.encode(texts)
            keys_s = time.perf_counter() - t
            out = Path(tmp) / "bank.safetensors"
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "chat.bankcli", "build", str(src), str(out)], check=True, cwd=ROOT,
                           env=env, stdout=subprocess.DEVNULL)
            build_s = time.perf_counter() - t
            db = MemoryVectorDB.load(out)
            slots = sum(e["slots"] for e in db.entries(0, len(db))) / len(db)
            size = out.stat().st_size
            before = size / len(texts) + slots * (576 * 2 - 4)
            print(f"| {len(texts):,} | {len(texts) / keys_s:.0f} | {len(texts) / build_s:.0f} ({build_s:.1f}) | "
                  f"{build_s / keys_s:.2f}x | {size / 1e6:.2f} MB | {size / len(texts):,.0f} B "
                  f"({slots:.1f} token ids) | {before:,.0f} B |", flush=True)


if __name__ == "__main__":
    main()

"""What the chat reads for a question about its author, on the fit check's held-out people (`training.fits`): the
memory head's score alone, with the fit check, and with the chat's words check after it
(`chat.naming.speaks_of_another`: a memory about another thing of the user's than the one asked of is dropped).

    .venv/bin/python bench/reading.py [--people 600] [--json out.json]

Told questions: their own memory read; never-told questions and near misses: nothing read (under a minute here).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--people", type=int, default=600, help="training.fits' --people: its eval split is a third")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()

    from chat.naming import speaks_of_another
    from models.fits import FitCheck
    from models.text_keys import TextEncoder
    from training.fits import embed, people, reads

    t0 = time.perf_counter()
    encoder, check = TextEncoder(), FitCheck.load()
    report = {}
    for split, n in (("train", args.people), ("eval", args.people // 3)):
        data = people(split, n)
        emb = embed(encoder, data)
        report[split] = {"score alone": reads(None, data, *emb), "score and fit check": reads(check, data, *emb),
                         "score, fit check and words (the chat)": reads(check, data, *emb, drops=speaks_of_another)}
    for split, rows in report.items():
        first = next(iter(rows.values()))
        print(f"\n{split} ({first['told']} told, {first['untold']} never told, {first['near_misses']} near misses)\n\n"
              "| reading | told: right read | never told: nothing | near miss: nothing |\n|---|---|---|---|")
        for name, m in rows.items():
            print(f"| {name} | {m['told_read_right']:.3f} | {m['untold_read_nothing']:.3f} | "
                  f"{m['near_miss_read_nothing']:.3f} |")
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

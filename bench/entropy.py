"""Entropy-based intermediate-layer decoding (seed 002) against plain decoding, on the embedded SmolLM2.

    nice -n 19 .venv/bin/python bench/entropy.py [--tokens 48] [--repeats 3] [--answer-tokens 24]

One run, one model object, greedy throughout. Speed: ms per generated token (`decode_seconds /
steps`, the prefill excluded) for plain / trough / random_after, each forced to exactly `--tokens`
steps (min_new_tokens), median of `--repeats` after one warm-up, interleaved so machine noise hits
all modes alike. Quality: 15 short factual questions with known answers (capitals, arithmetic,
common facts): accuracy of each mode (an accepted answer appears in the reply), token agreement
with plain decoding (same token at the same position), and how often the chosen layer was the last.
Prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402

from decoding.request import Controls
from decoding import GenerationSettings, generate  # noqa: E402
from models import LoadOptions, load_model  # noqa: E402

MODES = (None, "trough", "random_after")
SPEED_PROMPT = "Write a long story about a lighthouse keeper."
QUESTIONS = [  # (question, accepted answers: regexes, case-insensitive; a number not inside another one)
    ("What is the capital of France?", [r"\bparis\b"]),
    ("What is the capital of Japan?", [r"\btokyo\b"]),
    ("What is the capital of Italy?", [r"\brome\b"]),
    ("What is the capital of Germany?", [r"\bberlin\b"]),
    ("What is the capital of Spain?", [r"\bmadrid\b"]),
    ("What is the capital of the United Kingdom?", [r"\blondon\b"]),
    ("What is the capital of Egypt?", [r"\bcairo\b"]),
    ("What is the capital of Russia?", [r"\bmoscow\b"]),
    ("What is 2 + 2?", [r"(?<![\d.])4(?!\.?\d)", r"\bfour\b"]),
    ("What is 3 + 5?", [r"(?<![\d.])8(?!\.?\d)", r"\beight\b"]),
    ("What is 10 - 3?", [r"(?<![\d.])7(?!\.?\d)", r"\bseven\b"]),
    ("How many days are in a week?", [r"(?<![\d.])7(?!\.?\d)", r"\bseven\b"]),
    ("What color is the sky on a clear day?", [r"\bblue\b"]),
    ("What is the largest planet in our solar system?", [r"\bjupiter\b"]),
    ("Who wrote Romeo and Juliet?", [r"\bshakespeare\b"]),
]


def name(mode: str | None) -> str:
    return mode or "plain"


def chat(tok, text: str):
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok([prompt], return_tensors="pt")


def speed(lm, tokens: int, repeats: int) -> dict[str | None, list[float]]:
    """ms per generated token of each mode, `repeats` runs after one warm-up each."""
    inputs = chat(lm.tokenizer, SPEED_PROMPT)
    settings = {m: GenerationSettings(max_new_tokens=tokens, min_new_tokens=tokens, entropy_decoding=m, seed=0)
                for m in MODES}
    times: dict[str | None, list[float]] = {m: [] for m in MODES}
    for run in range(repeats + 1):
        for mode in MODES:
            result = generate(lm.model, inputs, settings[mode])
            assert result.steps == tokens, (mode, result.steps)
            if run:  # run 0 is the warm-up
                times[mode].append(1000 * result.decode_seconds / result.steps)
    return times


def answers(lm, mode: str | None, max_tokens: int) -> list[tuple[list[int], str, list[int]]]:
    """(generated tokens, text, chosen layers) for every question."""
    tok = lm.tokenizer
    out = []
    for question, _ in QUESTIONS:
        s = GenerationSettings(max_new_tokens=max_tokens, entropy_decoding=mode, seed=0)
        result = generate(
            lm.model,
            chat(tok, question),
            s,
            controls=Controls(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        )
        new = result.new_tokens[0].tolist()
        layers = result.entropy.selected_layer_indices[0].tolist() if result.entropy is not None else []
        out.append((new, tok.decode(new, skip_special_tokens=True).strip(), layers))
    return out


def correct(text: str, accepted: list[str]) -> bool:
    return any(re.search(pattern, text, flags=re.IGNORECASE) for pattern in accepted)


def agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    """(positions with the same token, positions compared = the longer reply's length)."""
    return sum(x == y for x, y in zip(a, b)), max(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--answer-tokens", type=int, default=24)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    transformers.logging.set_verbosity_error()
    lm = load_model(None, LoadOptions(adapter=None, device="cpu"))
    layers = lm.model.config.num_hidden_layers

    times = speed(lm, args.tokens, args.repeats)
    replies = {m: answers(lm, m, args.answer_tokens) for m in MODES}
    plain_ms = statistics.median(times[None])

    print(f"\n{lm.name} (embedded, {lm.model.dtype}, CPU, {torch.get_num_threads()} threads), {layers} layers, "
          f"greedy; speed: {args.tokens} tokens, median of {args.repeats} after a warm-up; "
          f"quality: {len(QUESTIONS)} questions, up to {args.answer_tokens} tokens\n")
    print("| mode | ms / token | x plain | accuracy | token agreement with plain | same reply as plain "
          "| chosen layer = last | mean chosen layer |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode in MODES:
        ms = statistics.median(times[mode])
        right = sum(correct(text, ok) for (_, text, _), (_, ok) in zip(replies[mode], QUESTIONS))
        same, total = map(sum, zip(*(agreement(a[0], b[0]) for a, b in zip(replies[mode], replies[None]))))
        identical = sum(a[0] == b[0] for a, b in zip(replies[mode], replies[None]))
        chosen = [layer for _, _, ls in replies[mode] for layer in ls]
        last = f"{sum(c == layers - 1 for c in chosen) / len(chosen):.0%}" if chosen else "100% (always)"
        mean = f"{statistics.mean(chosen):.1f}" if chosen else f"{layers - 1}"
        print(f"| {name(mode)} | {ms:.1f} | {ms / plain_ms:.2f} | {right}/{len(QUESTIONS)} | {same / total:.0%} "
              f"| {identical}/{len(QUESTIONS)} | {last} | {mean} |")

    print("\n| question | plain | trough | random_after |")
    print("|---|---|---|---|")
    for i, (question, ok) in enumerate(QUESTIONS):
        cells = []
        for mode in MODES:
            text = replies[mode][i][1].replace("\n", " ").replace("|", "/")
            cells.append(("✓ " if correct(text, ok) else "✗ ") + (text[:48] + ("…" if len(text) > 48 else "")))
        print(f"| {question} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

"""Speed of q* sampling on the embedded SmolLM2 with its recall adapter as the pair (adapter on = π_θ,
off = π_t): direct draws vs exact speculative sampling, in one run, same prompts and settings.

    .venv/bin/python bench/mixture.py [--tokens 48] [--repeats 2] [--gamma 4] [--dtype float32|bfloat16]
                                      [--temperature 1.0] [--modes direct,head] [--rules fixed,seed,acceptance]
                                      [--prompts 3] [--threads N]

Sampling at `--temperature` (0 = greedy; top_k=0, min_new_tokens = max_new_tokens so every run draws
the same number of tokens). `--dtype bfloat16` runs both models (and the head) in bfloat16, merged
from the float32 adapter; the PEFT-batch modes then do not run. The prompts are held out from the
draft head's training (training/draft.py never uses their subjects). Modes are interleaved per prompt and repeat so machine noise hits all alike.
Each speculative mode runs once per γ rule of `--rules` (`mixture.gamma_rule`, decoding/gamma.py: fixed γ, the
seed's adaptive k from α*, or γ from the last rounds' kept drafts); for the fixed-γ rounds it also says how well
each adaptive rule's acceptance estimate, taken before a round, predicts the share of that round's drafts kept.
tokens/s counts decode time only (prefill excluded). Without a trained adapter in
assets/recall-smollm2 it falls back to a fresh LoRA adapter (the training recipe's shape) with
random B weights, and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import copy
import importlib.util
import os
import statistics
import time
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from decoding.request import Controls  # noqa: E402
from decoding import GenerationSettings  # noqa: E402
from decoding.gamma import GammaSchedule  # noqa: E402
from decoding.mixture import MixtureEvent, stream_mixture  # noqa: E402
from decoding.settings import GAMMA_RULES, MixtureSettings  # noqa: E402
from decoding.draft_head import DraftHead  # noqa: E402
from models import RECALL_ADAPTER, LoadOptions, load_model  # noqa: E402
from models.gguf import gguf_draft_for  # noqa: E402

PROMPTS = ["Write a long story about a lighthouse keeper.", "Explain how photosynthesis works, step by step.",
           "What should I pack for a week of hiking in the mountains?"]
MODES = {  # name -> (MixtureSettings changes, pair: "copy" = θ merged + a base copy, two forwards (the app's);
           #                                        "peft" = PEFT's mixed adapter batch, one forward)
    "direct, base copy (2 forwards)": (dict(speculative=False), "copy"),
    "direct, PEFT batch (1 forward)": (dict(speculative=False), "peft"),
    "speculative, θ draft reused": (dict(speculative=True, draft="theta"), "copy"),
    "speculative, n-gram draft": (dict(speculative=True, draft="ngram"), "copy"),
    "speculative, EAGLE head draft": (dict(speculative=True, draft="head"), "copy"),
    "speculative, GGUF draft (llama.cpp)": (dict(speculative=True, draft="gguf"), "copy"),
    "speculative, θ draft, PEFT batch": (dict(speculative=True, draft="theta"), "peft"),
}


def pair_model(lora_std: float):
    """The PEFT model (adapter on = θ); a note on where the adapter came from."""
    if (RECALL_ADAPTER / "adapter_config.json").is_file():
        lm = load_model(None, LoadOptions(device="cpu"))
        return lm, f"trained recall adapter from {RECALL_ADAPTER}"
    from peft import LoraConfig, get_peft_model

    lm = load_model(None, LoadOptions(adapter=None, device="cpu"))
    t = lm.tokens
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        trainable_token_indices=[t.recall, t.recall_end, t.memory_pad])
    lm.model = get_peft_model(lm.model, config).eval()
    torch.manual_seed(0)
    for name, p in lm.model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0.0, lora_std)
    return lm, (f"NO trained adapter at {RECALL_ADAPTER} (training still running?): a FRESH LoRA adapter "
                f"(r=16, alpha=32, q/k/v/o, trainable recall tokens) with random B ~ N(0, {lora_std}^2)")


def forward_ms(model, prompt: torch.Tensor, positions: int, repeats: int = 10) -> float:
    """Median ms of one plain forward over `positions` new positions after the prompt (a cached prefix):
    what a direct step (1) and a verify (γ + 1) cost each model."""
    cache = DynamicCache(config=model.config)
    model(prompt, past_key_values=cache, use_cache=True)
    block = prompt[:, -positions:]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(block, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        cache.crop(-positions)  # (transformers 5: a negative count of positions to drop)
    return statistics.median(times) * 1e3


def gguf_step_ms(llm, prompt: torch.Tensor, repeats: int = 20) -> float:
    """Median ms of one llama.cpp draft step (one new token on a cached prefix), with reading its logits,
    padding them, the softmax and an argmax (the processors of the bench's settings do nothing)."""
    from decoding.gguf_draft import GGUFDraft

    draft, ids = GGUFDraft(llm, llm.n_vocab), prompt[0].tolist()
    draft.propose(ids, 1, processors=None, do_sample=False)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        draft.propose(ids, 1, processors=None, do_sample=False)  # re-feeds the last token: one eval
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def with_rules(modes: dict, rules: list[str]) -> dict:
    """Each speculative mode once per γ rule (the fixed one keeps its name), the rules of a mode side by side."""
    out = {}
    for name, (changes, pair) in modes.items():
        for rule in rules if changes["speculative"] else ["fixed"]:
            out[name if rule == "fixed" else f"{name}, γ rule {rule}"] = ({**changes, "gamma_rule": rule}, pair)
    return out


def replay(answers: list[list[MixtureEvent]], rule: str, base: int) -> list[tuple[float, float, int]]:
    """(the rule's acceptance estimate before a round, the share of that round's drafts kept, the γ the rule would
    pick) for every round that drafted after the rule had an estimate, the rule replayed over fixed-γ rounds."""
    out = []
    for rounds in answers:
        schedule = GammaSchedule(rule, base)
        for e in rounds:
            if e.drafted and schedule.estimate is not None:
                out.append((schedule.estimate, e.accepted / e.drafted, schedule.gamma))
            schedule.update(list(e.alphas), e.drafted, e.accepted)
    return out


def predictions(answers: list[list[MixtureEvent]], base: int) -> list[str]:
    """How well each adaptive rule's estimate predicts a round's kept share: its range, the γ it picks, Pearson's r."""
    lines = []
    for rule in GAMMA_RULES[1:]:
        rows = replay(answers, rule, base)
        if len(rows) < 3:
            continue
        estimate, kept, gammas = zip(*rows)
        try:
            r = f"{statistics.correlation(estimate, kept):.3f}"
        except statistics.StatisticsError:
            r = "undefined (constant estimate)"
        picks = ", ".join(f"{g}: {gammas.count(g) / len(gammas):.0%}" for g in sorted(set(gammas)))
        lines.append(f"{rule}: estimate mean {statistics.fmean(estimate):.3f} (min {min(estimate):.3f}, max "
                     f"{max(estimate):.3f}) against kept share mean {statistics.fmean(kept):.3f}; γ would be {picks}; "
                     f"Pearson r {r}; {len(rows)} rounds")
    return lines


def quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"{statistics.fmean(values):.3f} ({q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--lora-std", type=float, default=0.02)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: all)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--head", default=None, help="an EAGLE draft head folder (python -m training.draft): adds its mode")
    ap.add_argument("--modes", default="", help="comma-separated words; run the modes whose name has one (default: all)")
    ap.add_argument("--rules", default=",".join(GAMMA_RULES), help="γ rules each speculative mode runs with")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N prompts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    transformers.logging.set_verbosity_error()
    lm, source = pair_model(args.lora_std)
    tok = lm.tokenizer
    base, theta = lm.mixture_target(None), lm.merged()
    dtype = getattr(torch, args.dtype)
    if dtype != torch.float32:  # both models in bfloat16 (θ merged in float32 first), as plain modules
        theta, base = copy.deepcopy(theta).to(dtype), copy.deepcopy(base).to(dtype)
    head = DraftHead.load(args.head, dtype=dtype) if args.head else None
    gguf = gguf_draft_for(lm, None) if importlib.util.find_spec("llama_cpp") else None
    modes = {m: v for m, v in MODES.items() if (not args.modes or m.startswith("direct, base copy")
                                                or any(w in m for w in args.modes.split(",")))
             and (v[1] == "copy" or dtype == torch.float32) and ("head" not in m or head is not None)
             and ("GGUF" not in m or gguf is not None)}
    modes = with_rules(modes, args.rules.split(","))
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"] for p in PROMPTS[:args.prompts]]
    n = args.tokens
    stats = {m: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "rounds": 0, "alphas": [], "answers": []}
             for m in modes}
    sample = args.temperature > 0

    def run(mode: str, ids, seed: int, tokens: int):
        changes, pair = modes[mode]
        settings = GenerationSettings(do_sample=sample, temperature=args.temperature if sample else 1.0, top_k=0,
                                      max_new_tokens=tokens, min_new_tokens=tokens, seed=seed, repetition_penalty=1.0)
        mixture = MixtureSettings(enabled=True, gamma=args.gamma, **changes)
        theta_now = lm.merged() if dtype == torch.float32 else theta  # (re-merged: a PEFT-batch mode unmerges it)
        events = list(stream_mixture(
            theta_now if pair == "copy" else lm.merged(),
            base if pair == "copy" else None,
            {"input_ids": ids},
            dataclasses.replace(settings, mixture=mixture),
            controls=Controls(
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, draft_head=head, draft_gguf=gguf
            ),
        ))
        return events[-1].result, [e for e in events if isinstance(e, MixtureEvent)]

    for mode in modes:  # warm-up
        run(mode, prompts[0], 0, 4)
    step_ms, verify_ms = (forward_ms(lm.merged() if dtype == torch.float32 else theta, prompts[0], k)
                          for k in (1, args.gamma + 1))
    for repeat in range(args.repeats):
        for i, ids in enumerate(prompts):
            for mode in modes:
                r, rounds = run(mode, ids, 1000 * repeat + i, n)
                s = stats[mode]
                s["tokens"] += r.new_tokens.shape[1]
                s["seconds"] += r.decode_seconds
                s["drafted"] += r.drafted
                s["accepted"] += r.accepted
                s["rounds"] += r.rounds
                s["alphas"] += [a for a in r.alphas if a == a]
                s["answers"].append(rounds)
            print(f"repeat {repeat + 1}/{args.repeats}, prompt {i + 1}/{len(prompts)} done", file=sys.stderr)

    direct = stats[next(m for m in stats if m.startswith("direct, base copy"))]
    base_tps = direct["tokens"] / direct["seconds"]
    print(f"pair: {lm.name}, {source}")
    print(f"device cpu, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}; "
          f"{len(prompts)} prompts x {args.repeats} repeats x {n} tokens a mode; {args.dtype}; "
          f"{f'temperature {args.temperature:g}, top_k 0' if sample else 'greedy'}; γ = {args.gamma}\n")
    print("| mode | tokens/s | vs direct (base copy) | acceptance | drafts / verify | accepted / verify | "
          "tokens / verify | α* mean (Q1 / median / Q3) |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, s in stats.items():
        tps = s["tokens"] / s["seconds"]
        acc = f"{s['accepted'] / s['drafted']:.3f}" if s["drafted"] else "-"
        print(f"| {mode} | {tps:.2f} | {tps / base_tps:.2f}x | {acc} | {s['drafted'] / s['rounds']:.2f} | "
              f"{s['accepted'] / s['rounds']:.2f} | {s['tokens'] / s['rounds']:.2f} | {quartiles(s['alphas'])} |")
    for mode, (changes, _) in modes.items():
        if changes["speculative"] and changes["gamma_rule"] == "fixed":
            print(f"\nthe adaptive rules' estimates before each round of {mode!r} (γ = {args.gamma}), against the "
                  "share of that round's drafts kept:")
            print("\n".join(f"- {line}" for line in predictions(stats[mode]["answers"], args.gamma)))
    print(f"\none forward of θ ({args.dtype}, merged, eager, cached prefix): {step_ms:.1f} ms for 1 position, {verify_ms:.1f} ms for "
          f"γ + 1 = {args.gamma + 1} ({verify_ms / step_ms:.2f}x)")
    if gguf is not None:
        print(f"one llama.cpp draft step (Q4_1 GGUF, {torch.get_num_threads()} threads, logits, softmax and argmax "
              f"included): {gguf_step_ms(gguf, prompts[0]):.1f} ms")
    print("\nacceptance = kept drafts / drafted tokens (the n-gram draft drafts only where a lookup matches); "
          "a verify is one forward of each model (one batched forward for the PEFT pair; the θ draft reused "
          "runs θ over the block while drafting, and the verify only the base).")


if __name__ == "__main__":
    main()

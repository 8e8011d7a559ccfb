"""The recall loop on llama.cpp beside the compiled transformers loop, in one run (`bench/generate.py --backends
transformers,llamacpp` calls `compare` once the transformers rows are measured).

For each GGUF of the embedded recall model (Q8_0, and Q4_1 with the adapter's weights at Q8_0: models/gguf_export.py): decode ms/token of our loop
on llama.cpp and of llama.cpp's own generation (llama-cpp-python's `Llama.generate`, greedy) on the same file,
interleaved; time to first token for a 100-token prompt on both backends; closeness to the fp32 transformers
path on held-out questions (the evaluation split of `training.facts`, a bank of their facts, recall as the
chat does it): KL(fp32 || GGUF) per answer token with the GGUF path forced along the fp32 answer, and how
many greedy answers are equal; 8 sessions at once against 1 through the chat service, on both backends.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from chat.config import load_config
from chat.service import Service
from decoding.request import Controls
from decoding import GenerationSettings, RecallSettings, generate
from models import build_bank, LoadOptions, load_model


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Along(LogitsProcessor):
    """Forces the reference sequence's next token (the step's raw logits are kept by the loop)."""

    def __init__(self, reference: list[int]):
        self.reference = reference

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.reference[input_ids.shape[1]]] = 0
        return forced


def closeness(lm_t, lm_g, prompts: list[str], bank_t, bank_g, tokens: int = 24) -> tuple[float, float]:
    """(mean KL(fp32 || GGUF) nats per answer token, share of greedy answers equal) over `prompts`."""
    from chat.session import Conversation

    kls, same = [], []
    greedy = GenerationSettings(max_new_tokens=tokens, repetition_penalty=1.0)
    for prompt in prompts:
        runs = []
        for lm, bank in ((lm_t, bank_t), (lm_g, bank_g)):
            conv = Conversation(lm)
            inputs = conv.build_inputs(prompt)
            recall = conv.recall(bank, RecallSettings(top_k=1), prompt)
            runs.append(
                (
                    inputs,
                    recall,
                    generate(
                        lm.merged(),
                        inputs,
                        greedy,
                        recall=recall,
                        tokenizer=lm.tokenizer,
                        controls=Controls(output_logits=True),
                    ),
                )
            )
        (inputs, _, ref), (_, recall_g, got) = runs
        same.append(ref.sequences.tolist() == got.sequences.tolist())
        new = ref.sequences.shape[1] - inputs["input_ids"].shape[1]  # (a recall's span is new tokens of one step)
        forced = generate(
            lm_g.model,
            inputs,
            GenerationSettings(max_new_tokens=new, repetition_penalty=1.0),
            recall=recall_g,
            controls=Controls(
                logits_processor=LogitsProcessorList([Along(ref.sequences[0].tolist())]), output_logits=True
            ),
        )
        assert forced.sequences.tolist() == ref.sequences.tolist(), "the GGUF path did not follow the reference"
        p, q = ref.logits[0].float().log_softmax(-1), forced.logits[0].float().log_softmax(-1)
        kls.extend((p.exp() * (p - q)).nan_to_num(0).sum(-1).tolist())
    return statistics.fmean(kls), sum(same) / len(same)


def sessions(svc: Service, tokens: int) -> float:
    """Aggregate tokens/s of 8 sessions at once over 1 session, through the chat service."""
    from serving import concurrent

    svc.ready().done.wait()
    concurrent(svc, 8, 4)  # (a service's first answers load what it loads lazily: not measured)
    one = concurrent(svc, 1, tokens)["tok_s"]
    eight = concurrent(svc, 8, tokens)["tok_s"]
    return eight / one, one, eight


def compare(lm_t, inputs, fast_t: float, settings, ids: dict, args) -> None:
    """Print the backends table; `lm_t` is the transformers model with its compiled step warm, `fast_t` its
    compiled loop's ms/token on `inputs` measured just before."""
    import llama_cpp

    from training.facts import make_facts

    n, tok = args.tokens, lm_t.tokenizer
    words = " ".join((Path(__file__).resolve().parent.parent / "assets" / "general_text.txt").read_text().split())
    long_prompt = tok.apply_chat_template([{"role": "user", "content": tok.decode(tok(words).input_ids[:80])}],
                                          add_generation_prompt=True, return_tensors="pt", return_dict=True)
    long_prompt = {"input_ids": long_prompt["input_ids"]}
    ttft = lambda model: statistics.median(timed(lambda: generate(model, long_prompt, settings(1)))  # noqa: E731
                                           for _ in range(args.repeats))
    facts = make_facts(args.prompts, "eval", seed=1)
    prompts, texts = [f.questions[0] for f in facts], [f.text for f in facts]
    bank_t = build_bank(lm_t.model, tok, texts, lm_t.encoder, progress=False)
    rows = {"transformers fp32, compiled loop": {"ours": fast_t, "ttft": ttft(lm_t.model)}}
    svc = Service(load_config(overrides=["generation.max_new_tokens=512"], environ={}), lm_t)
    rows["transformers fp32, compiled loop"]["sessions"] = sessions(svc, n)
    svc.close()
    for qtype in ("q8_0", "q4_1"):
        lm = load_model(None, LoadOptions(backend="llamacpp", gguf_type=qtype))
        llm = llama_cpp.Llama(str(lm.model.path), n_ctx=2048, n_batch=512, n_threads=torch.get_num_threads(),
                              n_threads_batch=torch.get_num_threads(), verbose=False)
        prompt_ids = inputs["input_ids"][0].tolist()

        def native(k: int) -> None:
            for i, _ in enumerate(llm.generate(prompt_ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                                                reset=True)):
                if i + 1 == k:
                    break

        def ours(k: int) -> None:
            generate(lm.model, inputs, settings(k))

        got = {"ours": [], "native": []}
        for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
            for name, fn in (("ours", ours), ("native", native)):
                got[name].append((timed(lambda: fn(n)) - timed(lambda: fn(1))) / (n - 1))
        row = {k: statistics.median(v) for k, v in got.items()}
        row["ttft"] = ttft(lm.model)
        bank_g = build_bank(lm.model, lm.tokenizer, texts, lm.encoder, progress=False)
        row["kl"], row["same"] = closeness(lm_t, lm, prompts, bank_t, bank_g)
        svc = Service(load_config(overrides=["generation.max_new_tokens=512", "model.backend=llamacpp",
                                             f"model.gguf_type={qtype}"], environ={}), lm)
        row["sessions"] = sessions(svc, n)
        svc.close()
        row["mb"] = lm.model.path.stat().st_size / 1e6
        rows[f"llama.cpp {qtype.upper()} ({row['mb']:.0f} MB), our loop"] = row
        del llm

    print(f"\nbackends, {torch.get_num_threads()} threads, {n} tokens, median of {args.repeats}; closeness over "
          f"{len(prompts)} held-out questions with a bank of their facts\n")
    print("| backend | decode ms/token | vs compiled fp32 | llama.cpp's own generation, same file | our loop / "
          "llama.cpp's | time to first token, 100-token prompt | KL vs fp32, nats/token | greedy answers equal "
          "| 8 sessions / 1 (tokens/s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        ratio, one, eight = r["sessions"]
        gguf = "kl" in r
        print(f"| {name} | {r['ours'] * 1e3:.1f} | {r['ours'] / fast_t:.2f}x | "
              f"{r['native'] * 1e3:.1f} | {r['ours'] / r['native']:.2f}x | " if gguf else
              f"| {name} | {r['ours'] * 1e3:.1f} | 1x | — | — | ", end="")
        print(f"{r['ttft'] * 1e3:.0f} ms | " + (f"{r['kl']:.4f} | {r['same']:.0%} | " if gguf else "— | — | ")
              + f"{ratio:.2f}x ({one:.1f} -> {eight:.1f}) |")

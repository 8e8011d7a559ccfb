"""The numbers the llama.cpp tests bound, as this machine's llama.cpp build gives them.

    .venv/bin/python bench/llamacpp_bounds.py [--threads 1,2]
    PYTHONPATH=/tmp/llama-avx .venv/bin/python bench/llamacpp_bounds.py   # another build of llama-cpp-python

llama-cpp-python builds from source with the machine's own instruction set, so an AVX2 machine and an
AVX-512 one run other kernels (Q8_0 dot products above all) and the numbers move in the third or fourth
digit. Each bound in `tests/decoding/test_llamacpp.py` and `tests/models/test_gguf_export.py` is set with a
margin over the spread of these numbers across builds and thread counts (written beside each bound).
Every row is what a test computes, on the same model, prompts and bank:
  state cosine / logits corr   llama.cpp's final state and logits at the question's last position vs
                               transformers' (Q8_0 recall model)
  <recall> state score         the cosine of llama.cpp's <recall> state with transformers' there (the
                               hidden-state bank test's memory score)
  replay corr / max diff       the logits after a k-slot injection vs a fresh prefill of the same tokens
  f32 max diff / corr          the F32 export's last-position logits vs transformers', worst of 3 prompts
  q8_0 / q4_1 KL               mean KL(transformers || llama.cpp) per position over the 3 prompts
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from decoding.request import Controls, Prompt  # noqa: E402

QUESTION = "Who keeps the lighthouse of Port Avel?"
PROMPTS = [  # as tests/models/test_gguf_export.py
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is my sister's name?<|im_end|>\n<|im_start|>assistant\n<recall>",
    "<|im_start|>user\nWhat is my sister's name?<|im_end|>\n<|im_start|>assistant\n<recall>Your sister is called "
    "Anna.</recall> Your sister's name is",
]


def prompt(lm, text: str = QUESTION) -> torch.Tensor:
    return lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]


def kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def llama_logits(path, ids: list[int], threads: int) -> torch.Tensor:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    llm.eval(ids)
    return torch.tensor(np.array(llm.scores[:len(ids)]), dtype=torch.float64)


def measure(threads: int, smollm2, recall_lm) -> dict[str, float]:  # noqa: PLR0914 - one row a test
    from decoding import GenerationSettings, generate
    from decoding.backend import backend_for
    from decoding.memory import Recall
    from decoding.settings import RecallSettings
    from chat.session import Conversation
    from models import build_bank
    from models.gguf_export import recall_gguf

    torch.set_num_threads(threads)
    out: dict[str, float] = {}
    ids = prompt(recall_lm)
    fwd = backend_for(recall_lm.model, want_state=True)
    state, logits = fwd.prefill(fwd.embed(ids), None, fwd.cache_for(None, ids.shape[1], True), None, {})
    with torch.no_grad():
        ref = smollm2.model(input_ids=ids, output_hidden_states=True)
    out["state cosine"] = float(torch.cosine_similarity(state[0], ref.hidden_states[-1][0, -1], dim=0))
    out["logits corr"] = float(torch.corrcoef(torch.stack([logits[0], ref.logits[0, -1]]))[0, 1])

    rid = torch.cat([ids, torch.tensor([[recall_lm.tokens.recall]])], dim=1)
    with torch.no_grad():
        want = smollm2.model(input_ids=rid, output_hidden_states=True).hidden_states[-1][0, -1]
    fwd = backend_for(recall_lm.model, want_state=True)
    got, _ = fwd.prefill(fwd.embed(rid), None, fwd.cache_for(None, rid.shape[1], True), None, {})
    out["<recall> state score"] = float(torch.cosine_similarity(got[0], want, dim=0))

    texts = [ln for ln in (ROOT / "assets" / "example_memories.txt").read_text().splitlines() if ln.strip()]
    bank = build_bank(recall_lm.model, recall_lm.tokenizer, texts, recall_lm.encoder, progress=False)
    recall = Conversation(recall_lm).recall(bank, RecallSettings(), QUESTION)
    run = generate(
        recall_lm.model,
        {"input_ids": rid},
        GenerationSettings(max_new_tokens=24, min_new_tokens=24, repetition_penalty=1.0),
        recall=recall,
        tokenizer=recall_lm.tokenizer,
        controls=Controls(output_logits=True),
    )
    again = generate(
        recall_lm.model,
        Prompt({"input_ids": run.sequences[:, :-1]}, memory_vectors=run.memory_vectors),
        GenerationSettings(max_new_tokens=1),
        recall=recall,
        controls=Controls(output_logits=True),
    )
    step, fresh = run.logits[0, -1], again.logits[0, 0]
    out["replay corr"] = float(torch.corrcoef(torch.stack([step, fresh]))[0, 1])
    out["replay max diff / max |logit|"] = float((step - fresh).abs().max() / step.abs().max())

    model = smollm2.merged()
    cases = []
    for text in PROMPTS:
        tids = smollm2.tokenizer(text, add_special_tokens=False).input_ids
        with torch.no_grad():
            cases.append((tids, model(torch.tensor([tids])).logits[0].double()))
    diffs, corrs = [], []
    for tids, reference in cases:
        last = llama_logits(recall_gguf("f32"), tids, threads)[-1]
        diffs.append(float((last - reference[-1]).abs().max()))
        corrs.append(float(np.corrcoef(last, reference[-1])[0, 1]))
    out["f32 max diff"], out["f32 corr"] = max(diffs), min(corrs)
    for qtype in ("q8_0", "q4_1"):
        out[f"{qtype} KL"] = float(np.mean([kl(r, llama_logits(recall_gguf(qtype), t, threads)) for t, r in cases]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2")
    args = p.parse_args()
    import llama_cpp

    from models import LoadOptions, load_model

    info = llama_cpp.llama_print_system_info().decode()
    print(f"llama_cpp from {Path(llama_cpp.__file__).parent} ({llama_cpp.__version__}): {info.strip()}")
    smollm2 = load_model(None, LoadOptions(device="cpu"))
    rows = {}
    for t in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(t)  # (llama.cpp's context takes its thread count at load)
        rows[t] = measure(t, smollm2, load_model(None, LoadOptions(backend="llamacpp", gguf_type="q8_0")))
    print("| measure | " + " | ".join(f"{t} thread(s)" for t in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for key in next(iter(rows.values())):
        print(f"| {key} | " + " | ".join(f"{r[key]:.6f}" for r in rows.values()) + " |")


if __name__ == "__main__":
    main()

"""Decode speed of the recall loop against `model.generate`, on the embedded SmolLM2, in one run.

    .venv/bin/python bench/generate.py [--tokens 64] [--repeats 5] [--backends transformers,llamacpp]

Per-token decode time is (T(n tokens) - T(1 token)) / (n - 1) for both, so the prefill cancels
out; the same prompt, settings (greedy, min_new_tokens = n so both run exactly n steps) and
model object. Reports medians over repeats, time to first token, the cost of one recall at 10k
and 100k memories, and tokens/s as a fraction of the memory-bandwidth bound.

With `llamacpp` among the backends (bench/backends.py), the recall loop on llama.cpp is measured in the
same run against the compiled transformers loop and against llama.cpp's own generation on the same file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402

from models import LoadOptions, load_model  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from decoding import GenerationSettings, MemorySelector, Recall, RecallSettings, generate  # noqa: E402
from decoding import compiled as fast_path  # noqa: E402
from decoding.forward import Forward  # noqa: E402
from decoding.processors import to_generation_config  # noqa: E402
from memory import MemoryVectorDB  # noqa: E402
from models.modeling import backbone_and_head, set_adapter_merged, unwrap_model  # noqa: E402

PROMPT = "<|im_start|>user\nWrite a long story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n"


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of one pass reading a large fp32 tensor."""
    x = torch.ones(int(gib * 2**30 / 4))
    x.sum()
    best = min(timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best


def stepped_logits(model, seq: torch.Tensor, start: int) -> torch.Tensor:
    """Logits [len - 1 - start, V] at positions start..len-2 of seq [1, len], fed as the loop feeds them:
    a prefill up to `start`, then one (compiled, on a static cache) decode step a token."""
    fwd = Forward(model)
    cache = fast_path.static_cache(model, seq.shape[1])
    positions = torch.arange(seq.shape[1])[None]
    rows = [fwd.logits(fwd.prefill(fwd.embed(seq[:, :start + 1]), positions[:, :start + 1], cache, None, {})[0])]
    for i in range(start + 1, seq.shape[1] - 1):
        rows.append(fwd.logits(fwd.step(fwd.embed(seq[:, i:i + 1]), torch.tensor([[i]]), cache, None)[0]))
    return torch.cat(rows).float()


def limit_hits() -> int:
    """How often dynamo gave up on a function at its recompile limit in this process (it then runs eagerly)."""
    return sum(n for msg, n in counters["unimplemented"].items() if msg.startswith("Dynamo recompile limit exceeded"))


def measure_int8(model, inputs, settings, ids: dict, n: int, per_token, seq: torch.Tensor) -> dict:
    """int8 weights and activations (model.quantize: int8), compiled the same way: ms/token, and how far
    its distributions are from fp32's on `seq`, the fp32 model's own greedy continuation."""
    q = load_model(None, LoadOptions(device="cpu", quantize="int8"))
    step = fast_path.enable(q.model)
    compile_s = timed(lambda: step.warm_up(up_to=inputs["input_ids"].shape[1] + n + 1))
    assert step.error is None, step.error
    graphs = counters["stats"]["unique_graphs"]
    run = lambda k: generate(q.model, inputs, settings(k))  # noqa: E731
    start = inputs["input_ids"].shape[1] - 1
    ref = model(seq).logits.float().log_softmax(-1)[0, start:-1]
    out = {"compile": compile_s, "per_token": per_token(run), "same": run(n).sequences.tolist() == seq.tolist()}
    for path, logits in (("eager", q.model(seq).logits.float()[0, start:-1]), ("compiled", stepped_logits(q.model, seq, start))):
        got = logits.log_softmax(-1)
        out[path] = (float((ref.exp() * (ref - got)).sum(-1).mean()), float((ref.argmax(-1) == got.argmax(-1)).float().mean()))
    out["recompiles"] = counters["stats"]["unique_graphs"] - graphs
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", default="transformers", help="comma-separated: transformers, llamacpp")
    ap.add_argument("--prompts", type=int, default=30, help="held-out prompts for the backends' closeness")
    ap.add_argument("--backends-only", action="store_true", help="with llamacpp: only the compiled transformers loop "
                    "(its first bucket) beside llama.cpp, not the other transformers rows")
    args = ap.parse_args()
    backends = args.backends.split(",")
    if not set(backends) <= {"transformers", "llamacpp"}:
        ap.error(f"--backends {args.backends!r}: expected transformers and/or llamacpp")
    if backends == ["llamacpp"]:
        ap.error("--backends llamacpp is measured beside the compiled transformers loop: give transformers,llamacpp")
    torch.set_grad_enabled(False)
    transformers.logging.set_verbosity_error()
    lm = load_model(None, LoadOptions(device="cpu"))
    model, tok = lm.model, lm.tokenizer
    inputs = tok([PROMPT], return_tensors="pt")
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    n = args.tokens

    def settings(k: int) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=k, min_new_tokens=k)

    def hf(k: int):
        return model.generate(**inputs, generation_config=to_generation_config(settings(k), **ids))

    def ours(k: int, **kw):
        return generate(model, inputs, settings(k), **kw)

    assert hf(n).tolist() == ours(n).sequences.tolist(), "custom loop and generate disagree"
    if args.backends_only and "llamacpp" in backends:
        from backends import compare

        step = fast_path.enable(model)
        step.warm_up(up_to=inputs["input_ids"].shape[1] + n + 1)
        assert step.error is None, step.error
        fast = statistics.median((timed(lambda: ours(n)) - timed(lambda: ours(1))) / (n - 1)
                                 for _ in range(args.repeats))
        return compare(lm, inputs, fast, settings, ids, args)
    rows = {"generate": [], "custom": [], "ratio": [], "ttft_generate": [], "ttft_custom": []}
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        g1, gn = timed(lambda: hf(1)), timed(lambda: hf(n))
        c1, cn = timed(lambda: ours(1)), timed(lambda: ours(n))
        g, c = (gn - g1) / (n - 1), (cn - c1) / (n - 1)
        rows["generate"].append(g)
        rows["custom"].append(c)
        rows["ratio"].append(c / g)
        rows["ttft_generate"].append(g1)
        rows["ttft_custom"].append(c1)
    med = {k: statistics.median(v) for k, v in rows.items()}

    # one recall = the memory head (exact search over the bank + choice) + one decode step for
    # the memory position; the head is timed directly, in the loop's own code path.
    recall_ids = torch.cat([inputs["input_ids"], torch.tensor([[lm.tokens.recall]])], dim=1)
    recall_cost = {}
    for size in (10_000, 100_000):
        db = MemoryVectorDB(lm.hidden_size)
        db.add(torch.randn(size, lm.hidden_size))
        recall = Recall(lm.tokens.recall, lm.tokens.memory_pad, db, RecallSettings(top_k=5), lm.encoder.embedding)
        res = generate(model, {"input_ids": recall_ids}, GenerationSettings(max_new_tokens=4), recall=recall)
        assert res.injections, "no recall happened"
        selector = MemorySelector(db, RecallSettings(top_k=5))
        query = torch.randn(lm.hidden_size)
        head = statistics.median(timed(lambda: db.vector(selector.choose(query).index)) for _ in range(50))
        recall_cost[size] = (head, (head + med["custom"]) / med["custom"])

    # where a decode step goes: the model's forward (backbone + lm_head) vs the loop around it
    backbone = backbone_and_head(model)[0]
    spent = []
    original = backbone.forward

    def clocked(*a, **kw):
        t = time.perf_counter()
        out = original(*a, **kw)
        spent.append(time.perf_counter() - t)
        return out

    backbone.forward = clocked
    try:
        total = timed(lambda: ours(n))
    finally:
        backbone.forward = original
    forward_share = sum(spent) / total

    # the adapter as PEFT runs it by default (unmerged), and generate's strongest CPU path: a static
    # cache with a compiled forward (transformers' own recipe), compile time reported apart
    per_token = lambda fn: statistics.median((timed(lambda: fn(n)) - timed(lambda: fn(1))) / (n - 1)  # noqa: E731
                                             for _ in range(args.repeats))
    set_adapter_merged(model, False)
    unmerged = per_token(ours)
    set_adapter_merged(model, True)
    base = unwrap_model(model)
    plain_forward = base.forward
    base.forward = torch.compile(plain_forward, mode="reduce-overhead")

    def hf_static(k: int):
        config = to_generation_config(settings(k), **ids)
        config.cache_implementation = "static"
        return base.generate(**inputs, generation_config=config)

    compile_s = timed(lambda: (hf_static(n), hf_static(1)))
    compiled = per_token(hf_static)
    base.forward = plain_forward

    # our loop with its compiled decode step on a static cache (what the app runs once warm)
    step = fast_path.enable(model)
    compile_all = timed(lambda: step.warm_up())
    compile_ours = step.compile_seconds
    assert step.error is None, step.error
    assert hf(n).tolist() == ours(n).sequences.tolist(), "compiled loop and generate disagree"
    graphs = counters["stats"]["unique_graphs"]
    fast = per_token(ours)
    ttft_fast = statistics.median(timed(lambda: ours(1)) for _ in range(args.repeats))
    recompiles = counters["stats"]["unique_graphs"] - graphs

    int8 = measure_int8(model, inputs, settings, ids, n, per_token, ours(n).sequences)

    bandwidth = read_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound = bandwidth / weight_bytes
    share = lambda seconds: f"{1 / seconds:.1f} tokens/s = {1 / seconds / bound:.0%} of the bound"  # noqa: E731

    hits = limit_hits()
    if hits:
        print(f"!!! WARNING: torch._dynamo hit its recompile limit {hits} time(s) in this run (its log above names the "
              "function): that function ran eagerly from then on, so the compiled rows below are not the compiled "
              "path's numbers !!!\n")
    print(f"{lm.name} fp32 (adapter merged), {torch.get_num_threads()} threads, {n} tokens, median of {args.repeats}\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| decode ms/token, model.generate | {med['generate'] * 1e3:.1f} |")
    print(f"| decode ms/token, custom loop | {med['custom'] * 1e3:.1f} |")
    print(f"| ratio custom / generate (median of per-repeat ratios) | {med['ratio']:.3f} |")
    print(f"| decode ms/token, generate + static cache + torch.compile (compiling took {compile_s:.0f} s) | "
          f"{compiled * 1e3:.1f} |")
    print(f"| ratio custom / compiled static generate | {med['custom'] / compiled:.3f} |")
    print(f"| decode ms/token, custom loop, compiled step + static cache (compiling took {compile_ours:.0f} s for "
          f"the first bucket, {compile_all:.0f} s for all {len(step.lengths)}) | "
          f"{fast * 1e3:.1f} |")
    print(f"| ratio compiled custom / generate | {fast / med['generate']:.3f} |")
    print(f"| ratio compiled custom / compiled static generate | {fast / compiled:.3f} |")
    print(f"| recompiles of the compiled step after warm-up: fp32 over {3 * args.repeats} generations, int8 over "
          f"{2 * args.repeats + 1} and a step-by-step replay | {recompiles}, {int8['recompiles']} |")
    print(f"| times torch._dynamo hit its recompile limit (then ran eagerly) | {hits} |")
    print(f"| decode ms/token, int8 (model.quantize: int8), compiled step (compiling took {int8['compile']:.0f} s "
          f"for the first bucket) | {int8['per_token'] * 1e3:.1f} |")
    print(f"| tokens/s int8 / compiled fp32 loop | {fast / int8['per_token']:.2f}x |")
    for path in ("eager", "compiled"):
        print(f"| int8 {path} vs fp32 on fp32's greedy continuation: KL nats/token, same argmax | {int8[path][0]:.3f}, "
              f"{int8[path][1]:.0%} |")
    print(f"| int8 greedy answer identical to fp32's | {int8['same']} |")
    print(f"| decode ms/token, custom loop, adapter left unmerged (PEFT's default) | {unmerged * 1e3:.1f} |")
    print(f"| time to first token, model.generate | {med['ttft_generate'] * 1e3:.0f} ms |")
    print(f"| time to first token, custom loop | {med['ttft_custom'] * 1e3:.0f} ms |")
    print(f"| time to first token, compiled custom loop | {ttft_fast * 1e3:.0f} ms |")
    for size, (head, steps) in recall_cost.items():
        print(f"| one recall at {size // 1000}k memories: memory head + memory position | "
              f"{head * 1e3:.2f} ms + 1 step = {steps:.2f} decode steps |")
    print(f"| share of a generation spent in the backbone forward | {forward_share:.1%} |")
    print(f"| measured read bandwidth | {bandwidth / 1e9:.1f} GB/s |")
    print(f"| weight bytes read per token | {weight_bytes / 1e6:.0f} MB |")
    print(f"| bandwidth bound | {bound:.1f} tokens/s |")
    print(f"| model.generate | {share(med['generate'])} |")
    print(f"| compiled static generate | {share(compiled)} |")
    print(f"| custom loop | {share(med['custom'])} |")
    print(f"| compiled custom loop | {share(fast)} |")
    if "llamacpp" in backends:
        from backends import compare

        compare(lm, inputs, fast, settings, ids, args)


if __name__ == "__main__":
    main()

"""Decode speed on a GPU, side by side in one run: transformers' `generate` (eager, and its static-cache path with
its own compile), our loop (eager) and our graph step (`decoding/graph.py`), on random-weight models of real shapes.

    python bench/gpu.py --out DIR [--models 1.7b,135m[,8b]] [--tokens 128] [--budget 330]
    python bench/gpu.py --smoke --out DIR      # a tiny shape, a few tokens: the logic end to end on a CPU

bf16 (fp32 with --smoke), greedy, one prompt; per-token time = (T(n) - T(1)) / (n - 1), the median of the
repeats; TTFT = T(1). A recall = the memory head's exact search over 10k / 100k memories on the device plus
the forward of 16 `<|memory_pad|>` slots and `</recall>` (one wide replay), in decode steps of the graph step.
Rows: B rows of one request (equal lengths), aggregate tokens/s. The bound is the weights' bytes over the
card's memory bandwidth (H200 4.8 TB/s, H100 3.35 TB/s). Every measure runs in its own try/except and is
skipped once the time budget is spent; results are written after each one (results.json, results.md, and
the log beside them), so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from decoding.events import DoneEvent  # noqa: E402
from decoding.graph import GraphDecoder  # noqa: E402
from decoding.graph_stream import stream_graph  # noqa: E402
from decoding.request import Controls, Prompt  # noqa: E402
from decoding.loop import generate  # noqa: E402
from decoding.memory import MemorySelector, Recall  # noqa: E402
from decoding.processors import to_generation_config  # noqa: E402
from decoding.settings import GenerationSettings, RecallSettings  # noqa: E402
from memory.bank import MemoryVectorDB  # noqa: E402

SHAPES = {  # the published configs' numbers (HuggingFaceTB/SmolLM2-*, meta-llama/Llama-3.1-8B)
    "135m": ("SmolLM2-135M", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                  num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                                  max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "1.7b": ("SmolLM2-1.7B", dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                  num_attention_heads=32, num_key_value_heads=32, rope_theta=130000.0,
                                  max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "8b": ("Llama-3.1-8B", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                                max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "smoke": ("tiny (smoke)", dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   tie_word_embeddings=True)),
}
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}  # bytes/s, HBM
PROMPT = "<|im_start|>user\nWrite a long story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n"
SLOTS = 16


class Run:
    """The results so far, the log and the time budget."""

    def __init__(self, out: Path, budget: float):
        self.out, self.budget, self.t0 = out, budget, time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(out / "bench_gpu.log", "a")
        self.results: dict = {"models": {}}

    def log(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def measure(self, model: str, name: str, cost: float, fn) -> None:
        """Run one measure unless less than `cost` seconds of budget are left; record its result or its error."""
        into = self.results["models"].setdefault(model, {})
        if self.left() < cost:
            into[name] = {"skipped": f"time budget: {self.left():.0f} s left, needs about {cost:.0f} s"}
            self.log(f"{model} / {name}: skipped ({into[name]['skipped']})")
            return
        self.log(f"{model} / {name} ...")
        t = time.perf_counter()
        try:
            into[name] = fn()
        except Exception as e:  # noqa: BLE001 - one failed measure must not cost the others
            into[name] = {"error": f"{type(e).__name__}: {e}"}
            self.log(traceback.format_exc())
        self.log(f"{model} / {name}: {json.dumps(into[name])[:400]} ({time.perf_counter() - t:.1f} s)")
        self.save()

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1))
        (self.out / "results.md").write_text(table(self.results))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def per_token(run, n: int, repeats: int) -> dict:
    """{ms_per_token, ttft_ms}: (T(n) - T(1)) / (n - 1) and T(1), medians over `repeats`."""
    ones, rates = [], []
    for _ in range(repeats):
        one, many = timed(lambda: run(1)), timed(lambda: run(n))
        ones.append(one)
        rates.append((many - one) / (n - 1))
    return {"ms_per_token": statistics.median(rates) * 1e3, "ttft_ms": statistics.median(ones) * 1e3}


def load_tokenizer(path: str | None):
    """The embedded model's tokenizer: --tokenizer, artifacts/gpu/tokenizer (bench/gpu_prepare.sh), or the
    converted embedded model in the cache; None when none is there (the prompt is then fixed ids)."""
    from transformers import AutoTokenizer

    candidates = [path] if path else [str(ROOT / "artifacts" / "gpu" / "tokenizer")]
    try:
        from models.embedded import EMBEDDED_NAME, cache_root

        candidates.append(str(cache_root() / "models" / EMBEDDED_NAME))
    except Exception:  # noqa: BLE001
        pass
    for c in candidates:
        if c and (Path(c) / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(c), c
    return None, None


def build(shape: dict, device: str, dtype: torch.dtype):
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def bench_model(run: Run, key: str, args, tokenizer, device: str, dtype: torch.dtype) -> None:
    name, shape = SHAPES[key]
    n, repeats = args.tokens, args.repeats
    model = build(shape, device, dtype)
    vocab, hidden = shape["vocab_size"], shape["hidden_size"]
    recall_id, pad_id, end_id = vocab - 3, vocab - 2, vocab - 1  # random weights: any ids do
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = (tokenizer(PROMPT, return_tensors="pt")["input_ids"] if tokenizer is not None
           else torch.randint(3, 40000, (1, 24), generator=torch.Generator().manual_seed(0)))
    info = run.results["models"].setdefault(name, {})
    info.update(weights_gb=weight_bytes / 1e9, prompt_tokens=ids.shape[1], dtype=str(dtype), tokens=n)
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    bw = next((b for k, b in BANDWIDTH.items() if k in card), None)
    if bw:
        info["bound_ms_per_token"] = weight_bytes / bw * 1e3
    dev_ids = ids.to(device)
    greedy = lambda k: GenerationSettings(max_new_tokens=k, min_new_tokens=k)  # noqa: E731
    answers: dict[str, list[int]] = {}

    def hf_config(k: int, static: bool = False):
        config = to_generation_config(greedy(k), eos_token_id=None, pad_token_id=0)
        if static:
            config.cache_implementation = "static"
        return config

    def agreement(tokens: list[int], k: int = 16) -> str:
        """How many first greedy tokens equal eager `generate`'s (bf16 parts late, a wrong step at once: run 3)."""
        k = min(k, len(tokens))
        ref = model.generate(dev_ids, generation_config=hf_config(k))[0, ids.shape[1]:].tolist()
        return f"{next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), k)}/{k}"

    def graph_step():
        dec = GraphDecoder(model, max_len=args.max_len, spans=(SLOTS + 1,), graphs=args.graphs)
        compile_s = dec.warm_up()
        run_k = lambda k: dec.generate(ids, greedy(k))  # noqa: E731
        answers["graph"] = run_k(n).tokens[0]
        out = {"compile_s": compile_s, "agrees_with_eager": agreement(answers["graph"]), **per_token(run_k, n, repeats)}
        out["ttft_host_ms"] = run_k(1).ttft * 1e3
        out["graphs"], out["fallback"] = dec.graph.mode, dec.graph.fallback
        graph_step.decoder = dec
        return out

    def chat_graph():
        """The chat's own answer on the same step (`decoding.graph_stream`: events, detokenizer, stop criteria,
        read one step late), as `Engine.stream` runs it."""
        dec = getattr(graph_step, "decoder", None)
        if dec is None:
            raise RuntimeError("the graph step did not compile: no chat measure")
        dec.ready.set()

        def run_k(k):
            events = list(stream_graph(dec, Prompt({"input_ids": ids}), greedy(k), None, tokenizer, None,
                                       Controls(eos_token_id=[]), lambda _: iter(())))
            if not isinstance(events[-1], DoneEvent):
                raise RuntimeError("the step did not take the request")
            return events[-1].result

        answers["chat"] = run_k(n).sequences[0, ids.shape[1]:].tolist()
        out = per_token(run_k, n, repeats)
        out["same_tokens_as_the_step"] = answers["chat"] == answers.get("graph")
        return out

    def hf_static():
        t = time.perf_counter()
        for k in (n, 1, n, 1):  # the first calls compile (and record) for both cache lengths
            model.generate(dev_ids, generation_config=hf_config(k, True))
        compile_s = time.perf_counter() - t
        return {"compile_and_first_calls_s": compile_s,
                **per_token(lambda k: model.generate(dev_ids, generation_config=hf_config(k, True)), n, repeats)}

    def hf_eager():
        answers["hf"] = model.generate(dev_ids, generation_config=hf_config(n))[0, ids.shape[1]:].tolist()
        return per_token(lambda k: model.generate(dev_ids, generation_config=hf_config(k)), n, repeats)

    def ours_eager():
        res = generate(model, {"input_ids": dev_ids}, greedy(n))
        answers["ours"] = res.sequences[0, ids.shape[1]:].tolist()
        return per_token(lambda k: generate(model, {"input_ids": dev_ids}, greedy(k)), n, repeats)

    def recall():
        dec = getattr(graph_step, "decoder", None)
        if dec is None:
            raise RuntimeError("the graph step did not compile: no recall measure")
        step_ms = run.results["models"][name]["graph step"]["ms_per_token"]
        out = {}
        db = MemoryVectorDB(hidden, token_values=True)  # grown from one size to the next
        g, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
        for size in sorted(args.memories):
            t = time.perf_counter()
            for start in range(len(db), size, 20_000):
                k = min(20_000, size - start)
                db.add(torch.randn(k, hidden, generator=g), values=list(rng.integers(3, 40000, (k, SLOTS), np.int32)))
            built = time.perf_counter() - t
            rec = Recall(recall_id, pad_id, db, RecallSettings(), suffix=(end_id,)).with_tokens(model.get_input_embeddings())
            selector = MemorySelector.of(rec)
            query = torch.randn(hidden, device=device, dtype=dtype)
            upload = timed(lambda: selector.choose(query))  # the keys go to the device once
            head = statistics.median(timed(lambda: selector.choose(query)) for _ in range(20))
            # the wide replay of 16 slots + </recall>, in place (the cache's position moved back after each)
            dec.graph.prefill(dec.graph.embed(dev_ids))
            memory = selector.choose(query)
            vectors = rec.embed(rec.values(memory), device, dtype)
            span = rec.span(memory)
            g_ = dec.graph

            def one_span():
                g_.forward_span(span, dict(enumerate(vectors)))
                for layer in g_.cache.layers:
                    layer.cumulative_length.sub_(len(span))
                g_.one.position.sub_(len(span))
                g_.length -= len(span)

            one_span()
            span_s = statistics.median(timed(one_span) for _ in range(10))
            full = dec.generate(torch.cat([ids, torch.tensor([[recall_id]])], 1), greedy(4), recall=rec)
            out[f"{size}"] = {"bank_build_s": built, "first_search_s": upload, "head_ms": head * 1e3,
                              "span_ms": span_s * 1e3, "slots": memory.slots,
                              "decode_steps": (head + span_s) * 1e3 / step_ms,
                              "recalled_through_the_decoder": bool(full.recalls)}
            del selector, rec
        return out

    def rows(kind: str, b: int):
        def fn():
            batch_ids = dev_ids.expand(b, -1).contiguous()
            if kind == "graph":
                dec = GraphDecoder(model, batch=b, max_len=args.max_len, spans=(), graphs=args.graphs)
                compile_s = dec.warm_up(spans=False)
                res = per_token(lambda k: dec.generate(batch_ids, greedy(k)), n, repeats)
                res["compile_s"], res["graphs"], res["fallback"] = compile_s, dec.graph.mode, dec.graph.fallback
                one = run.results["models"][name].get("graph step", {}).get("ms_per_token")
                if one:
                    res["vs_1_row"] = b / res["ms_per_token"] * one
            else:
                res = per_token(lambda k: generate(model, {"input_ids": batch_ids}, greedy(k)), n, repeats)
            res["tokens_per_s"] = b / res["ms_per_token"] * 1e3
            return res
        return fn

    eager_cost = 2 * repeats * (n + 1) * (0.03 if device == "cuda" else 0.05) + 5
    run.measure(name, "graph step", 80, graph_step)
    run.measure(name, "chat on the graph step", 10, chat_graph)
    if args.static:
        run.measure(name, "transformers static generate", 30, hf_static)
    for b in sorted(args.graph_rows, reverse=True):  # 32 first: the 32/1 ratio is the target
        run.measure(name, f"graph step, {b} rows", 30, rows("graph", b))
        if b == max(args.graph_rows):
            run.measure(name, "recall", 15, recall)
    if not args.graph_rows:
        run.measure(name, "recall", 15, recall)
    if args.eager:  # measured in the first run (docs/gpu/results.md): behind --eager
        run.measure(name, "transformers eager generate", eager_cost, hf_eager)
        run.measure(name, "our eager loop", eager_cost, ours_eager)
        for b in args.rows:
            run.measure(name, f"our eager loop, {b} rows", eager_cost, rows("eager", b))
    if "hf" in answers:
        info["same_greedy_answer"] = {k: v == answers["hf"] for k, v in answers.items() if k != "hf"}
        info["same_prefix_tokens"] = {k: next((i for i, (a, b) in enumerate(zip(v, answers["hf"])) if a != b),
                                             min(len(v), len(answers["hf"]))) for k, v in answers.items() if k != "hf"}
    run.save()
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def cell(entry, key: str, fmt: str = "{:.2f}") -> str:
    if not isinstance(entry, dict):
        return "—"
    if "skipped" in entry:
        return "skipped"
    if "error" in entry:
        return "error"
    return fmt.format(entry[key]) if key in entry else "—"


def table(results: dict) -> str:
    env = results.get("env", {})
    lines = [f"{env.get('date', '')}, {env.get('card', '')}, torch {env.get('torch', '')}, transformers "
             f"{env.get('transformers', '')}, {env.get('dtype', '')}, greedy, random weights, inductor "
             f"{env.get('inductor', 'defaults')}", "",
             "| model | transformers eager ms/token | transformers static ms/token (compile s) | our eager loop "
             "ms/token | graph step ms/token (compile s) | graph step's first greedy tokens = eager generate's | "
             "bound ms/token | graph / bound | graph / tf static | TTFT ms: tf eager / tf static / graph |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in results.get("models", {}).items():
        g, s = m.get("graph step", {}), m.get("transformers static generate", {})
        bound = m.get("bound_ms_per_token")
        ratio = lambda a, b: f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) else "—"  # noqa: E731
        gms, sms = g.get("ms_per_token") if isinstance(g, dict) else None, s.get("ms_per_token") if isinstance(s, dict) else None
        lines.append(
            f"| {name} ({m.get('weights_gb', 0):.2f} GB) | {cell(m.get('transformers eager generate'), 'ms_per_token')} | "
            f"{cell(s, 'ms_per_token')} ({cell(s, 'compile_and_first_calls_s', '{:.0f}')}) | "
            f"{cell(m.get('our eager loop'), 'ms_per_token')} | {cell(g, 'ms_per_token')} "
            f"({cell(g, 'compile_s', '{:.0f}')}) | {g.get('agrees_with_eager', '—') if isinstance(g, dict) else '—'} | "
            f"{f'{bound:.3f}' if bound else '—'} | "
            f"{ratio(bound, gms)} | {ratio(gms, sms)} | {cell(m.get('transformers eager generate'), 'ttft_ms', '{:.1f}')} / "
            f"{cell(s, 'ttft_ms', '{:.1f}')} / {cell(g, 'ttft_ms', '{:.1f}')} |")
    lines += ["", "| model | graph step ms/token | the chat's answer on it ms/token (events, detokenizer, criteria) | "
              "same tokens |", "|---|---|---|---|"]
    for name, m in results.get("models", {}).items():
        c = m.get("chat on the graph step", {})
        lines.append(f"| {name} | {cell(m.get('graph step'), 'ms_per_token')} | {cell(c, 'ms_per_token')} | "
                     f"{c.get('same_tokens_as_the_step', '—') if isinstance(c, dict) else '—'} |")
    lines += ["", "| model | recall: memories | head ms | 16-slot span ms | in decode steps |", "|---|---|---|---|---|"]
    for name, m in results.get("models", {}).items():
        r = m.get("recall", {})
        if isinstance(r, dict) and not ({"skipped", "error"} & set(r)):
            for size, v in r.items():
                lines.append(f"| {name} | {int(size):,} | {v['head_ms']:.3f} | {v['span_ms']:.3f} | "
                             f"{v['decode_steps']:.2f} |")
        else:
            lines.append(f"| {name} | — | {cell(r, 'x')} | | |")
    lines += ["", "| model | path, rows | ms/step | aggregate tokens/s | rows / 1 row, aggregate tokens/s |",
              "|---|---|---|---|---|"]
    for name, m in results.get("models", {}).items():
        for k, v in m.items():
            if "rows" in k:
                lines.append(f"| {name} | {k} | {cell(v, 'ms_per_token')} | {cell(v, 'tokens_per_s', '{:.0f}')} | "
                             f"{cell(v, 'vs_1_row', '{:.1f}x')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "artifacts/gpu-bench"))
    ap.add_argument("--models", default="1.7b,135m", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget", type=float, default=260, help="seconds for the whole run; later measures are skipped")
    ap.add_argument("--eager", action="store_true", help="also transformers' eager generate and our eager loop "
                    "(1 row and --rows rows; measured in the first run)")
    ap.add_argument("--rows", default="8,32", help="rows of one request through our eager loop (with --eager)")
    ap.add_argument("--graph-rows", default="8,32", help="rows through the graph step (a compile each)")
    ap.add_argument("--graphs", default="manual", choices=["manual", "trees"],
                    help="the step as one captured CUDA graph (manual) or torch.compile's CUDA graphs (trees)")
    ap.add_argument("--memories", default="100000")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--inductor", default="", help="inductor settings of the run, k=v,... (freezing=1: a wrong step)")
    ap.add_argument("--no-static", dest="static", action="store_false", help="skip transformers' static generate")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape and a few tokens (runs on a CPU)")
    args = ap.parse_args()
    if args.smoke:
        args.models, args.tokens, args.repeats, args.memories = "smoke", 6, 1, "2000"
        args.rows, args.graph_rows, args.max_len, args.eager = "2", "2", 128, True
    as_ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    args.rows, args.graph_rows, args.memories = as_ints(args.rows), as_ints(args.graph_rows), as_ints(args.memories)
    for key, value in (item.split("=", 1) for item in args.inductor.split(",") if item):
        setattr(torch._inductor.config, key, type(getattr(torch._inductor.config, key))(int(value)))
    transformers.logging.set_verbosity_error()  # (generate's notes on min_new_tokens, a line a call)
    torch._dynamo.config.recompile_limit = 64  # several models' steps share one code object (torch < 2.13)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    run = Run(Path(args.out), args.budget)
    tokenizer, where = load_tokenizer(args.tokenizer)
    run.results["env"] = {"date": time.strftime("%Y-%m-%d %H:%M"), "card": torch.cuda.get_device_name() if device ==
                          "cuda" else "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
                          "dtype": str(dtype), "tokenizer": where or "none: fixed prompt ids", "span_width": SLOTS + 1,
                          "budget_s": args.budget, "inductor": args.inductor or "defaults"}
    run.log(f"device {run.results['env']['card']}, tokenizer {where}, models {args.models}, budget {args.budget:.0f} s")
    for key in args.models.split(","):
        try:
            bench_model(run, key, args, tokenizer, device, dtype)
        except Exception:  # noqa: BLE001
            run.log(f"{key}: " + traceback.format_exc())
        torch._dynamo.reset()
    run.results["total_s"] = time.perf_counter() - run.t0
    run.save()
    run.log("\n" + table(run.results))


if __name__ == "__main__":
    main()

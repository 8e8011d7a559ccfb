"""Decode speed on a GPU, side by side in one run: transformers' `generate` (eager, and its static-cache path with
its own compile), our loop (eager) and our graph step (`decoding/graph.py`), on random-weight models of real shapes.

    python bench/gpu.py --out DIR [--models 1.7b,135m[,8b]] [--tokens 128] [--budget 330]
    python bench/gpu.py --smoke --out DIR      # a tiny shape, a few tokens: the logic end to end on a CPU

bf16 (fp32 with --smoke), greedy, one prompt; per-token time = (T(n) - T(1)) / (n - 1), the median of the
repeats; TTFT = T(1). A recall = the memory head's exact search over 10k / 100k memories on the device plus
the forward of 16 `<|memory_pad|>` slots and `</recall>` (one wide replay), in decode steps of the graph step.
Rows: B rows of one request (equal lengths), aggregate tokens/s. Sessions: 1 / 8 / 32 / 64 chat sessions at once
through the chat service as a server runs it (`chat.service.Service` over this model with the graph step and the
graph rows attached (`decoding/graph_rows.py`, as many rows as the most sessions): the worker's rounds, an answer
alone on the single-row step, answers in progress together as rows of the second, one replay a step for all of them),
each a greedy answer of --tokens to its own question; aggregate tokens/s from the first submission to the last
answer's end, and the ratio to one session; then the same with every answer a row ("rows only": one session too). The
bound is the weights' bytes over the card's memory bandwidth (H200 4.8 TB/s, H100 3.35 TB/s). The measures run in
three phases, each for every model before the next (the batch-1 step, with the chat's default options
(`model.graph_fuse`, `model.graph_matvec`, ...) unless --fuse / --matvec / --gqa / --autotune say otherwise, its
kernels, and frozen with --frozen; the sessions and a recall, its kernels at the largest bank; the rest, the step's
variants first (each with its recall's span): the attention packed, the products autotuned, cuBLAS's products when
the step's are Triton's, the other fusion). Every measure runs in its own try/except and is skipped once the time
budget is spent; results are written after each one (results.json, results.md, and the log beside them), so a run cut
short keeps what it measured.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from bench import _gpu_serving as serving  # noqa: E402
from bench._gpu_measure import Run, allocated, device_profile, per_token  # noqa: E402
from bench._gpu_report import table  # noqa: E402
from bench._gpu_serving import SLOTS  # noqa: E402
from chat.config import ModelConfig  # noqa: E402
from decoding import graph, graph_compile  # noqa: E402
from decoding.events import DoneEvent  # noqa: E402
from decoding.graph import GraphDecoder  # noqa: E402
from decoding.graph_stream import stream_graph  # noqa: E402
from decoding.request import Controls, Prompt  # noqa: E402
from decoding.loop import generate  # noqa: E402
from decoding.processors import to_generation_config  # noqa: E402
from decoding.settings import GenerationSettings  # noqa: E402
from models.loading import ensure_special_tokens  # noqa: E402
from models.modeling import shared_weights, unwrap_model  # noqa: E402

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


def options_of(dec: GraphDecoder) -> dict:
    """How a graph step was compiled, as it resolved its options (`decoding.graph_compile`)."""
    g = dec.graph
    return {"fuse": g.fuse, "matvec": g.matvec, "gqa": g.gqa, "autotune": g.autotune}


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


class ModelBench:
    """The measures of one model shape, side by side on one run; `all()` runs them in the order the budget favours."""

    def __init__(self, run: Run, key: str, args, tokenizer, device: str, dtype: torch.dtype):
        self.run, self.args, self.tokenizer, self.device, self.dtype = run, args, tokenizer, device, dtype
        self.name, shape = SHAPES[key]
        self.n, self.repeats = args.tokens, args.repeats
        self.model = build(shape, device, dtype)
        # the recall tokens, as the chat adds them to a model it loads (3 more rows where the tokenizer outgrows it)
        self.tokens = ensure_special_tokens(self.model, tokenizer) if tokenizer is not None else None
        self.vocab, self.hidden = self.model.get_input_embeddings().weight.shape[0], shape["hidden_size"]
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.ids = (tokenizer(PROMPT, return_tensors="pt")["input_ids"] if tokenizer is not None
                    else torch.randint(3, 40000, (1, 24), generator=torch.Generator().manual_seed(0)))
        self.dev_ids = self.ids.to(device)
        self.info = run.results["models"].setdefault(self.name, {})
        self.info.update(weights_gb=weight_bytes / 1e9, layers=shape["num_hidden_layers"],
                         prompt_tokens=self.ids.shape[1], dtype=str(dtype), tokens=self.n)
        card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        bw = next((b for k, b in BANDWIDTH.items() if k in card), None)
        if bw:
            self.info["bound_ms_per_token"] = weight_bytes / bw * 1e3
        self.answers: dict[str, list[int]] = {}
        self.decoder: GraphDecoder | None = None  # the graph step of one row (the recall and chat measures reuse it)

    @staticmethod
    def greedy(k: int) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=k, min_new_tokens=k)

    def hf_config(self, k: int, static: bool = False):
        config = to_generation_config(self.greedy(k), eos_token_id=None, pad_token_id=0)
        if static:
            config.cache_implementation = "static"
        return config

    def agreement(self, tokens: list[int], k: int = 16) -> str:
        """How many first greedy tokens equal eager `generate`'s (bf16 parts late, a wrong step at once: run 3)."""
        k = min(k, len(tokens))
        ref = self.model.generate(self.dev_ids, generation_config=self.hf_config(k))[0, self.ids.shape[1]:].tolist()
        return f"{next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), k)}/{k}"

    def graph_step(self) -> dict:
        # attached to the model (as the chat's service attaches it): the sessions measure answers on it too
        before = allocated()
        dec = graph.enable(self.model, max_len=self.args.max_len, spans=(SLOTS + 1,), graphs=self.args.graphs,
                           fuse=self.args.fuse, matvec=self.args.matvec, gqa=self.args.gqa,
                           autotune=self.args.autotune)
        out = self._step(dec, "graph")
        out.update(memory_gb=(allocated() - before) / 1e9, **options_of(dec))
        self.decoder = dec
        return out

    def _step(self, dec: GraphDecoder, name: str) -> dict:
        compile_s = dec.warm_up()
        run_k = lambda k: dec.generate(self.ids, self.greedy(k))  # noqa: E731
        self.answers[name] = run_k(self.n).tokens[0]
        out = {"compile_s": compile_s, "agrees_with_eager": self.agreement(self.answers[name]),
               **per_token(run_k, self.n, self.repeats)}
        out["ttft_host_ms"] = run_k(1).ttft * 1e3
        out["graphs"], out["fallback"] = dec.graph.mode, dec.graph.fallback
        return out

    def graph_long(self) -> dict:
        """The plain step on a static cache of --long-len positions (the app's `model.graph_max_len`), the same
        answer: what the cache's length costs (a replay attends over the smallest window of the cache that holds its
        columns, so it should cost what the --max-len cache does)."""
        dec = GraphDecoder(self.model, max_len=self.args.long_len, spans=(), graphs=self.args.graphs)
        compile_s = dec.warm_up(spans=False)
        out = {"positions": self.args.long_len, "compile_s": compile_s,
               **per_token(lambda k: dec.generate(self.ids, self.greedy(k)), self.n, self.repeats)}
        return self._vs_the_step(out)

    def _vs_the_step(self, out: dict) -> dict:
        one = self.info.get("graph step", {}).get("ms_per_token")
        if one:
            out["vs_the_step"] = out["ms_per_token"] / one
        return out

    def graph_frozen(self) -> dict:
        """The same step with `freeze=True` (`model.graph_freeze`: the decode forward compiled with inductor's
        freezing, q/k/v and gate/up one matmul each), side by side; its memory beside the plain step's is the
        frozen copy of those weights, which stays for the rest of the run (inductor's compiled module holds it);
        the other measures run on the plain step. `frozen` says whether it was (a fallback to torch.compile's CUDA
        graphs is not)."""
        before = allocated()
        dec = GraphDecoder(self.model, max_len=self.args.max_len, spans=(SLOTS + 1,), graphs=self.args.graphs,
                           freeze=True)
        out = self._step(dec, "frozen")
        out["memory_gb"] = (allocated() - before) / 1e9
        out["same_tokens_as_the_step"] = self.answers["frozen"] == self.answers.get("graph")
        out["frozen"] = dec.graph.freeze
        self._vs_the_step(out)
        del dec
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
        return out

    def variant(self, fuse: bool, matvec: str, gqa: str, autotune: bool):
        """The step with other options (`model.graph_fuse`, `model.graph_matvec`, `model.graph_gqa`,
        `model.graph_autotune`), side by side with the step (on a twin of the model when it fuses a model the step
        did not, fusing moves the weights, or packs its attention, which the model's config then says), and its
        recall's span (`serving.span_cost`)."""
        def fn() -> dict:
            moves = fuse and not self.args.fuse  # (fusing moves the weights: a copy of them)
            packs = gqa == "packed" and self.info["graph step"].get("gqa") != gqa  # (the config: the same weights)
            model = self._twin(share=not moves) if moves or packs else self.model
            before, name = allocated(), f"fuse={fuse}, matvec={matvec}, gqa={gqa}, autotune={autotune}"
            dec = GraphDecoder(model, max_len=self.args.max_len, spans=(SLOTS + 1,), graphs=self.args.graphs,
                               fuse=fuse, matvec=matvec, gqa=gqa, autotune=autotune)
            out = self._step(dec, name)
            out.update(memory_gb=(allocated() - before) / 1e9, **options_of(dec),
                       same_tokens_as_the_step=self.answers[name] == self.answers.get("graph"))
            self._vs_the_step(out)
            try:  # (a failure here keeps the step's figures)
                out.update(serving.span_cost(self, dec.graph, out["ms_per_token"]))
            except Exception as e:  # noqa: BLE001
                out["span_error"] = f"{type(e).__name__}: {e}"
                self.run.log(traceback.format_exc())
            del dec, model
            gc.collect()
            if self.device == "cuda":
                torch.cuda.empty_cache()
            return out
        return fn

    def variants(self) -> list[tuple[str, bool, str, str, bool]]:
        """(label, fuse, matvec, gqa, autotune) of the variants measured beside the step, first what may be made a
        default next: the attention packed for a model with grouped-query layers whose step copies their heads, the
        products autotuned (with the attention packed where it can be), cuBLAS's products when the step's are
        Triton's, the other fusion."""
        step = self.info.get("graph step", {})
        fused, matvec, gqa = step.get("fuse", self.args.fuse), step.get("matvec", "cublas"), step.get("gqa", "repeat")
        tuned = step.get("autotune", self.args.autotune)
        config = self.model.config.get_text_config()
        packs = gqa == "repeat" and config.num_key_value_heads < config.num_attention_heads
        out = [("packed attention", fused, matvec, "packed", tuned)] if packs else []
        out += [("packed attention, autotuned" if packs else "autotuned", fused, matvec,
                 "packed" if packs else gqa, True)] if not tuned else []
        out += [("cuBLAS" if fused else "plain, cuBLAS", fused, "cublas", gqa, tuned)] if matvec != "cublas" else []
        return out + [("not fused" if fused else "fused", not fused, "cublas", gqa, tuned)]

    def kernels(self) -> dict:
        """What one token of the plain step runs (torch.profiler over 32 tokens after a warm answer: on a GPU the
        kernels inside the captured graph's replays, on a CPU the operators): `device_profile`'s summary, and their
        time beside the step's ms/token (the rest is gaps between kernels and the host)."""
        dec, n = self.step_for("kernel"), 32
        dec.generate(self.ids, self.greedy(n))
        out = device_profile(lambda: dec.generate(self.ids, self.greedy(n)), n)
        step = self.info.get("graph step", {}).get("ms_per_token")
        return {**out, **({"busy_of_the_step": out["busy_ms_per_call"] / step} if step else {})}

    def _twin(self, share: bool = False) -> torch.nn.Module:
        """A copy of the model, without the steps attached to it (`graph.enable`: not submodules); `share`: its
        modules and config its own, its weights the model's (a fused group's joined ones too: a deep copy would copy
        each part's weight apart from its group's)."""
        base = unwrap_model(self.model)
        held = {k: base.__dict__.pop(k) for k in list(base.__dict__) if k.startswith("_recall_")}
        try:
            return copy.deepcopy(self.model, shared_weights(self.model) if share else {})
        finally:
            base.__dict__.update(held)

    def step_for(self, what: str) -> GraphDecoder:
        if self.decoder is None:
            raise RuntimeError(f"the graph step did not compile: no {what} measure")
        return self.decoder

    def chat_graph(self) -> dict:
        """The chat's own answer on the same step (`decoding.graph_stream`: events, detokenizer, stop criteria,
        read one step late), as `Engine.stream` runs it."""
        dec = self.step_for("chat")
        dec.ready.set()

        def run_k(k):
            events = list(stream_graph(dec, Prompt({"input_ids": self.ids}), self.greedy(k), None, self.tokenizer,
                                       None, Controls(eos_token_id=[]), lambda _: iter(())))
            if not isinstance(events[-1], DoneEvent):
                raise RuntimeError("the step did not take the request")
            return events[-1].result

        self.answers["chat"] = run_k(self.n).sequences[0, self.ids.shape[1]:].tolist()
        out = per_token(run_k, self.n, self.repeats)
        out["same_tokens_as_the_step"] = self.answers["chat"] == self.answers.get("graph")
        return out

    def page_processors(self) -> dict:
        """The same step sampling with every processor the page offers (penalty, the n-gram ban over the sequence
        kept on the device, temperature, top-k, top-p, min-p, typical-p): what they cost inside the graph."""
        dec = self.step_for("page processors")
        s = lambda k: GenerationSettings(  # noqa: E731
            max_new_tokens=k, do_sample=True, temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, typical_p=0.9,
            repetition_penalty=1.1, no_repeat_ngram_size=3)
        run_k = lambda k: dec.generate(self.ids, s(k))  # noqa: E731
        run_k(self.n)  # (its graphs are captured on first use)
        out = self._vs_the_step(per_token(run_k, self.n, self.repeats))
        out["in_graph"] = dec._kind(s(self.n), None) is not None  # (not the host-side fallback)
        return out

    def hf_static(self) -> dict:
        generate_k = lambda k: self.model.generate(  # noqa: E731
            self.dev_ids, generation_config=self.hf_config(k, True))
        t = time.perf_counter()
        for k in (self.n, 1, self.n, 1):  # the first calls compile (and record) for both cache lengths
            generate_k(k)
        return {"compile_and_first_calls_s": time.perf_counter() - t, **per_token(generate_k, self.n, self.repeats)}

    def hf_eager(self) -> dict:
        generate_k = lambda k: self.model.generate(self.dev_ids, generation_config=self.hf_config(k))  # noqa: E731
        self.answers["hf"] = generate_k(self.n)[0, self.ids.shape[1]:].tolist()
        return per_token(generate_k, self.n, self.repeats)

    def ours_eager(self) -> dict:
        generate_k = lambda k: generate(self.model, {"input_ids": self.dev_ids}, self.greedy(k))  # noqa: E731
        self.answers["ours"] = generate_k(self.n).sequences[0, self.ids.shape[1]:].tolist()
        return per_token(generate_k, self.n, self.repeats)

    def rows(self, kind: str, b: int):
        def fn():
            batch_ids = self.dev_ids.expand(b, -1).contiguous()
            if kind == "graph":
                dec = GraphDecoder(self.model, batch=b, max_len=self.args.max_len, spans=(), graphs=self.args.graphs)
                compile_s = dec.warm_up(spans=False)
                res = per_token(lambda k: dec.generate(batch_ids, self.greedy(k)), self.n, self.repeats)
                res["compile_s"], res["graphs"], res["fallback"] = compile_s, dec.graph.mode, dec.graph.fallback
                one = self.info.get("graph step", {}).get("ms_per_token")
                if one:
                    res["vs_1_row"] = b / res["ms_per_token"] * one
            else:
                res = per_token(lambda k: generate(self.model, {"input_ids": batch_ids}, self.greedy(k)), self.n,
                                self.repeats)
            res["tokens_per_s"] = b / res["ms_per_token"] * 1e3
            return res
        return fn

    def batch_one(self) -> None:
        """Phase 1 (every model's before any model's phase 2): the batch-1 targets: the step, its kernels, and frozen
        (--frozen)."""
        self.run.measure(self.name, "graph step", 80, self.graph_step)
        self.run.measure(self.name, "graph step, kernels", 15, self.kernels)
        if self.args.frozen:
            self.run.measure(self.name, "graph step, frozen", 80, self.graph_frozen)

    def serving(self) -> None:
        """Phase 2: chat sessions through the service, and a recall."""
        if self.args.sessions:
            self.run.measure(self.name, "sessions", 60, lambda: serving.sessions(self))
        self.run.measure(self.name, "recall", 15, lambda: serving.recall(self))

    def rest(self) -> None:
        """Phase 3: the chat's answer on the step, transformers' static path, rows of one request, the eager paths."""
        run, name, args = self.run, self.name, self.args
        run.measure(name, "chat on the graph step", 10, self.chat_graph)
        run.measure(name, "graph step, every page processor", 10, self.page_processors)
        if args.variants:  # (a variant compiles as the step did, an autotuned one longer: a few times as long)
            compiled = self.info.get("graph step", {}).get("compile_s") or 60
            for label, fuse, matvec, gqa, autotune in self.variants():
                run.measure(name, f"graph step, variant: {label}", (3 if autotune else 1.2) * compiled + 20,
                            self.variant(fuse, matvec, gqa, autotune))
        if args.static:
            run.measure(name, "transformers static generate", 30, self.hf_static)
        for b in sorted(args.graph_rows, reverse=True):  # 32 first: the 32/1 ratio
            run.measure(name, f"graph step, {b} rows", 30, self.rows("graph", b))
        if args.long_len:
            run.measure(name, "graph step, long cache", 60, self.graph_long)
        if args.eager:  # measured in the first run (docs/gpu/results.md): behind --eager
            eager_cost = 2 * self.repeats * (self.n + 1) * (0.03 if self.device == "cuda" else 0.05) + 5
            run.measure(name, "transformers eager generate", eager_cost, self.hf_eager)
            run.measure(name, "our eager loop", eager_cost, self.ours_eager)
            for b in args.rows:
                run.measure(name, f"our eager loop, {b} rows", eager_cost, self.rows("eager", b))
        answers = self.answers
        if "hf" in answers:
            self.info["same_greedy_answer"] = {k: v == answers["hf"] for k, v in answers.items() if k != "hf"}
            self.info["same_prefix_tokens"] = {
                k: next((i for i, (a, b) in enumerate(zip(v, answers["hf"])) if a != b),
                        min(len(v), len(answers["hf"]))) for k, v in answers.items() if k != "hf"}
        run.save()


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
    ap.add_argument("--sessions", default="1,8,32,64", help="chat sessions at once through the service")
    ap.add_argument("--graphs", default="manual", choices=["manual", "trees"],
                    help="the step as one captured CUDA graph (manual) or torch.compile's CUDA graphs (trees)")
    ap.add_argument("--memories", default="100000")
    ap.add_argument("--max-len", type=int, default=512, help="positions of the graph steps' static caches")
    ap.add_argument("--long-len", type=int, default=4096,
                    help="the plain step once more on a cache this long (the app's graph_max_len); 0: not")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--inductor", default="", help="inductor settings of the run, k=v,... (freezing=1: a wrong step)")
    ap.add_argument("--no-static", dest="static", action="store_false", help="skip transformers' static generate")
    ap.add_argument("--frozen", action="store_true",
                    help="the frozen graph step (model.graph_freeze) beside the plain one (run 4 measured it: off)")
    defaults = ModelConfig()
    ap.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=defaults.graph_fuse,
                    help="the step's q/k/v and gate/up joined (model.graph_fuse; its default)")
    ap.add_argument("--matvec", default=defaults.graph_matvec, choices=graph_compile.MATVEC,
                    help="the step's one-row products (model.graph_matvec; its default)")
    ap.add_argument("--gqa", default=defaults.graph_gqa, choices=graph_compile.GQA,
                    help="the step's grouped-query attention (model.graph_gqa; its default)")
    ap.add_argument("--autotune", action=argparse.BooleanOptionalAction, default=defaults.graph_autotune,
                    help="the step's products autotuned (model.graph_autotune; its default)")
    ap.add_argument("--no-variants", dest="variants", action="store_false",
                    help="skip the step's variants (packed attention, autotuned, cuBLAS's products, the other "
                    "fusion)")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape and a few tokens (runs on a CPU)")
    args = ap.parse_args()
    if args.smoke:
        args.models, args.tokens, args.repeats, args.memories = "smoke", 6, 1, "2000"
        args.rows, args.graph_rows, args.max_len, args.eager, args.sessions = "2", "2", 128, True, "1,2"
        args.long_len, args.frozen = 512, True
    as_ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    args.rows, args.graph_rows, args.memories = as_ints(args.rows), as_ints(args.graph_rows), as_ints(args.memories)
    args.sessions = as_ints(args.sessions)
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
    benches = []
    for key in args.models.split(","):
        try:
            benches.append(ModelBench(run, key, args, tokenizer, device, dtype))
        except Exception:  # noqa: BLE001
            run.log(f"{key}: " + traceback.format_exc())
    for phase in (ModelBench.batch_one, ModelBench.serving, ModelBench.rest):  # the targets first, for every model
        for bench in benches:
            try:
                phase(bench)
            except Exception:  # noqa: BLE001
                run.log(f"{bench.name}: " + traceback.format_exc())
    run.results["total_s"] = time.perf_counter() - run.t0
    run.save()
    run.log("\n" + table(run.results))


if __name__ == "__main__":
    main()

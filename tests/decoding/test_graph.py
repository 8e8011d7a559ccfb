"""The buffer-injection decode step (`decoding/graph.py`): the loop's tokens, logits and recalls on a CPU; no host
sync, exact recalls and batched = alone on a GPU (`-m gpu`, skipped without CUDA).

Self-contained (a tiny random Llama without a tokenizer, no fixture of conftest.py), so the GPU machine runs it
with `--noconftest`: it has no Pillow, faiss or the embedded model.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.device_sampler import DeviceSampler, Kind
from decoding.graph import Decoded, GraphDecoder
from decoding.loop import generate
from decoding.memory import Recall
from decoding.processors import before_warpers, build_logits_processor
from decoding.request import Controls, Prompt
from decoding.sampling import draw
from decoding.settings import GenerationSettings
from memory.bank import MemoryVectorDB
from memory.device import DeviceKeys
from tests_helpers import kv_recall as memories

VOCAB, RECALL, PAD, END, EOS = 512, 500, 501, 502, 2
KEY_DIM = 24
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_llama(seed: int = 0, device: str = "cpu") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval().to(device)


def prompt(seed: int = 0, length: int = 12, rows: int = 1) -> torch.Tensor:
    return torch.randint(3, 400, (rows, length), generator=torch.Generator().manual_seed(seed))


def kv_recall(model, n: int = 12, max_slots: int = 5, min_slots: int = 1) -> Recall:
    """Key/value memories of 1..`max_slots` slots (`tests_helpers.kv_recall`)."""
    return memories(model, (RECALL, PAD, END), n, (min_slots, max_slots), seed=0, key_dim=KEY_DIM)


def loop_run(model, ids, settings, recall=None):
    return generate(model, {"input_ids": ids.to(model.device)}, settings, recall=recall,
                    controls=Controls(output_logits=True, eos_token_id=None))


def assert_same_as_loop(got, ref, ids, atol=1e-5):
    assert got.tokens[0] == ref.sequences[0, ids.shape[1]:].tolist()
    assert [(r.position, r.memory_index, r.length) for r in got.recalls] == \
        [(r.position, r.memory_index, r.length) for r in ref.injections]
    steps = ref.logits.shape[1]
    torch.testing.assert_close(torch.stack(got.logits[:steps], 1), ref.logits, atol=atol, rtol=atol)


# --------------------------------------------------------------------------- CPU


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


@pytest.fixture(scope="module")
def eager(model):
    return GraphDecoder(model, max_len=256, compile=False)


@pytest.mark.parametrize("settings", [GenerationSettings(max_new_tokens=24),
                                      GenerationSettings(max_new_tokens=24, repetition_penalty=1.3)],
                         ids=["greedy", "penalty"])
def test_the_buffer_step_equals_the_loop(model, eager, settings):
    ids = prompt()
    assert_same_as_loop(eager.generate(ids, settings, keep_logits=True), loop_run(model, ids, settings), ids)


def test_an_n_gram_ban_in_the_step_equals_the_loop_and_acts(model, eager):
    """The no-repeat n-gram ban runs in the step (its tensor form: no host-side fallback), also with a recall's
    forced tokens in the sequence it reads: the loop's tokens, logits and recalls; and without the ban the greedy
    answer repeats itself."""
    ids, recalls = prompt(), 0
    for n in (2, 3):
        for recall in (None, kv_recall(model)):
            s = GenerationSettings(max_new_tokens=40, no_repeat_ngram_size=n,
                                   sequence_bias=() if recall is None else (((RECALL,), 4.0),))
            procs = build_logits_processor(s, eos_token_id=None, prompt_ids=ids, vocab_size=VOCAB)
            assert eager.graph.sampler.kind_of(procs, False) is not None
            got = eager.generate(ids, s, recall=recall, keep_logits=True)
            assert_same_as_loop(got, loop_run(model, ids, s, recall=recall), ids)
            recalls += len(got.recalls)
    assert recalls > 0
    plain = eager.generate(ids, GenerationSettings(max_new_tokens=40)).tokens[0]
    pairs = list(zip(plain, plain[1:]))
    assert len(set(pairs)) < len(pairs)  # (so the ban had something to ban)


def test_an_injected_memory_equals_the_loop(model, eager):
    """Recalls at the prompt's end and in the middle of the answer: the same memories at the same positions,
    the same tokens and logits (a memory's slots and `</recall>` in one wide step)."""
    recall = kv_recall(model)
    ids = torch.cat([prompt(1), torch.tensor([[RECALL]])], 1)
    s = GenerationSettings(max_new_tokens=20)
    got = eager.generate(ids, s, recall=recall, keep_logits=True)
    assert got.recalls and got.tokens[0][:got.recalls[0].length] == [PAD] * got.recalls[0].length
    assert_same_as_loop(got, loop_run(model, ids, s, recall), ids)
    biased = GenerationSettings(max_new_tokens=30, sequence_bias=(((RECALL,), 4.0),))
    got = eager.generate(prompt(2), biased, recall=recall, keep_logits=True)
    assert len(got.recalls) >= 2 and max(r.length for r in got.recalls) > 1
    assert_same_as_loop(got, loop_run(model, prompt(2), biased, recall), prompt(2))


def test_batched_rows_equal_each_alone(model, eager):
    ids, s = prompt(5, rows=2), GenerationSettings(max_new_tokens=16)
    both = GraphDecoder(model, batch=2, max_len=256, compile=False).generate(ids, s)
    assert both.tokens == [eager.generate(ids[r:r + 1], s).tokens[0] for r in range(2)]


def test_a_stop_ends_within_one_step(model, eager):
    """An interrupt after the k-th token read back ends the request with k tokens and k + 1 steps launched at
    most (the step queued behind the read); EOS likewise."""
    stop, got, k = threading.Event(), [], 5
    record = Decoded([], "length")
    for tokens in eager.stream(prompt(), GenerationSettings(max_new_tokens=50), interrupt=stop, out=record):
        got.append(tokens)
        if len(got) == k:
            stop.set()
    assert len(got) == k and record.finish == "interrupted" and record.steps <= k
    free = eager.generate(prompt(), GenerationSettings(max_new_tokens=50)).tokens[0]
    eos = free[6]
    first = free.index(eos)
    ended = eager.generate(prompt(), GenerationSettings(max_new_tokens=50), eos_token_id=eos)
    assert ended.tokens[0] == free[:first + 1] and ended.finish == "stop" and ended.steps <= first + 1


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    stats = pytest.importorskip("scipy.stats")
    keep = probs > 0
    assert counts[~keep].sum() == 0  # nothing drawn where the reference has no mass
    p = probs[keep].double()
    expected = p / p.sum() * float(counts.sum())
    return float(stats.chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("settings", [GenerationSettings(do_sample=True),
                                      GenerationSettings(do_sample=True, temperature=0.7, top_k=6, top_p=0.9),
                                      GenerationSettings(do_sample=True, min_p=0.05, repetition_penalty=1.5)],
                         ids=["plain", "top-k-top-p", "min-p-penalty"])
def test_the_no_sync_draw_has_the_reference_distribution(settings):
    """`draw` (argmax of p / Exponential noise) after the request's processors, against softmax of the processed
    scores (what `torch.multinomial` draws from), by a chi-square test; a wrong law is rejected by the same test."""
    n, rows = 10, 40_000
    scores = torch.linspace(-2, 2, n)[None].expand(rows, -1).clone()  # [rows, n]
    seen = torch.tensor([[n - 1, 3]]).expand(rows, -1)  # the sequence so far (the repetition penalty's input)
    procs = build_logits_processor(settings, eos_token_id=None, prompt_ids=seen, vocab_size=n)
    processed = procs(seen, scores)
    tokens = draw(processed, True, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=n)
    probs = torch.softmax(processed[0], -1)
    assert chi_square_p(counts, probs) > 1e-3
    skewed = torch.softmax(processed[0] * 1.1, -1)  # a slightly different law: the test has the power to see it
    assert chi_square_p(counts, skewed) < 1e-6 if (skewed > 0).sum() > 1 else True


SAMPLED = [GenerationSettings(do_sample=True),
           GenerationSettings(do_sample=True, temperature=0.7, top_k=6, top_p=0.9),
           GenerationSettings(do_sample=True, min_p=0.05, repetition_penalty=1.5, sequence_bias=(((4,), 1.5),)),
           GenerationSettings(do_sample=True, temperature=1.3, top_k=0, top_p=0.6, min_p=0.1),
           GenerationSettings(do_sample=True, temperature=0.8, typical_p=0.7, no_repeat_ngram_size=1)]
SAMPLED_IDS = ["plain", "top-k-top-p", "min-p-penalty-bias", "temp-top-p-min-p", "typical-ngram"]


def configured(settings, rows: int, n: int = 10):
    seen = torch.tensor([[n - 1, 3]]).expand(rows, -1)
    procs = build_logits_processor(settings, eos_token_id=None, prompt_ids=seen, vocab_size=n)
    sampler = DeviceSampler(rows, n, torch.device("cpu"), max_len=16)
    kind = sampler.configure(procs, do_sample=settings.do_sample, seed=5, eos=[], pad=0, masked=False)
    assert kind is not None
    if kind.sees:
        sampler.see(seen)
    return seen, procs, sampler, kind


@pytest.mark.parametrize("settings", SAMPLED + [GenerationSettings(repetition_penalty=0.8)],
                         ids=SAMPLED_IDS + ["greedy-penalty"])
def test_the_graph_sampler_processes_as_transformers(settings):
    """The in-graph processors' scores are transformers' processors' scores (the same -inf, the same floats)."""
    scores = torch.randn(6, 10, generator=torch.Generator().manual_seed(1)) * 2
    seen, procs, sampler, kind = configured(settings, 6)
    torch.testing.assert_close(sampler.scores(scores, kind), procs(seen, scores.clone()), atol=0, rtol=0)


@pytest.mark.parametrize("settings", [GenerationSettings(), SAMPLED[1], SAMPLED[2]],
                         ids=["greedy", "top-k-top-p", "min-p-penalty-bias"])
def test_no_memory_in_the_graph_is_the_processors(settings):
    """The chat's `NoMemory` (nothing to read): `<recall>` (7) and `<|memory_pad|>` (8) suppressed, the end (9) not
    a first token of a row that wanted a memory, and which rows wanted one, at the first step and a later one."""
    from decoding.memory import NoMemory

    g = torch.Generator().manual_seed(2)
    seen = torch.tensor([[9, 3]]).expand(6, -1)
    for step, scores in enumerate([torch.randn(6, 10, generator=g), torch.randn(6, 10, generator=g)]):
        scores[::2, 7] = 9.0  # rows 0, 2, 4 want a memory
        no_memory = NoMemory(Recall(7, 8), start=2, eos=[9])
        procs = before_warpers(build_logits_processor(settings, eos_token_id=None, prompt_ids=seen, vocab_size=10),
                               no_memory)
        sampler = DeviceSampler(6, 10, torch.device("cpu"))
        kind = sampler.configure(procs, do_sample=settings.do_sample, seed=5, eos=[], pad=0, masked=False, prompt=2)
        assert kind is not None and kind.no_memory
        if kind.penalty:
            sampler.see(seen)
        sampler.row_step.fill_(step)  # (the first-token rule holds at the first commit alone)
        row_seen = seen if step == 0 else torch.cat([seen, seen[:, :1]], 1)
        torch.testing.assert_close(sampler.scores(scores, kind), procs(row_seen, scores.clone()), atol=0, rtol=0)
        wanted = torch.stack(no_memory.wanted).any(0)
        assert wanted[::2].all() and not wanted.all()
        assert (sampler.wanted_at == step).tolist() == wanted.tolist()


def test_the_graph_n_gram_ban_and_typical_p_are_transformers_row_by_row():
    """Rows of other n (0: none, 1 to `NGRAM_MAX`) and typical masses side by side in one sampler, over sequences
    with repeats fed in pieces as replays feed them (a span's real columns right-aligned, or one token in the last
    column): each row's scores are transformers' processors' for that row's sequence alone, and the bans ban."""
    from decoding.device_sampler import NGRAM_MAX

    g = torch.Generator().manual_seed(4)
    sizes = [0, 1, 2, 3, 5, NGRAM_MAX, 2, 4]
    b, vocab = len(sizes), 12
    source = torch.randint(0, 6, (b, 40), generator=g)  # 6 of the 12 tokens: n-grams repeat
    sampler, kinds, procs = DeviceSampler(b, vocab, torch.device("cpu"), max_len=40), [], []
    for row, n in enumerate(sizes):
        s = GenerationSettings(do_sample=True, no_repeat_ngram_size=n, typical_p=1.0 if row % 3 == 0 else 0.6)
        procs.append(build_logits_processor(s, eos_token_id=None, prompt_ids=source[row:row + 1, :7],
                                            vocab_size=vocab))
        kinds.append(sampler.configure_row(row, procs[-1], do_sample=True, seed=row, prompt=7))
        assert kinds[-1] is not None and kinds[-1].ngram == (n > 0) and kinds[-1].typical == (row % 3 != 0)
    kind = Kind.union(kinds)
    sampler.see(source[:, :7])
    seqs, used, banned = [source[row, :7] for row in range(b)], [7] * b, 0
    for step in range(8):
        width = 5 if step % 2 else 1
        fed, valid = torch.zeros((b, width), dtype=torch.long), torch.zeros((b, width), dtype=torch.bool)
        for row in range(b):
            k = width if row % 2 == 0 else 1  # even rows: the whole span, odd rows: one token, last column
            fed[row, width - k:] = source[row, used[row]:used[row] + k]
            valid[row, width - k:] = True
            seqs[row] = torch.cat([seqs[row], fed[row, width - k:]])
            used[row] += k
        sampler.see(fed, valid)
        scores = torch.randn(b, vocab, generator=g) * 2
        got = sampler.scores(scores, kind)
        for row in range(b):
            want = procs[row](seqs[row][None], scores[row:row + 1].clone())
            torch.testing.assert_close(got[row:row + 1], want, atol=0, rtol=0)
            if sizes[row]:  # (its first processor: the ban)
                banned += int(torch.isinf(procs[row][0](seqs[row][None], scores[row:row + 1].clone())).sum())
    assert banned >= 20  # (the bans acted)


@pytest.mark.parametrize("settings", SAMPLED, ids=SAMPLED_IDS)
def test_the_graph_draw_has_the_reference_distribution(settings):
    """The in-graph draw (Gumbel-max over hashed uniforms): across rows at one step, and across steps of one row,
    the law of softmax(processed scores), by the chi-square test that rejects a slightly different law."""
    n, rows = 10, 40_000
    scores = torch.linspace(-2, 2, n)[None].expand(rows, -1).clone()
    seen, procs, sampler, kind = configured(settings, rows)
    probs = torch.softmax(procs(seen[:1], scores[:1].clone())[0], -1)
    counts = torch.bincount(sampler.choose(scores, kind), minlength=n)
    assert chi_square_p(counts, probs) > 1e-3
    skewed = torch.softmax(procs(seen[:1], scores[:1].clone())[0] * 1.1, -1)
    assert chi_square_p(counts, skewed) < 1e-6 if (skewed > 0).sum() > 1 else True
    seen, procs, one, kind = configured(settings, 1)
    draws = []
    for _ in range(20_000):
        draws.append(one.choose(scores[:1], kind))
        one.row_step.add_(1)
    assert chi_square_p(torch.bincount(torch.cat(draws), minlength=n), probs) > 1e-3


def test_a_seeded_graph_draw_repeats_and_a_fallback_equals_the_loop(model, eager):
    """The same seed, the same sampled tokens (no generator state); processors without a tensor form (a
    suppressed token) run on the host after the replay and still give the loop's tokens and logits."""
    s = GenerationSettings(max_new_tokens=16, do_sample=True, top_k=20, repetition_penalty=1.2, seed=11)
    first = eager.generate(prompt(), s).tokens
    assert eager.generate(prompt(), s).tokens == first
    assert eager.generate(prompt(), GenerationSettings(**{**s.__dict__, "seed": 12})).tokens != first
    greedy_first = eager.generate(prompt(), GenerationSettings(max_new_tokens=1)).tokens[0][0]
    fallback = GenerationSettings(max_new_tokens=24, suppress_tokens=(greedy_first,))  # (it acts at once)
    procs = build_logits_processor(fallback, eos_token_id=None, prompt_ids=prompt(), vocab_size=VOCAB)
    assert DeviceSampler(1, VOCAB, torch.device("cpu")).configure(procs, do_sample=False, seed=0, eos=[], pad=0,
                                                                  masked=False) is None
    ids = prompt()
    assert_same_as_loop(eager.generate(ids, fallback, keep_logits=True), loop_run(model, ids, fallback), ids)


def test_a_long_memory_takes_the_span_buckets(model):
    """Memories of 35-40 slots: two replays (33 wide, then the rest in the 17-wide graph), the loop's tokens and logits
    with the repetition penalty counting the forced tokens."""
    dec = GraphDecoder(model, max_len=256, compile=False)
    recall = kv_recall(model, max_slots=40, min_slots=35)
    s = GenerationSettings(max_new_tokens=120, sequence_bias=(((RECALL,), 4.0),), repetition_penalty=1.1)
    got = dec.generate(prompt(2), s, recall=recall, keep_logits=True)
    assert len(got.recalls) >= 2 and min(r.length for r in got.recalls) > 34  # 33 + a 17-wide rest
    assert_same_as_loop(got, loop_run(model, prompt(2), s, recall), prompt(2))


def test_the_device_search_ranks_as_the_bank():
    g = torch.Generator().manual_seed(0)
    db = MemoryVectorDB(32)
    db.add(torch.randn(500, 32, generator=g))
    query = torch.randn(32, generator=g)
    snap = db._snap
    scores, ids = DeviceKeys.of(snap, snap.normed, snap.ids, torch.device("cpu")).topk(query, 10)
    want_scores, want_ids = db.topk(query, 10)
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(scores, want_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("freeze,matvec,autotune", [(False, "cublas", False), (True, "cublas", False),
                                                     (False, "triton", False), (False, "cublas", True)],
                         ids=["plain", "frozen", "tuned", "autotuned"])
def test_the_compiled_step_equals_the_eager_one(model, eager, freeze, matvec, autotune, monkeypatch):
    """torch.compile of the same step (on a CPU: inductor without CUDA graphs) gives the eager step's tokens, logits and
    recalls; frozen too (the weights constants, q/k/v and gate/up one matmul each; the cache a plain input: marked
    static, freezing folds it into a constant and the tokens part at the second step); tuned too (`matvec="triton"`:
    the one-position forward in a compile of its own, with coordinate-descent tuning; on a CPU inductor keeps its
    products, so this checks the two compiles, the GPU test their reductions); and autotuned (`autotune`: every
    forward compiled with max-autotune, its products the fastest of inductor's candidates)."""
    from torch._dynamo.utils import counters

    options, compile_ = [], torch.compile

    def compiling(fn, **kwargs):  # (each compile `decoding.graph_compile.forwards` makes, with its options)
        options.append(kwargs.get("options") or {})
        return compile_(fn, **kwargs)
    monkeypatch.setattr(torch, "compile", compiling)
    fast = GraphDecoder(model, max_len=256, freeze=freeze, matvec=matvec, autotune=autotune)
    assert fast.graph.matvec == matvec and fast.graph.autotune == autotune
    assert (fast.graph._fn is fast.graph._fn_one) == (not freeze and matvec == "cublas")
    fast.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    assert options and {bool(o.get("max_autotune")) for o in options} == {autotune}  # (every compile of the step)
    recall = kv_recall(model)
    s = GenerationSettings(max_new_tokens=24, sequence_bias=(((RECALL,), 4.0),))
    want = eager.generate(prompt(2), s, recall=recall, keep_logits=True)
    got = fast.generate(prompt(2), s, recall=recall, keep_logits=True)
    # every width compiled in the warm-up (the frozen one too, though freezing is set only while it compiles)
    assert counters["stats"]["unique_graphs"] == graphs and not fast.graph._freezing
    assert got.tokens == want.tokens and want.recalls
    assert [(r.position, r.memory_index) for r in got.recalls] == [(r.position, r.memory_index) for r in want.recalls]
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("freeze", [False, True])
@pytest.mark.parametrize("matvec", ["cublas", "triton"])
def test_every_compile_of_the_step_is_autotuned_when_asked(monkeypatch, freeze, matvec):
    """`decoding.graph_compile.forwards` with `autotune`: each of its compiles (the spans', the tuned or frozen
    one-position forward's) has inductor's max-autotune, and none without it."""
    from decoding.graph_compile import forwards

    for autotune in (False, True):
        options = []
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: options.append(kw.get("options") or {}) or fn)
        forwards(lambda *a: a, mode="manual", device=torch.device("cpu"), fuse=False, freeze=freeze, matvec=matvec,
                 autotune=autotune, freezing=lambda: False)
        assert len(options) == 1 + (freeze or matvec == "triton")
        assert [bool(o.get("max_autotune")) for o in options] == [autotune] * len(options)


def windows_seen(step) -> list[int]:
    """The cache windows of `step`'s replays from now on (recorded as each runs: at `_run`, which picks the window;
    on a GPU a replay of a captured graph never calls `_body`)."""
    seen, run = [], step._run

    def recorded(inputs, kind, window=None):
        out = run(inputs, kind, window)
        seen.append(step.window)
        return out
    step._run = recorded
    return seen


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_answer_crossing_a_cache_window_equals_the_loop(model, compiled):
    """A replay attends over the smallest window of the static cache that holds its columns (128 or 512 here; the
    step builds that window's mask): an answer whose prompt, recalls and tokens run past the first window equals the
    loop's, tokens, recalls and logits; compiled, every window runs on the warm-up's compiles."""
    from torch._dynamo.utils import counters

    dec = GraphDecoder(model, max_len=512, compile=compiled)
    assert dec.graph.windows == (128, 512)
    dec.warm_up()
    graphs, seen = counters["stats"]["unique_graphs"], windows_seen(dec.graph)
    ids, recall = prompt(5, length=100), kv_recall(model)
    s = GenerationSettings(max_new_tokens=60, sequence_bias=(((RECALL,), 4.0),))
    got = dec.generate(ids, s, recall=recall, keep_logits=True)
    assert set(seen) == {128, 512} and got.recalls
    assert_same_as_loop(got, loop_run(model, ids, s, recall), ids, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_step_whose_windows_fail_attends_over_the_whole_cache(model, monkeypatch):
    """A warm-up that fails with the cache's windows (here their mask raises) runs again without them: the step
    works, over the whole cache, and says why in `fallback`."""
    import decoding.graph as graph_module

    def broken(*args, **kwargs):
        raise RuntimeError("no windows here")

    monkeypatch.setattr(graph_module, "window_mask", broken)
    dec = GraphDecoder(model, max_len=512, compile=False)
    dec.warm_up()
    assert not dec.graph.windowed and dec.graph.windows == (512,) and "no windows here" in dec.graph.fallback
    ids, s = prompt(5, length=100), GenerationSettings(max_new_tokens=40)
    assert_same_as_loop(dec.generate(ids, s, keep_logits=True), loop_run(model, ids, s), ids)


# --------------------------------------------------------------------------- GPU


@contextlib.contextmanager
def no_sync():
    """Any host sync of the CUDA stream raises (`.item()`, a blocking copy, `torch.multinomial`, ...)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(scope="module")
def cuda_model():
    return tiny_llama(seed=3, device="cuda")


@pytest.fixture(scope="module")
def graphed(cuda_model):
    dec = GraphDecoder(cuda_model, max_len=256, spans=(17,))  # (the recalls here are at most 6 wide)
    dec.warm_up()
    assert dec.graph.graphs
    return dec


@gpu
@pytest.mark.gpu
def test_the_step_is_one_captured_graph(graphed):
    """The manual capture worked (no fall back to torch.compile's CUDA graphs)."""
    assert graphed.graph.mode == "manual" and graphed.graph.fallback is None, graphed.graph.fallback


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("settings", [GenerationSettings(max_new_tokens=32),
                                      GenerationSettings(max_new_tokens=32, do_sample=True, temperature=0.8, top_k=40,
                                                         top_p=0.9, min_p=0.02, repetition_penalty=1.2, seed=3),
                                      GenerationSettings(max_new_tokens=32, no_repeat_ngram_size=3),
                                      GenerationSettings(max_new_tokens=32, do_sample=True, typical_p=0.9,
                                                         no_repeat_ngram_size=2, seed=3)],
                         ids=["greedy", "sample", "greedy-ngram", "sample-typical-ngram"])
def test_no_host_sync_in_a_decode_step(cuda_model, graphed, settings):
    graphed.generate(prompt(), settings)  # (the first replays of a new path may record)
    graphed.launch_guard = no_sync
    try:
        out = graphed.generate(prompt(), settings)
    finally:
        graphed.launch_guard = contextlib.nullcontext
    assert len(out.tokens[0]) == 32 and out.steps == 31
    if not settings.do_sample:
        assert out.tokens[0] == loop_run(cuda_model, prompt(), settings).sequences[0, 12:].tolist()


@gpu
@pytest.mark.gpu
def test_a_recall_on_the_gpu_replays_exactly(cuda_model, graphed):
    """CUDA graphs, the memory head on the device: the eager loop's tokens and recalls, and a full forward over the
    final sequence with the memories' vectors in place gives each step's logits."""
    recall = kv_recall(cuda_model)
    s = GenerationSettings(max_new_tokens=40, sequence_bias=(((RECALL,), 4.0),))
    ids = prompt(2)
    got = graphed.generate(ids, s, recall=recall, keep_logits=True)
    assert len(got.recalls) >= 2
    assert_same_as_loop(got, loop_run(cuda_model, ids, s, recall), ids, atol=1e-4)
    seq = torch.cat([ids[0], torch.tensor(got.tokens[0])]).cuda()[None]
    with torch.no_grad():
        emb = cuda_model.get_input_embeddings()(seq).clone()
        for pos, vec in got.memory_vectors.items():
            emb[0, pos] = vec.cuda()
        full = cuda_model(inputs_embeds=emb).logits[0].float()  # [L, V]
    kept = torch.stack([lg[0] for lg in got.logits])  # [steps, V], each scored from got.positions
    torch.testing.assert_close(kept, full[got.positions], atol=1e-3, rtol=1e-3)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("how", ["freeze", "fuse-triton", "fuse-triton-packed", "fuse-autotuned"])
def test_a_compile_variant_is_one_graph_without_host_syncs_and_the_loops(cuda_model, how):
    """Inductor's freezing (`freeze=True`: q/k/v and gate/up one matmul each), or q/k/v and gate/up joined in place
    with the one-row products as tuned Triton reductions (`fuse=True, matvec="triton"`: no cuBLAS kernel in a decode
    step's replay), with the attention packed (`gqa="packed"`), or fused with the products autotuned (`autotune`:
    cuBLAS's or Triton's templates) on the GPU: still one captured graph, no host sync, the loop's greedy tokens and
    recalls."""
    model = cuda_model if how == "freeze" else tiny_llama(seed=3, device="cuda")  # (fused in place: its own)
    dec = GraphDecoder(model, max_len=256, spans=(17,), freeze=how == "freeze", fuse=how != "freeze",
                       matvec="triton" if "triton" in how else "cublas", gqa="packed" if "packed" in how else "repeat",
                       autotune="autotuned" in how)
    dec.warm_up()
    assert dec.graph.mode == "manual" and dec.graph.fallback is None
    assert dec.graph.freeze if how == "freeze" else dec.graph.fuse and dec.graph.matvec == (
        "triton" if "triton" in how else "cublas") and dec.graph.autotune == ("autotuned" in how)
    assert dec.graph.gqa == ("packed" if "packed" in how else "repeat")
    recall, ids = kv_recall(model), prompt(2)
    s = GenerationSettings(max_new_tokens=40, sequence_bias=(((RECALL,), 4.0),))
    dec.generate(ids, s, recall=recall)  # (the first replays of a new path may record)
    dec.launch_guard = no_sync
    try:
        got = dec.generate(ids, s, recall=recall, keep_logits=True)
    finally:
        dec.launch_guard = contextlib.nullcontext
    assert got.recalls
    assert_same_as_loop(got, loop_run(model, ids, s, recall), ids, atol=1e-4)
    if "triton" in how:  # the decode step's kernels: inductor's reductions, none of cuBLAS's
        replay = next(graph for (width, *_), (graph, _) in dec.graph._captured.items() if width == 1).replay
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            replay()
            torch.cuda.synchronize()
        names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
        assert any(n.startswith("triton_") for n in names), names
        assert not [n for n in names if any(w in n.lower() for w in ("gemv", "gemm", "nvjet", "cublas"))], names


@gpu
@pytest.mark.gpu
def test_the_captured_memory_head_ranks_as_the_eager_search():
    """From a bank state's `CAPTURE_AFTER`-th search with one k, the search is one captured CUDA graph
    (`memory.device._Head`): the same scores and ids as the eager search, for new queries (copied into its buffer) of
    either dtype and shape, and for another k; a new state captures its own."""
    from memory.device import CAPTURE_AFTER, _Head

    g = torch.Generator().manual_seed(0)
    db = MemoryVectorDB(32)
    db.add(torch.randn(3000, 32, generator=g))
    queries = [torch.randn(32, generator=g).cuda() for _ in range(CAPTURE_AFTER + 3)]  # (the last 4 captured)
    for k in (1, 5, 40):  # (1: a greedy head, one reduction)
        for i, q in enumerate(queries):
            query = q.to(torch.bfloat16)[None] if i % 2 else q
            keys = db.device_keys(query.device)
            scores, ids = db.topk(query, k)
            want_scores, want_ids = keys.topk(query, k)
            assert ids.tolist() == want_ids.tolist() and scores.device.type == "cpu"
            torch.testing.assert_close(scores, want_scores.cpu(), atol=1e-6, rtol=1e-6)
        assert isinstance(keys._heads[k], _Head)
    db.add(torch.randn(10, 32, generator=g))
    assert not db.device_keys(queries[0].device)._heads  # (a new state: its own keys, searched anew)


@gpu
@pytest.mark.gpu
def test_batched_equals_alone_on_the_gpu(cuda_model, graphed):
    ids, s = prompt(5, rows=2), GenerationSettings(max_new_tokens=24)
    both = GraphDecoder(cuda_model, batch=2, max_len=256, spans=())
    both.warm_up(spans=False)
    assert both.generate(ids, s).tokens == [graphed.generate(ids[r:r + 1], s).tokens[0] for r in range(2)]


def told(events) -> list:
    """Tokens, recalls and finishes of a stream of events, comparable across decoders."""
    return [(type(e).__name__, *(getattr(e, k) for k in ("token_id", "memory_index", "reason") if hasattr(e, k)),
             getattr(e, "position", None)) for e in events if type(e).__name__ in ("TokenEvent", "RecallEvent",
                                                                                 "FinishEvent")]


@pytest.mark.parametrize("bank", ["memories", "none"])
@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])])
def test_the_chats_answer_on_the_step_is_the_loops(request, where, bank):
    """`decoding.graph_stream` (what `Engine.stream` runs on a model with a graph step): the loop's events, recalls
    mid-answer and a repetition penalty included, or with nothing to read `<recall>` suppressed in the graph
    (`NoMemory`) and the same record of it; on the GPU, no host sync in any step's launch."""
    from decoding.graph_stream import GraphCache, stream_graph
    from decoding.loop import stream_generate

    model = request.getfixturevalue("model" if where == "cpu" else "cuda_model")
    dec = request.getfixturevalue("eager" if where == "cpu" else "graphed")
    recall = kv_recall(model) if bank == "memories" else Recall(RECALL, PAD, None, without_memory="answer")
    s = GenerationSettings(max_new_tokens=40, sequence_bias=(((RECALL,), 4.0),), repetition_penalty=1.1)
    controls = Controls(eos_token_id=EOS)
    ids = prompt(2)
    want = list(stream_generate(model, {"input_ids": ids}, s, recall=recall, controls=controls))
    if where == "cuda":  # (a graph is captured on its first use, and a capture synchronises: these first)
        dec.warm_up(settings=(s,), eos=[EOS])
    dec.launch_guard = no_sync if where == "cuda" else contextlib.nullcontext
    try:
        got = list(stream_graph(dec, Prompt({"input_ids": ids}), s, recall, None, None, controls, None))
    finally:
        dec.launch_guard = contextlib.nullcontext
    recalls = sum(type(e).__name__ == "RecallEvent" for e in got)
    assert told(got) == told(want) and (recalls >= 2 if bank == "memories" else recalls == 0)
    result = got[-1].result
    assert result.missed_recall == want[-1].result.missed_recall == (None if bank == "memories" else [True])
    assert isinstance(result.cache, GraphCache) and result.cache.length == result.sequences.shape[1] - 1


def test_answers_ended_by_eos_on_the_step_and_in_the_rows_end_as_the_loops(model, eager):
    """A small bias on EOS ends two of three answers after 4 and 10 tokens (the third runs its length), each alone on
    the one-row step and the three at once as rows: each ends where the loop's alone does, with its reason (the host
    reads the length and EOS as ints, `Request.add`: a row that went on past its EOS, or a step's answer ended as
    "length", would differ)."""
    from decoding.batch import Batch
    from decoding.graph_rows import GraphRows
    from decoding.graph_stream import stream_graph
    from decoding.loop import stream_generate
    from rounds import drive

    s, controls = GenerationSettings(max_new_tokens=40, sequence_bias=(((EOS,), 0.2),)), Controls(eos_token_id=EOS)
    ids = [prompt(seed, length=12) for seed in (0, 2, 4)]
    want = [list(stream_generate(model, {"input_ids": x}, s, controls=controls)) for x in ids]
    assert [len(w[-1].result.new_tokens[0]) for w in want] == [40, 4, 10]
    assert [w[-1].result.finish_reasons[0] for w in want] == ["length", "stop", "stop"]
    for x, w in zip(ids, want):
        assert told(stream_graph(eager, Prompt({"input_ids": x}), s, None, None, None, controls, None)) == told(w)
    rows, batch = GraphRows(model, rows=3, max_len=512, spans=(17,), compile=False), Batch()
    rows.warm_up(settings=(s,), eos=[EOS])
    got = drive(batch, [(0, lambda x=x: rows.stream(batch, Prompt({"input_ids": x}), s, None, None, None, controls,
                                                    None)) for x in ids])
    assert [told(g) for g in got] == [told(w) for w in want] and rows.free_rows() == 3


def test_a_memory_that_could_outgrow_the_steps_cache_is_answered_by_the_loop(model):
    """Memories of up to 40 slots (`max_slots`): an answer that could not hold one in the step's cache is refused by
    the step, so the loop answers it whole (the step alone would run out of positions mid-answer)."""
    from decoding.graph_stream import stream_graph
    from decoding.loop import stream_generate

    dec = GraphDecoder(model, max_len=48, spans=(17,), compile=False)
    dec.max_slots = 40
    recall = kv_recall(model, max_slots=40, min_slots=35)
    ids, s = torch.cat([prompt(1), torch.tensor([[RECALL]])], 1), GenerationSettings(max_new_tokens=4)
    want = list(stream_generate(model, {"input_ids": ids}, s, recall=recall))
    got = list(stream_graph(dec, Prompt({"input_ids": ids}), s, recall, None, None, Controls(),
                            lambda p: stream_generate(model, p.inputs, s, recall=recall)))
    assert told(got) == told(want) and want[-1].result.sequences.shape[1] > 48  # (the memory alone: 35-40 slots)
    dec.max_slots = 8  # (a bank whose memories are longer than it says): the answer ends where the step's cache does
    got = list(stream_graph(dec, Prompt({"input_ids": ids}), s, recall, None, None, Controls(), None))
    assert told(got) == [("FinishEvent", "length", None)] and got[-1].result.sequences.tolist() == ids.tolist()


def test_a_warm_up_takes_every_configured_setting_and_a_stop_ends_only_itself(model):
    """Configured defaults the warm-up cannot build processors for alone (guidance's second model, a length penalty
    without an end id given) leave the step ready; a stop asked before a warm-up ends that one, not the next."""
    dec = GraphDecoder(model, max_len=128, spans=(17,), compile=False)
    dec.stop()
    dec.warm_up()
    assert not dec.ready.is_set() and dec.error is None
    dec.warm_up(settings=(GenerationSettings(guidance_scale=1.5), GenerationSettings(
        do_sample=True, exponential_decay_length_penalty=(4, 1.1)), GenerationSettings(do_sample=True, top_k=5)))
    assert dec.ready.is_set() and dec.error is None


@pytest.mark.parametrize("where,how", [("cpu", ""), ("cpu", "freeze"), ("cpu", "fuse"),
                                       pytest.param("cuda", "", marks=[gpu, pytest.mark.gpu]),
                                       pytest.param("cuda", "freeze", marks=[gpu, pytest.mark.gpu]),
                                       pytest.param("cuda", "fuse", marks=[gpu, pytest.mark.gpu])],
                         ids=["cpu", "cpu-frozen", "cpu-fused", "cuda", "cuda-frozen", "cuda-fused"])
def test_answers_at_once_as_rows_of_the_step_are_each_the_loops(request, where, how):
    """`decoding.graph_rows` (what the chat's concurrent answers decode in): three answers, one with memories of 18 to 30
    slots (wider than the 17-wide span graph), one of 1 to 6, one with nothing to read (a penalty on all), at once in three rows; each
    equals the loop's alone, event for event; on the GPU, no host sync in any replay's launch. Frozen: the decode
    forward compiled with inductor's freezing (on a CPU too), the rows' mask and cache plain inputs. Fused: q/k/v and
    gate/up joined in place (`decoding.fused`; a model of its own, the same weights)."""
    from decoding.batch import Batch
    from decoding.graph_rows import GraphRows
    from rounds import drive
    from decoding.loop import stream_generate

    model = request.getfixturevalue("model" if where == "cpu" else "cuda_model")
    if how == "fuse":
        model = tiny_llama(seed=3, device=where)
    s = GenerationSettings(max_new_tokens=40, sequence_bias=(((RECALL,), 4.0),), repetition_penalty=1.1)
    rows = GraphRows(model, rows=3, max_len=512, spans=(17,), compile=where == "cuda" or bool(how),
                     freeze=how == "freeze", fuse=how == "fuse")
    rows.warm_up(settings=(s,), eos=[EOS])  # (its graphs captured now: a capture synchronises)
    from torch._dynamo.utils import counters
    graphs = counters["stats"]["unique_graphs"]  # (every window and width compiled in the warm-up)
    recalls = [kv_recall(model, max_slots=30, min_slots=18), kv_recall(model, max_slots=6),
               Recall(RECALL, PAD, None, without_memory="answer")]
    controls = Controls(eos_token_id=EOS)
    ids = [prompt(2, length=100), prompt(3, length=20), prompt(4, length=7)]  # (the first: past the 128 window)
    batch, seen = Batch(), windows_seen(rows.graph)
    rows.decoder.launch_guard = no_sync if where == "cuda" else contextlib.nullcontext
    try:
        got = drive(batch, [(0, lambda x=x, rc=rc: rows.stream(batch, Prompt({"input_ids": x}), s, rc, None, None,
                                                                 controls, None)) for x, rc in zip(ids, recalls)])
    finally:
        rows.decoder.launch_guard = contextlib.nullcontext
    widths = []
    for x, rc, events in zip(ids, recalls, got):
        want = list(stream_generate(model, {"input_ids": x}, s, recall=rc, controls=controls))
        assert told(events) == told(want)
        assert events[-1].result.missed_recall == want[-1].result.missed_recall
        widths += [e.length for e in events if type(e).__name__ == "RecallEvent"]
    assert max(widths) > 17 and rows.replays > 30 and rows.free_rows() == 3 and set(seen) == {128, 512}
    assert counters["stats"]["unique_graphs"] == graphs and rows.graph.fallback is None  # (the windows held)


def test_the_gumbel_noise_is_finite_and_a_greedy_row_beside_sampled_ones_takes_its_argmax():
    """The hashed uniforms stay inside (0, 1) (their top value once rounded to 1: G = +inf, a NaN beside a -inf
    score), over 64 rows x 20 steps of a real vocabulary; and a row that does not sample takes its argmax whatever
    the noise is."""
    sampler = DeviceSampler(64, 49155, torch.device("cpu"))
    sampler.seed.copy_(torch.arange(64) * 7919 + 11)
    for step in range(20):
        sampler.row_step.fill_(step)
        assert torch.isfinite(sampler.gumbel()).all(), step
    scores = torch.randn(2, 49155, generator=torch.Generator().manual_seed(0))
    two = DeviceSampler(2, 49155, torch.device("cpu"))
    two.noise.copy_(torch.tensor([[0.0], [1.0]]))  # row 0 greedy, row 1 sampling
    kind = Kind(sample=True)
    real = two.gumbel
    two.gumbel = lambda rows=slice(None): torch.full_like(real(rows), float("inf"))
    assert int(two.choose(scores, kind)[0]) == int(scores[0].argmax())

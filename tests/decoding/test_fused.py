"""q/k/v and gate/up joined without a copy (`decoding.fused`): the weights stay what they were (names, values, no new
memory), an eager forward is the same computation, and the compiled graph step runs one matmul a group (counted in
inductor's own graph) with the eager step's tokens, logits and recalls."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import decoding.graph_compile
from decoding import fused
from decoding.fused import FusedPart, fuse_projections
from decoding.graph import GraphDecoder
from decoding.settings import GenerationSettings
from test_graph import RECALL, kv_recall, prompt, tiny_llama
from transformers import Qwen3Config, Qwen3ForCausalLM

LAYERS = 2
MM = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


class CountProducts(CustomGraphPass):
    """Inductor's post-grad pass that records, for each graph it compiles (after the fused pass), its matmuls and
    the columns they produce in all (the work: a group's product run once a module would triple its columns)."""

    def __init__(self):
        self.seen: list[tuple[int, int]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        mms = [n for n in graph.nodes if n.op == "call_function" and n.target in MM]
        self.seen.append((len(mms), sum(n.meta["val"].shape[-1] for n in mms)))

    def uuid(self) -> None:  # (None: no compiled artifact is cached, on disk or in memory, so the pass always runs)
        return None


def qwen3(seed: int = 0) -> Qwen3ForCausalLM:
    """Qwen3's layers: a norm of q and of k after their projections, and q wider than the hidden size."""
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         attention_bias=True, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).eval()


@pytest.mark.parametrize("make", [tiny_llama, qwen3], ids=["llama", "qwen3-with-biases"])
def test_joined_weights_are_views_with_the_same_names_and_values_and_the_eager_forward_is_unchanged(make):
    model, before = make(seed=3), make(seed=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse_projections(model) == 2 * LAYERS and fuse_projections(model) == 0  # (once)
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    whole = attn.q_proj._whole[0]
    for part in (attn.q_proj, attn.k_proj, attn.v_proj):  # (views of one tensor: nothing copied)
        assert part.weight.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    assert mlp.gate_proj._whole[0].shape == (2 * 128, 64)
    ids = prompt(1)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before(ids).logits)


def counting(count: CountProducts) -> dict:
    """torch.compile's options that run `count` (and compile: a graph from inductor's cache on disk runs no pass)."""
    return {"post_grad_custom_post_pass": count, "fx_graph_cache": False}


def unfused(model) -> tuple[int, int]:
    """(matmuls, columns) of a compiled forward of the model as it is: 7 a layer and the head's."""
    count = CountProducts()
    f = torch.compile(lambda ids: model(ids).logits, dynamic=False, options=counting(count))
    with torch.no_grad():
        f(prompt(1))
    return count.seen[0]


def test_the_fused_step_runs_one_matmul_a_group_and_equals_the_eager_step(monkeypatch):
    """Three matmuls fewer a layer in every graph the step compiles (the one-position forward, the span widths), as
    many columns, and the same tokens, logits and recalls as the eager step of the model as it was."""
    torch._dynamo.reset()  # (the suite compiles `GraphStep._forward` for many steps in one process: past dynamo's
    # recompile limit this step would run eagerly, its pass never called; CI saw no graph counted)
    model, reference = tiny_llama(seed=3), tiny_llama(seed=3)
    mms, columns = unfused(reference)
    assert mms == 7 * LAYERS + 1
    count = CountProducts()
    monkeypatch.setattr(decoding.graph_compile, "FUSED", {**fused.OPTIONS, **counting(count)})
    fast = GraphDecoder(model, max_len=256, fuse=True)
    assert isinstance(model.model.layers[0].self_attn.k_proj, FusedPart)
    fast.warm_up()
    assert fast.graph.compiled and len(count.seen) >= 2 and set(count.seen) == {(mms - 3 * LAYERS, columns)}  # (every width)
    eager = GraphDecoder(reference, max_len=256, compile=False)
    recall = kv_recall(reference)
    s = GenerationSettings(max_new_tokens=24, sequence_bias=(((RECALL,), 4.0),))
    want = eager.generate(prompt(2), s, recall=recall, keep_logits=True)
    got = fast.generate(prompt(2), s, recall=recall, keep_logits=True)
    assert got.tokens == want.tokens and want.recalls
    assert [(r.position, r.memory_index) for r in got.recalls] == [(r.position, r.memory_index) for r in want.recalls]
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=1e-4)


def test_a_compile_of_joined_modules_without_the_pass_runs_each_modules_own_rows():
    """Another compile of the same modules (the loop's compiled step, `model.compile`) has no pass to merge the
    group's products: it runs each module's own rows, not the group's whole product once a module (three times the
    columns of q/k/v)."""
    model, reference = tiny_llama(seed=3), tiny_llama(seed=3)
    fuse_projections(model)
    assert unfused(model) == unfused(reference)
    with torch.no_grad():
        torch.testing.assert_close(model(prompt(1)).logits, reference(prompt(1)).logits, atol=0, rtol=0)


def test_the_pass_keeps_one_of_a_groups_products_as_reductions():
    """With `model.graph_matvec: triton` inductor decomposes a one-row product (in bf16) into casts, a broadcast
    multiply and a sum (`torch._inductor.decomposition.mm`, on CUDA only): the pass keeps one of a group's three, as
    it keeps one of three matmuls; a product of other inputs stays."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    def product(x, w):  # what the decomposition writes for mm(x [1, K], w [K, N]) in bf16
        return (x.unsqueeze(2).float() * w.unsqueeze(0).float()).sum(dim=1).to(torch.bfloat16)

    def group(x, w, other):
        whole = [product(x, w)[..., a:b] for a, b in ((0, 4), (4, 6), (6, 8))]
        return *whole, product(x, other)

    x, w, other = (torch.randn(s, dtype=torch.bfloat16) for s in ((1, 16), (16, 8), (16, 8)))
    gm = make_fx(group, decomposition_table=select_decomp_table())(x, w, other)
    count = lambda: sum(n.target is torch.ops.aten.mul.Tensor for n in gm.graph.nodes)  # noqa: E731
    assert count() == 4
    fused.SameProducts()(gm.graph)
    gm.recompile()
    assert count() == 2  # (the group's one and the other product's)
    torch.testing.assert_close(gm(x, w, other), group(x, w, other))


def test_the_pass_keeps_apart_products_by_scalars_of_other_types():
    """x * 2 and x * 2.0 (int64 and float32), x + True and x + 1 on a bool tensor: the same op on "equal" scalars of
    other types is not one node."""
    torch._dynamo.reset()
    pairs = torch.compile(lambda x, b: (x * 2, x * 2.0, b + True, b + 1, x * -0.0, x * 0.0), options=fused.OPTIONS)
    x, b = torch.arange(-2, 2), torch.tensor([True, False])
    for got, want in zip(pairs(x, b), (x * 2, x * 2.0, b + True, b + 1, x * -0.0, x * 0.0)):
        assert got.dtype == want.dtype and torch.equal(got, want) and str(got) == str(want)

"""The recall model as a GGUF for llama.cpp (models/gguf_export.py): llama.cpp on the exported file gives
transformers' logits (F32: the same numbers; Q8_0: close), its vocabulary has the recall tokens, the file
is written once into the cache, and unsupported types and architectures are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import embedded, gguf_export
from models.gguf_export import export_gguf, recall_gguf

PROMPTS = [  # the second ends on <recall>, the third has it mid-prompt
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is my sister's name?<|im_end|>\n<|im_start|>assistant\n<recall>",
    "<|im_start|>user\nWhat is my sister's name?<|im_end|>\n<|im_start|>assistant\n<recall>Your sister is called "
    "Anna.</recall> Your sister's name is",
]


@pytest.fixture(scope="module")
def cache(smollm2_dir):
    """The cache the app uses: each recall GGUF is written there once a machine (and once a test run on CI),
    shared with every test that runs the default backend."""
    return embedded.cache_root()


def _llama_logits(path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's logits [T, V] at every position of `ids`, evaluated in one batch."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, n_threads=2, n_threads_batch=2, verbose=False)
    llm.eval(ids)
    return torch.tensor(np.array(llm.scores[:len(ids)]), dtype=torch.float64)


def _cases(smollm2):
    model = smollm2.merged()  # the PEFT model with its adapter merged: the merged fp32 model's logits
    for prompt in PROMPTS:
        ids = smollm2.tokenizer(prompt, add_special_tokens=False).input_ids
        with torch.no_grad():
            yield ids, model(torch.tensor([ids])).logits[0].double()


def _compared(smollm2, path):
    """(ids, transformers' logits, llama.cpp's logits) of each prompt; the last position's argmax agrees."""
    for ids, ref in _cases(smollm2):
        got = _llama_logits(path, ids)
        assert got[-1].argmax() == ref[-1].argmax()
        yield ids, ref, got


def _kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean KL(transformers || llama.cpp) over the positions."""
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


@pytest.mark.slow
def test_f32_export_gives_transformers_logits_with_the_recall_tokens(smollm2, cache, monkeypatch):
    import llama_cpp

    path = recall_gguf("f32")
    assert path.parent.parent == cache / "models" and path.name == "model-f32.gguf"
    assert (path.parent / "tokenizer.json").is_file()
    llm = llama_cpp.Llama(str(path), n_ctx=64, verbose=False)
    assert llm.n_vocab() == len(smollm2.tokenizer) == 49155
    assert llm.tokenize(b"<recall></recall><|memory_pad|>", add_bos=False, special=True) == [49152, 49153, 49154]
    cases = list(_cases(smollm2))
    assert [smollm2.tokens.recall in ids for ids, _ in cases] == [False, True, True]
    for ids, ref in cases:
        got = _llama_logits(path, ids)
        last, want = got[-1], ref[-1]
        assert (last - want).abs().max() < 0.1  # measured 0.027 (AVX2), 0.031 (AVX): bench/llamacpp_bounds.py
        assert np.corrcoef(last, want)[0, 1] > 0.9999
        assert last.argmax() == want.argmax()
    monkeypatch.setattr(gguf_export, "export_gguf", lambda *a, **k: pytest.fail("written twice"))
    assert recall_gguf("f32") == path  # reused


@pytest.mark.slow
def test_q8_0_export_is_close_to_transformers(smollm2, cache):
    path = recall_gguf("q8_0")
    kls = []
    for ids, ref, got in _compared(smollm2, path):
        kls.append(_kl(ref, got))
        top2 = ref.topk(2, -1).values
        clear = top2[:, 0] - top2[:, 1] > 2  # wherever transformers' choice is clear, llama.cpp makes it too
        assert (got.argmax(-1) == ref.argmax(-1))[clear].all()
    assert np.mean(kls) < 0.02  # measured 0.0035 (AVX2), 0.0036 (AVX) on these prompts


def test_an_unsupported_type_or_architecture_is_refused(tiny_llama, tiny_qwen3vl, tmp_path):
    source = embedded.embedded_gguf()
    with pytest.raises(ValueError, match="'q5_k' is not supported; expected one of f32, f16, q8_0, q4_0, q4_1"):
        export_gguf(tiny_llama.model, tiny_llama.tokenizer, source, tmp_path / "x.gguf", "q5_k")
    with pytest.raises(ValueError, match="'q5_k' is not supported"):
        recall_gguf("q5_k")
    with pytest.raises(ValueError, match="'qwen3_vl' model to GGUF: only the llama architecture is supported"):
        export_gguf(tiny_qwen3vl.model, tiny_qwen3vl.tokenizer, source, tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="block_count 2 but SmolLM2-135M-Instruct.Q4_1.gguf says 30"):
        export_gguf(tiny_llama.model, tiny_llama.tokenizer, source, tmp_path / "x.gguf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_base_model_exported_at_q4_1_is_the_shipped_gguf_byte_for_byte(smollm2_dir, tmp_path):
    """The export's names, q/k permutation, types and quantization are llama.cpp's own: the embedded model
    (converted from the shipped Q4_1 GGUF) written back at q4_1 gives every tensor of that file exactly."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    out = export_gguf(model, AutoTokenizer.from_pretrained(smollm2_dir), embedded.embedded_gguf(),
                      tmp_path / "base.gguf", "q4_1")
    shipped = {t.name: t for t in GGUFReader(embedded.embedded_gguf()).tensors}
    written = {t.name: t for t in GGUFReader(out).tensors}
    assert written.keys() == shipped.keys() and len(written) == 272
    for name, t in written.items():
        assert t.tensor_type == shipped[name].tensor_type, name
        assert np.array_equal(np.asarray(t.data), np.asarray(shipped[name].data)), name


@pytest.mark.slow
def test_the_4_bit_recall_gguf_keeps_the_adapters_weights_at_q8_0_and_stays_close(smollm2, cache):
    """q4_1: the weights the adapter trained (q/k/v/o) and the tied embedding at Q8_0, the rest at Q4_1 (where
    the base model's weights re-quantize exactly): as close to transformers as Q8_0 (4-bit rounding of the
    trained weights alone cost a KL of ~0.3 nats a token)."""
    from gguf import GGMLQuantizationType as Q, GGUFReader

    path = recall_gguf("q4_1")
    types = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    assert {types[f"blk.7.{n}.weight"] for n in ("attn_q", "attn_k", "attn_v", "attn_output")} == {Q.Q8_0}
    assert {types[f"blk.7.{n}.weight"] for n in ("ffn_gate", "ffn_up", "ffn_down")} == {Q.Q4_1}
    assert types["token_embd.weight"] == Q.Q8_0
    kls = []
    for ids, ref, got in _compared(smollm2, path):
        kls.append(_kl(ref, got))
    assert np.mean(kls) < 0.02  # measured 0.0031 (AVX2), 0.0022 (AVX)

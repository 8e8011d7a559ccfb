"""Any decoder-only model: parity with `model.generate` and exact replay of injections, on tiny random
configs of Llama, Qwen2, Qwen3, Gemma-2 (soft-capped logits, sliding window), Gemma-3, Phi-3, GPT-2 and gpt-oss
(a mixture of experts with attention sinks: seed 002's target)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers import AutoTokenizer

from decoding.request import Controls
from decoding import GenerationSettings, Recall, RecallSettings, generate
from decoding.processors import to_generation_config
from memory import MemoryVectorDB
from models import embedded_model_dir, ensure_special_tokens

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
FAMILIES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 16}),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, {"head_dim": 16, "final_logit_softcapping": 5.0,
                                                       "attn_logit_softcapping": 20.0, "sliding_window": 8,
                                                       "query_pre_attn_scalar": 16}),
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, {"head_dim": 16, "sliding_window": 8,
                                                           "query_pre_attn_scalar": 16}),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {}),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel, None),
    "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM, {"head_dim": 16, "num_local_experts": 4,
                                                         "num_experts_per_tok": 2, "sliding_window": 8}),
}
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(embedded_model_dir())


def tiny(family: str, tokenizer, seed: int = 0):
    config_cls, model_cls, extra = FAMILIES[family]
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    if extra is None:  # GPT-2 names things its own way
        config = config_cls(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=512, **ids)
    else:
        config = config_cls(vocab_size=len(tokenizer), **COMMON, **extra, **ids)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    tokens = ensure_special_tokens(model, tok)
    return model, tok, tokens


def bank(model, n: int = 8) -> MemoryVectorDB:
    h = model.get_input_embeddings().weight
    db = MemoryVectorDB(h.shape[1])
    db.add(torch.randn(n, h.shape[1], generator=torch.Generator().manual_seed(1)) * h.std() * 3,
           [f"fact {i}" for i in range(n)])
    return db


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("settings", [GenerationSettings(max_new_tokens=16, repetition_penalty=1.2),
                                      GenerationSettings(do_sample=True, top_k=30, top_p=0.9, max_new_tokens=16)],
                         ids=["greedy", "sample"])
def test_parity_with_generate(family, settings, tokenizer):
    model, tok, _ = tiny(family, tokenizer)
    inputs = tok([CHAT.format("Tell me about the sea and the sky.")], return_tensors="pt")
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(7)
    expected = model.generate(**inputs, generation_config=to_generation_config(settings, **ids))
    torch.manual_seed(7)
    got = generate(model, inputs, settings, tokenizer=tok, controls=Controls(output_logits=True))
    assert got.sequences.tolist() == expected.tolist()
    with torch.no_grad():  # the loop's logits are the model's own, final processing included
        full = model(input_ids=got.sequences).logits.float()
    p = got.prompt_length
    torch.testing.assert_close(got.logits[0], full[0, p - 1:p - 1 + got.logits.shape[1]], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replay_of_injected_memories(family, tokenizer):
    model, tok, tokens = tiny(family, tokenizer)
    inputs = tok([CHAT.format("What do you remember?")], return_tensors="pt")
    db = bank(model)
    s = GenerationSettings(do_sample=True, max_new_tokens=20, seed=3, sequence_bias=(((tokens.recall,), 8.0),))
    result = generate(
        model,
        inputs,
        s,
        recall=Recall(tokens.recall, tokens.memory_pad, db, RecallSettings(top_k=3, use_sampling=True)),
        controls=Controls(output_logits=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
    )
    assert len(result.injections) >= 2
    emb = model.get_input_embeddings()(result.sequences).clone()
    for pos, vec in result.memory_vectors[0].items():
        emb[0, pos] = vec
    with torch.no_grad():
        full = model(inputs_embeds=emb).logits.float()
    p = result.prompt_length
    torch.testing.assert_close(result.logits[0], full[0, p - 1:p - 1 + result.logits.shape[1]], atol=1e-4, rtol=1e-4)


def test_soft_capping_is_applied_like_the_model_does(tokenizer):
    """Gemma 2's final logits are 5 * tanh(raw / 5): with the head scaled so raw logits reach far past 5, the loop's
    logits are the capped ones (deleting the cap in the loop fails this: its logits would be the raw ones)."""
    model, tok, _ = tiny("gemma2", tokenizer)
    with torch.no_grad():
        model.lm_head.weight.mul_(200)  # (tied to the input embedding: both runs below read the same model)
    inputs = tok([CHAT.format("Hi")], return_tensors="pt")
    result = generate(model, inputs, GenerationSettings(max_new_tokens=2), controls=Controls(output_logits=True))
    with torch.no_grad():
        raw = model.lm_head(model.model(**inputs).last_hidden_state[:, -1]).float()[0]
    assert float(raw.abs().max()) > 20  # the uncapped logits go far past the cap
    torch.testing.assert_close(result.logits[0, 0], 5.0 * torch.tanh(raw / 5.0), atol=1e-4, rtol=1e-4)

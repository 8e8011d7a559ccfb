"""A short training run on a tiny model: the loss goes down, and the adapter it writes loads back."""

from __future__ import annotations

import csv

import pytest
import torch

from memory import BankCheck, MemoryVectorDB
from memory.validate import BankError
from models import MemoryEncoder, LoadOptions, load_model
from models.encoder import ValueKind
from models.text_keys import TextEncoder
from training.train import Recipe, train

TINY = dict(steps=80, facts_per_batch=6, chats_per_batch=2, repeats_per_batch=1, chat_prompts=6, reply_tokens=4,
            lr=3e-2, warmup=5, lora_r=8, lora_alpha=16, projector_inner=32, eval_every=40, eval_facts=8)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, smollm2_dir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-base")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,  # as SmolLM2
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    lm = load_model(folder, LoadOptions(adapter=None, device="cpu"))
    out = tmp_path_factory.mktemp("adapter")
    model, encoder = train(lm, Recipe(**TINY), out, keys=TextEncoder(adapter=None))
    return folder, out, model, encoder, lm


def test_training_lowers_the_loss_and_logs_it(trained):
    _, out, *_ = trained
    rows = list(csv.DictReader(open(out / "training_log.csv")))
    before, steps = rows[0], rows[1:]  # step 0: the held-out measures before any update
    assert before["step"] == "0" and before["loss"] == "" and before["eval_p_recall_fact"] != ""
    assert len(steps) == TINY["steps"] and steps[-1]["step"] == str(TINY["steps"])
    mean = lambda key, part: sum(float(r[key]) for r in part) / len(part)  # noqa: E731
    # Per-batch losses swing by 3x from step to step, so the bounds leave room measured over 1 and 2
    # threads and recipe seeds 0 and 1 (this recipe): last/first ten steps' total loss 0.74-0.81 (bound 0.9);
    # held-out p(<recall>) after fact questions 0.0000 before training in all four, 0.074-0.29 after
    # (bounds 0.01 and 0.02; the tiny random model says <recall> after ordinary prompts too, which only
    # the real model learns apart: README, "The recall model").
    assert mean("loss", steps[-10:]) < 0.9 * mean("loss", steps[:10])
    assert float(before["eval_p_recall_fact"]) < 0.01
    assert float(steps[-1]["eval_p_recall_fact"]) > 0.02  # it learned to say <recall> (held-out questions)
    # (a random tiny model cannot learn its 49k-token answers in 80 steps; SmolLM2's run is in the README)
    assert steps[39]["eval_tokens_exact"] != "" and steps[38]["eval_tokens_exact"] == ""


def test_the_adapter_loads_back_with_its_encoder(trained, tmp_path):
    folder, out, model, encoder, lm = trained
    assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors",
                                               "memory_encoder.json", "memory_projector.safetensors",
                                               "training_log.csv", "recipe.json"}
    loaded = load_model(folder, LoadOptions(adapter=out, device="cpu", keys=None))
    assert loaded.recall_trained and str(loaded.encoder.values) == "tokens" and loaded.encoder.close == "</recall>"
    assert loaded.encoder.base_name.startswith(encoder.base_name + "@") and loaded.encoder.placement == "answer"
    ids = torch.tensor([[1, 2, 3, lm.tokens.recall, lm.tokens.memory_pad]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids=ids).logits, model(input_ids=ids).logits)
        texts = ["Mira keeps the lighthouse.", "The ferry leaves at seven."]
        (k1, v1), (k2, v2) = (e.encode(m, lm.tokenizer, texts, progress=False)
                              for e, m in ((loaded.encoder, loaded.model), (encoder, model)))
        torch.testing.assert_close(k1, k2)
        for a, b in zip(v1, v2):
            torch.testing.assert_close(a, b)
        vec = torch.randn(2, loaded.hidden_size)
        for kind in (ValueKind("mean"), ValueKind("chunks", 2)):  # the projector came back
            torch.testing.assert_close(loaded.encoder.embedding(vec, kind), encoder.embedding(vec, kind))
        assert torch.equal(loaded.encoder.embedding(vec, ValueKind("tokens")), vec)  # tokens are input embeddings


def test_a_bank_from_another_encoder_is_refused(trained, tmp_path):
    folder, out, *_ = trained
    loaded = load_model(folder, LoadOptions(adapter=out, device="cpu", keys=None))
    from models import build_bank

    db = build_bank(loaded.model, loaded.tokenizer, ["a fact"], loaded.encoder, progress=False)
    db.save(tmp_path / "mine.pt")
    assert len(MemoryVectorDB.load(tmp_path / "mine.pt", check=BankCheck(encoder=loaded.encoder.name))) == 1
    plain = load_model(folder, LoadOptions(adapter=None, device="cpu", keys=None))
    with pytest.raises(BankError, match="written by .*rebuild it from its texts"):
        MemoryVectorDB.load(tmp_path / "mine.pt", check=BankCheck(encoder=plain.encoder.name))
    other = build_bank(plain.model, plain.tokenizer, ["a fact"], plain.encoder, progress=False)
    other.save(tmp_path / "plain.pt")
    with pytest.raises(BankError, match=f"expected memories written by this model's encoder '{loaded.encoder.name}'"):
        MemoryVectorDB.load(tmp_path / "plain.pt", check=BankCheck(encoder=loaded.encoder.name))
    assert isinstance(plain.encoder, MemoryEncoder) and not plain.recall_trained and plain.encoder.placement == "user"

"""Training the EAGLE draft head (training/draft.py): the mixture's feature f* reproduces q* through
the shared lm_head, training fits the head, and the prompts stay apart from the held-out ones."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_llama
from decoding.draft_head import DraftHead, head_config
from decoding.mixture import mixture_log_probs
from models.modeling import backbone_and_head
from models.loading import base_copy
from training.draft import DraftRecipe, draft_prompts, evaluate, features, train
from training.facts import chat_prompts


@pytest.fixture(scope="module")
def pair(smollm2_dir):
    """θ = a tiny Llama with a LoRA adapter on attention only (so θ and its base share the lm_head)."""
    from peft import LoraConfig, get_peft_model
    lm = make_tiny_llama(smollm2_dir, seed=2)
    model = get_peft_model(lm.model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).eval()
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)
    with torch.no_grad():  # sharper than the random init: distributions with something to learn
        model.get_output_embeddings().weight.mul_(40)
    model.merge_adapter()
    return model, base_copy(model)


@pytest.fixture(scope="module")
def data(pair):
    torch.manual_seed(1)
    return features(*pair, [torch.randint(0, 2000, (n,)).tolist() for n in (30, 41, 25, 37, 33, 28)])


def test_the_mixture_feature_reads_as_q_star(pair, data):
    """log_softmax(lm_head f*) is log q* at α*, up to f*'s bfloat16 storage; θ's own feature is not."""
    theta, base = pair
    (tb, head), (bb, _) = backbone_and_head(theta), backbone_and_head(base)
    row = data[0]
    with torch.no_grad():
        lp, lr = head(tb(input_ids=row["ids"][None]).last_hidden_state[0]), head(bb(input_ids=row["ids"][None]).last_hidden_state[0])
        log_q, alpha = mixture_log_probs(lp, lr)
        from_f = torch.log_softmax(head(row["f"].float()), -1)
        from_h = torch.log_softmax(head(row["h"].float()), -1)
    kl = lambda a, b: float((a.exp() * (a - b)).sum(-1).mean())  # noqa: E731
    assert torch.allclose(alpha.float(), row["alpha"], atol=1e-3)
    assert kl(log_q, from_f) < 1e-3 and 10 * kl(log_q, from_f) < kl(log_q, from_h)


def test_training_fits_the_head(pair, data):
    theta, _ = pair
    embed, (_, lm_head) = theta.get_input_embeddings(), backbone_and_head(theta)
    for p in theta.parameters():
        p.requires_grad_(False)
    torch.manual_seed(0)
    head = DraftHead(head_config(theta.config))
    before = evaluate(head, data, embed, lm_head)
    recipe = DraftRecipe(steps=60, batch=4, lr=3e-3, noise=0.0, kl_positions=64, w_kl=1.0, seed=0)
    history = train(head, data, embed, lm_head, recipe, log=lambda *_: None)
    after = evaluate(head, data, embed, lm_head)
    first, last = history[0], history[-1]
    # measured over 1 and 2 threads and seeds 0-2: reg last/first 0.430-0.434, kl 10.4 -> 2.9-3.1,
    # acceptance 0.012-0.014 -> 0.191-0.196
    assert last["reg"] < 0.6 * first["reg"] and last["kl"] < 0.5 * first["kl"]
    assert after["acceptance_t1"] > before["acceptance_t1"] + 0.08
    assert not head.training and len(history) == 60


def test_draft_prompts_never_use_the_held_out_ones_or_the_benchmarks():
    train_prompts = set(draft_prompts(1900))
    assert len(train_prompts) == 1900 and not train_prompts & set(chat_prompts(200, "eval", 0))
    for subject in ("lighthouse", "photosynthesis", "hiking"):  # bench/mixture.py's prompts
        assert not any(subject in p.lower() for p in train_prompts)

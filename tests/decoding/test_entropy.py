"""Entropy-based intermediate-layer decoding (seed 002): the pure functions on exact tensors, an
independent oracle (one full forward with `output_hidden_states=True`, final norm + head per layer,
the processors and the entropy written out here) at every step on Llama, Qwen3-VL with an image, a
left-padded batch, Gemma-2 (soft-capping) and GPT-2; `random_after`'s distribution; recall, stops,
the seed API, and mode off = `model.generate`; the records' unit (seed 002's: H / log2 V) and the
page's plot of it.

The models are tiny random ones with 4 layers, wide weights (initializer_range=1) and random
final-norm weights, so each layer's distribution differs clearly (the oracle's choice is never a
near-tie) and a double norm of the last layer would show.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers as tf
import yaml
from scipy.stats import chisquare
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

from chat.config import load_config
from chat.service import Service
from chat.view import ENTROPY_UNIT, answer_figure
from decoding.request import Controls
from decoding import DoneEvent, GenerationSettings, Recall, TokenEvent, generate, stream_generate
from decoding.entropy import (
    layer_logits, masked_entropy, normalised_bits, random_after_layers, select_layers, trough_layers,
)
from decoding.events import FinishEvent, LayerEvent
from test_loop import kv_bank_for, recall_of
from decoding.seed_api import custom_generate
from decoding.processors import to_generation_config
from memory import MemoryVectorDB
from models.vision import IMAGE_PAD, encode_with_images

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
LAYERS = 4
PENALTY = 1.3
SUPPRESSED = tuple(range(1000, 3000))  # masked (-inf): they must count 0 in the entropy


def ids_of(lm):
    return dict(eos_token_id=lm.tokenizer.eos_token_id, pad_token_id=lm.tokenizer.pad_token_id)


def randomise_norms(model: torch.nn.Module) -> None:
    """Norm weights away from their identity init, so norm(norm(x)) != norm(x)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or ".ln_" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def deeper(lm, layers: int = LAYERS, init: float = 1.0, seed: int = 0):
    """The same kind of tiny model as `lm` (tokenizer and special tokens too), with more, wider layers."""
    config = copy.deepcopy(lm.model.config)
    text = config.get_text_config(decoder=True)
    text.num_hidden_layers, text.initializer_range = layers, init
    torch.manual_seed(seed)
    model = type(lm.model)(config).eval()
    randomise_norms(model)
    return dataclasses.replace(lm, model=model)


@pytest.fixture(scope="module")
def llama(tiny_llama):
    return deeper(tiny_llama)


@pytest.fixture(scope="module")
def qwen3vl(tiny_qwen3vl):
    return deeper(tiny_qwen3vl)


def vl_inputs(lm, image, text="What is in the picture?"):
    prompt = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
        tokenize=False, add_generation_prompt=True)
    return encode_with_images(lm.tokenizer, lm.image_processor, prompt, [image])


def entropy_settings(mode="trough", **kw):
    base = dict(max_new_tokens=10, repetition_penalty=PENALTY, suppress_tokens=SUPPRESSED, entropy_decoding=mode,
                entropy_record_tokens=True)
    return GenerationSettings(**{**base, **kw})


# --------------------------------------------------------------------------- the oracle


def final_norm_of(model):
    """Written per family here, not through models.modeling."""
    if isinstance(model, tf.GPT2LMHeadModel):
        return model.transformer.ln_f
    if isinstance(model, tf.Qwen3VLForConditionalGeneration):
        return model.model.language_model.norm
    return model.model.norm


def oracle_logits(model, **forward_kwargs) -> torch.Tensor:
    """Raw logits [B, T, L, V] of every decoder layer at every position, from ONE full forward (causal: the
    sequence so far for every step). Layers < L-1: final norm, head, soft-cap; layer L-1: the model's own logits."""
    with torch.no_grad():
        out = model(**forward_kwargs, output_hidden_states=True)
        states = out.hidden_states[1:]  # the embedding output is not a layer
        assert len(states) == LAYERS
        cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
        layers = []
        for h in states[:-1]:
            logits = model.lm_head(final_norm_of(model)(h)).float()
            layers.append(torch.tanh(logits / cap) * cap if cap else logits)
        layers.append(out.logits.float())
    return torch.stack(layers, dim=2)


def penalise_and_suppress(seen: torch.Tensor, raw: torch.Tensor, bias: dict[int, float] | None = None) -> torch.Tensor:
    """The processors of `entropy_settings` over raw logits [L, V], in generate's order: sequence bias, the
    repetition penalty on the ids seen, then the suppressed tokens at -inf (float64)."""
    s = raw.double().clone()
    for token, b in (bias or {}).items():
        s[:, token] += b
    ids = torch.unique(seen)
    vals = s[:, ids]
    s[:, ids] = torch.where(vals < 0, vals * PENALTY, vals / PENALTY)
    s[:, list(SUPPRESSED)] = -math.inf
    return s


def entropy_nats(scores: torch.Tensor) -> float:
    """H = log Z - E[z] over the finite scores of one row (masked tokens simply absent)."""
    z = scores[torch.isfinite(scores)].double()
    log_z = torch.logsumexp(z, 0)
    return float(log_z - (torch.exp(z - log_z) * z).sum())


def check_oracle(result, logits, row=0, first=0, bias=None, forced=(), mode="trough", suffix=0):
    """At every generated step of `row`: per-layer raw argmax, entropies, the layer and the token.

    `first` is the row's first real token (left padding is outside the repetition penalty); at `forced`
    tokens (<|memory_pad|>) the token is the recall's, not the layer's. A step that injected a memory wrote
    its slots and `suffix` forced tokens: the next step reads the position after them.
    """
    p, trace, seq = result.prompt_length, result.entropy, result.sequences[row]
    steps = trace.selected_layer_indices.shape[1]
    widths = {r.position: r.length + suffix for r in result.injections if r.row == row}
    positions = [p]
    for _ in range(steps - 1):
        positions.append(positions[-1] + widths.get(positions[-1], 1))
    assert steps > 0 and positions[-1] + widths.get(positions[-1], 1) == seq.shape[0]
    assert trace.selected_token_ids is None or trace.selected_token_ids[row].tolist() == seq[positions].tolist()
    for t, at in enumerate(positions):
        raw = logits[row, at - 1]  # [L, V]
        scores = penalise_and_suppress(seq[first:at], raw, bias)
        entropies = torch.tensor([entropy_nats(s) for s in scores], dtype=torch.float64)
        trough = int(torch.argmin(entropies))
        layer = int(trace.selected_layer_indices[row, t])
        assert trace.per_layer_token_ids[row, t].tolist() == raw.argmax(-1).tolist(), f"step {t}"
        normalised = entropies / math.log(raw.shape[-1])  # seed 002's unit: bits over log2 V
        torch.testing.assert_close(trace.normalised_entropies[row, t].double(), normalised, atol=2e-4, rtol=1e-4)
        if mode == "trough":
            assert layer == trough, f"step {t}: chose {layer}, entropies {entropies.tolist()}"
        else:
            assert trough <= layer < LAYERS
        if int(seq[at]) not in forced:
            assert int(seq[at]) == int(scores[layer].argmax()), f"step {t}: not the layer's greedy token"


# --------------------------------------------------------------------------- pure functions


def test_masked_entropy_on_exact_tensors():
    inf = math.inf
    scores = torch.tensor([[0.0, 0.0, -inf, -inf], [0.0, -inf, -inf, -inf], [1.0, 1.0, 1.0, 1.0],
                           [math.log(0.5), math.log(0.25), math.log(0.25), -inf], [1000.0, 0.0, -inf, -inf]])
    expected = torch.tensor([math.log(2), 0.0, math.log(4), 1.5 * math.log(2), 0.0])
    got = masked_entropy(scores)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert masked_entropy(scores.view(1, 5, 4)).shape == (1, 5)  # [B, L, V] -> [B, L]


def test_normalised_bits_are_the_seeds_unit_on_known_distributions():
    """Seed 002 normalises entropy by the vocabulary, in bits: H / log2 V. Over V = 8 (log2 V = 3 bits): uniform
    1, one-hot 0, uniform over 2 tokens 1 bit / 3, (1/2, 1/4, 1/4) 1.5 bits / 3."""
    inf = math.inf
    scores = torch.tensor([[0.0] * 8, [5.0] + [-inf] * 7, [0.0, 0.0] + [-inf] * 6,
                           [math.log(0.5), math.log(0.25), math.log(0.25)] + [-inf] * 5])
    got = normalised_bits(masked_entropy(scores), 8)
    torch.testing.assert_close(got, torch.tensor([1.0, 0.0, 1 / 3, 0.5]), atol=1e-6, rtol=0)


def test_trough_takes_the_deepest_layer_on_ties_and_never_nan():
    """(A hostile probe: with top_k=1 every layer's distribution is one-hot, all entropies 0, and the first layer
    decoded "\n\n\n...": on ties the deepest, the model's own last layer.)"""
    entropies = torch.tensor([[1.0, 0.5, 0.5, 2.0], [3.0, 3.0, 3.0, 3.0], [math.nan, 1.0, 1.0, 2.0],
                              [0.1, 0.2, 0.3, 0.0], [0.0, 1.0, 2.0, math.nan]])
    assert trough_layers(entropies).tolist() == [2, 3, 2, 3, 0]
    assert select_layers(entropies, "trough").tolist() == [2, 3, 2, 3, 0]
    with pytest.raises(ValueError, match="'valley'.*'trough', 'random_after'"):
        select_layers(entropies, "valley")


def test_layer_logits_norm_every_layer_but_the_last_in_one_head_product(llama):
    model = llama.model
    states = torch.randn(2, LAYERS, llama.hidden_size)  # [B, L, H]
    calls = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    try:
        got = layer_logits(model, model.lm_head, model.model.norm, states)  # [B, L, V]
    finally:
        hook.remove()
    assert calls == [(2 * LAYERS, llama.hidden_size)]  # ONE matrix product for all layers and rows
    with torch.no_grad():
        for i in range(LAYERS):
            h = states[:, i] if i == LAYERS - 1 else model.model.norm(states[:, i])
            torch.testing.assert_close(got[:, i], model.lm_head(h).float(), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got[:, -1], model.lm_head(model.model.norm(states[:, -1])), atol=1e-3)


# --------------------------------------------------------------------------- random_after


def test_random_after_is_uniform_from_the_trough_to_the_last_layer():
    layers, n = 6, 3000
    troughs = [0, 2, 5]
    entropies = torch.rand(len(troughs) * n, layers) + 1.0
    for k, trough in enumerate(troughs):
        entropies[k * n:(k + 1) * n, trough] = 0.5
    torch.manual_seed(0)
    chosen = select_layers(entropies, "random_after")
    for k, trough in enumerate(troughs):
        group = chosen[k * n:(k + 1) * n]
        assert int(group.min()) >= trough and int(group.max()) <= layers - 1
        counts = torch.bincount(group, minlength=layers)[trough:].tolist()
        if len(counts) > 1:
            expected = [n / len(counts)] * len(counts)
            assert chisquare(counts, expected).pvalue > 0.001, (trough, counts)
    # seeded draws repeat; another seed draws differently
    trough = trough_layers(entropies)
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    assert torch.equal(random_after_layers(trough, layers, g(1)), random_after_layers(trough, layers, g(1)))
    assert not torch.equal(random_after_layers(trough, layers, g(1)), random_after_layers(trough, layers, g(2)))


def test_random_after_in_the_loop_is_seeded_and_never_above_the_last_layer(llama):
    inputs = llama.tokenizer([CHAT.format("Tell me about the sea.")], return_tensors="pt")
    runs = [generate(llama.model, inputs, entropy_settings("random_after", max_new_tokens=16, seed=s))
            for s in (3, 3, 4)]
    a, b, c = (r.entropy.selected_layer_indices for r in runs)
    assert torch.equal(a, b) and runs[0].sequences.tolist() == runs[1].sequences.tolist()
    assert not torch.equal(a, c)
    trough = trough_layers(runs[0].entropy.normalised_entropies[0])  # [steps]
    assert torch.all(a[0] >= trough) and torch.all(a[0] <= LAYERS - 1)
    assert torch.any(a[0] > trough)  # really random after the trough, not the trough itself


# --------------------------------------------------------------------------- the oracle, per family


def test_oracle_tiny_llama(llama):
    inputs = llama.tokenizer([CHAT.format("Tell me about the sea and the sky.")], return_tensors="pt")
    result = generate(llama.model, inputs, entropy_settings(max_new_tokens=14))
    check_oracle(result, oracle_logits(llama.model, input_ids=result.sequences))
    layers = result.entropy.selected_layer_indices[0]
    assert len(set(layers.tolist())) > 1  # the choice moves between layers
    plain = generate(llama.model, inputs, dataclasses.replace(entropy_settings(), entropy_decoding=None))
    assert plain.new_tokens[0, :10].tolist() != result.new_tokens[0, :10].tolist()


def test_oracle_tiny_qwen3vl_with_image(qwen3vl, small_image):
    lm = qwen3vl
    inputs = vl_inputs(lm, small_image)
    result = generate(lm.model, inputs, entropy_settings(max_new_tokens=12))
    seq = result.sequences
    types = (seq == lm.tokenizer.convert_tokens_to_ids(IMAGE_PAD)).int()
    rope, _ = lm.model.model.get_rope_index(seq, mm_token_type_ids=types, image_grid_thw=inputs["image_grid_thw"])
    text = torch.arange(seq.shape[1])[None, None]
    logits = oracle_logits(lm.model, input_ids=seq, pixel_values=inputs["pixel_values"],
                           image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=types,
                           position_ids=torch.cat([text, rope], dim=0))
    check_oracle(result, logits)
    assert lm.model.model.rope_deltas is None


def test_oracle_left_padded_batch_rows_choose_independently(llama):
    tok = llama.tokenizer
    prompts = [CHAT.format("Hi"), CHAT.format("Tell me a long story about the quick brown fox, please.")]
    inputs = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    assert inputs["attention_mask"][0, 0] == 0  # really padded
    s = entropy_settings(max_new_tokens=10)
    batch = generate(llama.model, inputs, s)
    new = batch.new_tokens.shape[1]
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, new, dtype=torch.long)], dim=1)
    logits = oracle_logits(llama.model, input_ids=batch.sequences, attention_mask=mask,
                           position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    for row in range(2):
        check_oracle(batch, logits, row=row, first=int((inputs["attention_mask"][row] == 0).sum()))
        single = generate(llama.model, tok([prompts[row]], return_tensors="pt"), s)
        assert batch.entropy.selected_layer_indices[row].tolist() == single.entropy.selected_layer_indices[0].tolist()
        assert batch.new_tokens[row].tolist() == single.new_tokens[0].tolist()
    layers = batch.entropy.selected_layer_indices
    assert torch.any(layers[0] != layers[1])  # the rows' choices are their own


FAMILIES = {
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM,
               dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, final_logit_softcapping=5.0, attn_logit_softcapping=20.0,
                    sliding_window=8, query_pre_attn_scalar=16, max_position_embeddings=512)),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel, dict(n_embd=64, n_layer=LAYERS, n_head=4, n_positions=512)),
    # seed 002's own target: a mixture of experts with sliding-window layers and attention sinks
    "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM,
                dict(hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                     max_position_embeddings=512)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_oracle_gemma2_softcapped_gpt2_and_gpt_oss(family, smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    config_cls, model_cls, kw = FAMILIES[family]
    config = config_cls(vocab_size=len(tok), initializer_range=1.0, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    randomise_norms(model)
    inputs = tok([CHAT.format("Tell me about the sea and the sky.")], return_tensors="pt")
    result = generate(
        model,
        inputs,
        entropy_settings(max_new_tokens=10),
        controls=Controls(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
    )
    logits = oracle_logits(model, input_ids=result.sequences)
    if family == "gemma2":
        assert float(logits.abs().max()) <= 5.0  # every layer soft-capped
    check_oracle(result, logits)


# --------------------------------------------------------------------------- processors, CFG, settings


class Spy(LogitsProcessor):
    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, scores):
        self.calls.append((input_ids.clone(), tuple(scores.shape)))
        return scores


def test_processors_see_each_step_once_on_rows_repeated_per_layer(llama):
    inputs = llama.tokenizer(["Hello there, how", "The quick brown fox jumps over the"], return_tensors="pt",
                             padding=True, padding_side="left")
    spy = Spy()
    result = generate(
        llama.model,
        inputs,
        GenerationSettings(max_new_tokens=5, entropy_decoding="trough"),
        controls=Controls(logits_processor=LogitsProcessorList([spy])),
    )
    assert len(spy.calls) == result.steps == 5
    vocab = llama.model.config.vocab_size
    for t, (ids, shape) in enumerate(spy.calls):
        assert shape == (2 * LAYERS, vocab)
        expected = result.sequences[:, :result.prompt_length + t].repeat_interleave(LAYERS, dim=0)
        assert torch.equal(ids, expected)


def test_classifier_free_guidance_and_unknown_modes_are_refused(llama):
    with pytest.raises(ValueError, match="entropy_decoding is 'trough' with guidance_scale=1.5.*classifier-free"):
        GenerationSettings(guidance_scale=1.5, entropy_decoding="trough")
    with pytest.raises(ValueError, match="entropy_decoding is 'valley': must be None .* 'trough', 'random_after'"):
        GenerationSettings(entropy_decoding="valley")
    cfg = LogitsProcessorList([UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, llama.model)])
    inputs = llama.tokenizer(["Hello"], return_tensors="pt")
    with pytest.raises(ValueError, match="classifier-free guidance"):
        generate(
            llama.model,
            inputs,
            GenerationSettings(max_new_tokens=2, entropy_decoding="trough"),
            controls=Controls(logits_processor=cfg),
        )


def test_config_keys_reach_the_settings(tmp_path):
    file = tmp_path / "config.yaml"
    file.write_text("generation:\n  entropy_decoding: trough\n  entropy_record_tokens: true\n")
    assert load_config(file).generation.entropy_decoding == "trough"
    config = load_config(file, overrides=["generation.entropy_decoding=random_after"])
    assert (config.generation.entropy_decoding, config.generation.entropy_record_tokens) == ("random_after", True)
    with pytest.raises(ValueError, match="entropy_decoding is 'valley'"):
        load_config(file, overrides=["generation.entropy_decoding=valley"])
    shipped = yaml.safe_load((Path(__file__).parents[2] / "config_qwen3vl.yaml").read_text())["generation"]
    assert shipped["entropy_decoding"] is None and shipped["entropy_record_tokens"] is False
    assert GenerationSettings(**shipped).entropy_decoding is None


# --------------------------------------------------------------------------- mode off


@pytest.mark.parametrize("which", ["fixture", "deeper"])
def test_mode_off_is_plain_decoding(which, tiny_llama, llama):
    lm = tiny_llama if which == "fixture" else llama
    inputs = lm.tokenizer([CHAT.format("Tell me about the sea.")], return_tensors="pt")
    s = GenerationSettings(max_new_tokens=12, repetition_penalty=1.2, entropy_record_tokens=True)  # record alone: off
    expected = lm.model.generate(**inputs, generation_config=to_generation_config(s, **ids_of(lm)))
    events = list(stream_generate(lm.model, inputs, s, tokenizer=lm.tokenizer))
    result = events[-1].result
    assert result.sequences.tolist() == expected.tolist()
    assert result.entropy is None and not any(isinstance(e, LayerEvent) for e in events)


# --------------------------------------------------------------------------- recall and stops


def bank_for(lm, n=10):
    g = torch.Generator().manual_seed(0)
    db = MemoryVectorDB(lm.hidden_size)
    db.add(torch.randn(n, lm.hidden_size, generator=g) * 3, texts=[f"fact {i}" for i in range(n)])
    return db


def assert_layer_events_follow_tokens(events, trace):
    """A LayerEvent right after the token of each step (the rest of a memory's span has none), in step order."""
    layers = [i for i, e in enumerate(events) if isinstance(e, LayerEvent)]
    rows, count = trace.selected_layer_indices.shape
    assert layers and (rows > 1 or len(layers) == count)
    steps: dict[int, int] = {}
    for i in layers:
        token, layer = events[i - 1], events[i]
        assert isinstance(token, TokenEvent) and (layer.row, layer.position) == (token.row, token.position)
        step = steps[layer.row] = steps.get(layer.row, -1) + 1
        assert layer.layer == int(trace.selected_layer_indices[token.row, step])
        assert list(layer.layer_token_ids) == trace.per_layer_token_ids[token.row, step].tolist()
        assert len(layer.normalised_entropies) == LAYERS
        expected = trace.normalised_entropies[token.row, step]
        torch.testing.assert_close(torch.tensor(layer.normalised_entropies), expected)


@pytest.mark.parametrize("bank", [bank_for, kv_bank_for], ids=["one-slot", "k-slot"])
def test_recall_uses_the_final_layer_query_and_forces_memory_pad(llama, bank):
    lm = llama
    db = bank(lm)
    bias = 40.0  # recalls a few times, with the model's own tokens between
    s = entropy_settings(max_new_tokens=24, sequence_bias=(((lm.tokens.recall,), bias),))
    inputs = lm.tokenizer([CHAT.format("What do you remember?")], return_tensors="pt")
    recall = recall_of(lm, db)
    events = list(stream_generate(lm.model, inputs, s, recall=recall, tokenizer=lm.tokenizer))
    result = events[-1].result
    seq, p = result.sequences, result.prompt_length
    assert len(result.injections) >= 2 and (seq[0, p:] != lm.tokens.recall).sum() > len(result.injections)
    emb = lm.model.get_input_embeddings()(seq).clone()
    for pos, vec in result.memory_vectors[0].items():
        emb[0, pos] = vec
    with torch.no_grad():
        final = lm.model(inputs_embeds=emb, output_hidden_states=True).hidden_states[-1][0]  # [T, H]
    keys = torch.stack([db.vector(i) for i in range(len(db))])
    for r in result.injections:
        assert seq[0, r.position] == lm.tokens.memory_pad and seq[0, r.position - 1] == lm.tokens.recall
        query = final[r.position - 1] if recall.query is None else recall.query(final[r.position - 1])
        assert r.memory_index == int(torch.cosine_similarity(query[None], keys).argmax())  # the FINAL layer's state
    check_oracle(result, oracle_logits(lm.model, inputs_embeds=emb), bias={lm.tokens.recall: bias},
                 forced={lm.tokens.memory_pad, lm.tokens.recall_end}, suffix=len(recall.suffix))
    assert_layer_events_follow_tokens(events, result.entropy)


def test_stop_within_one_step_with_image(qwen3vl, small_image):
    lm = qwen3vl
    inputs = vl_inputs(lm, small_image)
    stop = threading.Event()
    events, after_stop = [], 0
    for event in stream_generate(
        lm.model, inputs, entropy_settings(max_new_tokens=30), tokenizer=lm.tokenizer, interrupt=stop
    ):
        events.append(event)
        if isinstance(event, TokenEvent):
            after_stop += stop.is_set()
            if event.position - inputs["input_ids"].shape[1] == 4:
                stop.set()
    result = events[-1].result
    assert after_stop == 0 and result.finish_reasons == ["interrupted"] and result.steps == 5
    assert result.entropy.selected_layer_indices.shape == (1, 5)
    assert result.entropy.normalised_entropies.shape == (1, 5, LAYERS)
    assert result.entropy.per_layer_token_ids.shape == (1, 5, 4)
    assert_layer_events_follow_tokens(events[:-2], result.entropy)
    assert isinstance(events[-2], FinishEvent) and isinstance(events[-1], DoneEvent)


class StopAfter(StoppingCriteria):
    """Sets the interrupt once the sequences reach `length` tokens (never stops by itself)."""

    def __init__(self, length: int, event: threading.Event):
        self.length, self.event = length, event

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] >= self.length:
            self.event.set()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def test_stop_right_after_recall_keeps_the_trace_aligned(llama):
    lm = llama
    s = entropy_settings(max_new_tokens=30, sequence_bias=(((lm.tokens.recall,), 1e4),))  # recalls at once
    inputs = lm.tokenizer([CHAT.format("Go")], return_tensors="pt")
    p, stop = inputs["input_ids"].shape[1], threading.Event()
    events = list(
        stream_generate(
            lm.model,
            inputs,
            s,
            recall=Recall(lm.tokens.recall, lm.tokens.memory_pad, bank_for(lm)),
            interrupt=stop,
            controls=Controls(stopping_criteria=StoppingCriteriaList([StopAfter(p + 3, stop)])),
        )
    )
    result = events[-1].result  # <recall> <|memory_pad|> <recall>: the stop lands on the second, unanswered one
    assert result.finish_reasons == ["interrupted"] and result.steps == 3
    assert result.new_tokens[0].tolist() == [lm.tokens.recall, lm.tokens.memory_pad]
    assert result.entropy.selected_layer_indices.shape == (1, 2)
    assert torch.equal(result.entropy.selected_token_ids, result.new_tokens)
    assert_layer_events_follow_tokens(events[:-2], result.entropy)
    assert not any(isinstance(e, (TokenEvent, LayerEvent)) and e.position == p + 2 for e in events)


def test_stop_during_prefill_gives_an_empty_trace(llama):
    stop = threading.Event()
    inputs = llama.tokenizer([CHAT.format("A long prompt " * 10)], return_tensors="pt")
    events = []
    for e in stream_generate(
        llama.model, inputs, entropy_settings(), interrupt=stop, controls=Controls(prefill_chunk=8)
    ):
        events.append(e)
        stop.set()
    trace = events[-1].result.entropy
    assert trace.selected_layer_indices.shape == (1, 0) and trace.normalised_entropies.shape == (1, 0, LAYERS)
    assert trace.num_layers == LAYERS and trace.mode == "trough"


# --------------------------------------------------------------------------- seed API


def seed_args(lm, n: int, config: dict | None = None) -> tuple:
    """custom_generate's positional arguments (seed 000's signature): greedy, `n` new tokens after "Hello"."""
    prompt = lm.tokenizer([CHAT.format("Hello")], return_tensors="pt")
    return (lm.model, lm.tokenizer, None, lm.tokens.as_dict(), config or {}, prompt, n, None, None, 1.0, 0, 1.0,
            False, lm.tokenizer.pad_token_id, lm.tokenizer.eos_token_id, None, False)


def test_custom_generate_returns_the_seed_fields(llama):
    n = 6
    args = seed_args(llama, n)
    p = args[5]["input_ids"].shape[1]
    out = custom_generate(*args, entropy_decoding="trough", entropy_record_tokens=True, return_dict_in_generate=True)
    assert out.sequences.shape == (1, p + n)
    assert len(out.entropy_selected_layer_indices) == len(out.entropy_per_layer_token_ids) == n
    assert len(out.entropy_selected_token_ids) == n
    for t in range(n):
        layer = out.entropy_selected_layer_indices[t]
        assert layer.shape == (1,) and layer.dtype == torch.long and 0 <= int(layer) < LAYERS
        assert out.entropy_per_layer_token_ids[t].shape == (1, LAYERS)
        assert out.entropy_selected_token_ids[t].shape == (1,)
        assert int(out.entropy_selected_token_ids[t]) == int(out.sequences[0, p + t])
        entropies = out.normalised_entropies[t]  # [B, L] in the seed's unit, H / log2 V
        assert entropies.shape == (1, LAYERS) and 0 < float(entropies.min()) and float(entropies.max()) <= 1
        assert int(entropies.argmin()) == int(layer)  # trough: the least entropy, in the recorded unit too
    plain = custom_generate(*args, entropy_decoding="trough")  # the seed's old return value
    assert isinstance(plain, torch.Tensor) and plain.tolist() == out.sequences.tolist()
    sparse = custom_generate(*args, entropy_decoding="random_after", return_dict_in_generate=True)
    assert len(sparse.entropy_selected_layer_indices) == n
    assert sparse.entropy_per_layer_token_ids is None and sparse.entropy_selected_token_ids is None
    off = custom_generate(*args, return_dict_in_generate=True)
    assert off.entropy_selected_layer_indices is None and off.recall_positions is None
    assert off.normalised_entropies is None
    assert off.sequences.tolist() == custom_generate(*args).tolist()


@pytest.mark.parametrize("field, value", [("num_beams", 4), ("num_beam_groups", 2), ("diversity_penalty", 0.5)])
def test_custom_generate_refuses_beam_search_by_name(llama, field, value):
    """Seed 004's HammingDiversityLogitsProcessor needs diverse group beam search, which a streaming recall loop
    does not offer: asked for as a keyword or in `config["generation"]`, it is refused with the setting, the value
    and why (never silently decoded without beams)."""
    why = rf"^{field} is {value}: must be .*beam search is not offered in a streaming recall chat: .*recall"
    with pytest.raises(ValueError, match=why):
        custom_generate(*seed_args(llama, 2), **{field: value})
    with pytest.raises(ValueError, match=why):
        custom_generate(*seed_args(llama, 2, {"generation": {field: value}}))
    off = {"num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0}
    assert custom_generate(*seed_args(llama, 2, {"generation": off}), **off).shape[1] > 2  # off is accepted


# --------------------------------------------------------------------------- the page's plot


def test_the_pages_plot_draws_the_records_in_the_seeds_unit_and_says_so(llama):
    """The picture the page shows after an entropy answer (`chat.service` keeps it, `answer_figure` draws it): the
    trace's normalised entropies as they are, the colour bar labelled with their unit."""
    inputs = llama.tokenizer([CHAT.format("Tell me about the sea.")], return_tensors="pt")
    result = generate(llama.model, inputs, entropy_settings(max_new_tokens=5, entropy_record_tokens=False))
    session = SimpleNamespace(conv=SimpleNamespace(lm=llama), last_plot=None, last_note="", last_speed=0.0)
    list(Service._noted(session, iter([DoneEvent(result)])))
    heat, colorbar = answer_figure(session.last_plot).axes
    assert colorbar.get_ylabel() == ENTROPY_UNIT and "H / log2 V" in ENTROPY_UNIT
    values = result.entropy.normalised_entropies[0]  # [steps, L]
    assert torch.equal(torch.as_tensor(heat.images[0].get_array()).float(), values.T)
    assert 0 < float(values.min()) and float(values.max()) <= 1
    assert not heat.texts  # (nothing recorded: no token in the cells)


def test_the_pages_plot_writes_each_layers_recorded_token_in_its_cell(llama):
    """With `entropy_record_tokens` (seed 002's record of every layer's own argmax), the picture writes each layer's
    token in its cell: the record reached only Python callers before."""
    inputs = llama.tokenizer([CHAT.format("Tell me about the sea.")], return_tensors="pt")
    result = generate(llama.model, inputs, entropy_settings(max_new_tokens=4, entropy_record_tokens=True))
    session = SimpleNamespace(conv=SimpleNamespace(lm=llama), last_plot=None, last_note="", last_speed=0.0)
    list(Service._noted(session, iter([DoneEvent(result)])))
    heat, _ = answer_figure(session.last_plot).axes
    ids = result.entropy.per_layer_token_ids[0]  # [steps, L]
    assert len(heat.texts) == ids.numel() and "each cell its layer's own next token" in heat.get_title()
    cell = {(t.get_position()): t.get_text() for t in heat.texts}
    step, layer = 2, LAYERS - 1
    assert cell[(step, layer)] == repr(llama.tokenizer.decode([int(ids[step, layer])]))[1:-1][:6]

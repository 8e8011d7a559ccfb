"""Proof that the recall loop is exact: parity with `model.generate`, replay of injections,
the memory head's distribution, batch rows, interrupts, stops (the length limit at a recall, a tool
call), seed 001's debug log, and multi-turn KV-cache reuse."""

from __future__ import annotations

import math
import re
import threading

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import LogitsProcessorList

from conftest import make_tiny_llama
from models.vision import IMAGE_PAD, encode_with_images
from decoding.request import Controls, Prompt
from decoding import (
    DoneEvent, FinishEvent, GenerationSettings, MemorySelector, Recall, RecallEvent, RecallSettings, TokenEvent,
    generate, stream_generate,
)
from decoding.processors import to_generation_config
from memory import MemoryVectorDB
from tests_helpers import ForceTokens, step_positions

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

SETTINGS = [
    GenerationSettings(max_new_tokens=20),
    GenerationSettings(max_new_tokens=20, repetition_penalty=1.3, no_repeat_ngram_size=2),
    GenerationSettings(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=20),
    GenerationSettings(do_sample=True, min_p=0.05, typical_p=0.9, repetition_penalty=1.2, max_new_tokens=20),
    GenerationSettings(do_sample=True, epsilon_cutoff=3e-4, top_k=0, min_new_tokens=5, max_new_tokens=20),
]


def bank_for(lm, n: int = 12, seed: int = 0) -> MemoryVectorDB:
    """Memories that look like the model's own hidden states: final-layer states of short texts."""
    g = torch.Generator().manual_seed(seed)
    h = lm.hidden_size
    vectors = torch.randn(n, h, generator=g) * lm.model.get_input_embeddings().weight.std() * 3
    db = MemoryVectorDB(h)
    db.add(vectors, texts=[f"fact number {i}" for i in range(n)])
    return db


def recall_of(lm, db, settings=RecallSettings()):
    if db is not None and db.has_values:  # key/value memories: keys of their own space, `</recall>` after the slots
        return kv_recall_of(lm, db, settings)
    return Recall(lm.tokens.recall, lm.tokens.memory_pad, db, settings)


KEY_DIM = 24


def kv_bank_for(lm, n: int = 12, seed: int = 0, max_slots: int = 5) -> MemoryVectorDB:
    """Key/value memories: keys in a space of their own (as text embeddings are), 1..`max_slots` value
    vectors each, at the scale of the model's token embeddings."""
    g = torch.Generator().manual_seed(seed)
    h, scale = lm.hidden_size, lm.model.get_input_embeddings().weight.std() * 3
    db = MemoryVectorDB(KEY_DIM, value_dim=h)
    slots = torch.randint(1, max_slots + 1, (n,), generator=g).tolist()
    slots[0] = max_slots
    db.add(torch.randn(n, KEY_DIM, generator=g), [f"fact number {i}" for i in range(n)],
           values=[torch.randn(k, h, generator=g) * scale for k in slots])
    return db


def kv_recall_of(lm, db, settings=RecallSettings()):
    """A recall over a key/value bank: a fixed random projection of the <recall> state is the query."""
    proj = torch.randn(lm.hidden_size, KEY_DIM, generator=torch.Generator().manual_seed(7))
    return Recall(lm.tokens.recall, lm.tokens.memory_pad, db, settings,
                  query=lambda hidden: hidden.float().cpu() @ proj, suffix=(lm.tokens.recall_end,))


def query_state(lm, ids: list[int]) -> torch.Tensor:
    """The final hidden state [H] at the last of `ids`: the memory head's query when that token is `<recall>`."""
    with torch.no_grad():
        return lm.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]


def ids_of(lm):
    return dict(eos_token_id=lm.tokenizer.eos_token_id, pad_token_id=lm.tokenizer.pad_token_id)


def assert_parity(lm, inputs, settings):
    torch.manual_seed(1234)
    expected = lm.model.generate(**inputs, generation_config=to_generation_config(settings, **ids_of(lm)))
    torch.manual_seed(1234)
    got = generate(lm.model, inputs, settings, tokenizer=lm.tokenizer).sequences
    assert got.tolist() == expected.tolist()


def vl_inputs(lm, image, text="What is in the picture?"):
    prompt = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
        tokenize=False, add_generation_prompt=True)
    return encode_with_images(lm.tokenizer, lm.image_processor, prompt, [image])


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("settings", SETTINGS, ids=["greedy", "greedy-penalties", "sample", "sample-minp-typical",
                                                    "sample-epsilon-minnew"])
def test_parity_tiny_llama(tiny_llama, settings):
    inputs = tiny_llama.tokenizer([CHAT.format("Tell me about the sea.")], return_tensors="pt")
    assert_parity(tiny_llama, inputs, settings)


@pytest.mark.parametrize("settings", SETTINGS[:3], ids=["greedy", "greedy-penalties", "sample"])
def test_parity_tiny_qwen3vl_with_image(tiny_qwen3vl, small_image, settings):
    assert_parity(tiny_qwen3vl, vl_inputs(tiny_qwen3vl, small_image), settings)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [SETTINGS[1], SETTINGS[2]], ids=["greedy-penalties", "sample"])
def test_parity_smollm2(smollm2, settings):
    inputs = smollm2.tokenizer([CHAT.format("Write a short poem about rivers.")], return_tensors="pt")
    assert_parity(smollm2, inputs, settings)


def test_parity_left_padded_batch(tiny_llama):
    inputs = tiny_llama.tokenizer(["Hello there, how", "The quick brown fox jumps over the"],
                                  return_tensors="pt", padding=True, padding_side="left")
    assert inputs["attention_mask"][0, 0] == 0  # really padded
    assert_parity(tiny_llama, inputs, GenerationSettings(max_new_tokens=12))


def test_empty_bank_or_disabled_recall_leaves_generation_untouched(tiny_llama):
    lm = tiny_llama
    prompt = lm.tokenizer([CHAT.format("Remember?")], return_tensors="pt")
    ids = torch.cat([prompt["input_ids"], torch.tensor([[lm.tokens.recall]])], dim=1)  # ends with <recall>
    inputs = {"input_ids": ids}
    s = GenerationSettings(max_new_tokens=10)
    expected = lm.model.generate(**inputs, generation_config=to_generation_config(s, **ids_of(lm)))
    for db, recall in [(MemoryVectorDB(lm.hidden_size), RecallSettings()),
                       (bank_for(lm), RecallSettings(enabled=False))]:
        res = generate(lm.model, inputs, s, recall=recall_of(lm, db, recall))
        assert res.sequences.tolist() == expected.tolist() and res.injections == []


# --------------------------------------------------------------------------- replay


def run_with_recalls(lm, inputs, db, seed=0, steps=24):
    """Sample with a bias towards <recall> so the model recalls several times by itself."""
    s = GenerationSettings(do_sample=True, max_new_tokens=steps, seed=seed,
                           sequence_bias=(((lm.tokens.recall,), 6.0),))
    return generate(
        lm.model,
        inputs,
        s,
        recall=recall_of(lm, db, RecallSettings(top_k=4, use_sampling=True)),
        controls=Controls(output_logits=True),
    )


def replay_embeds(lm, result):
    seq = result.sequences
    emb = lm.model.get_input_embeddings()(seq).clone()  # [1, L, H]
    for pos, vec in result.memory_vectors[0].items():
        emb[0, pos] = vec
    return seq, emb


def check_replay(result, full_logits, suffix: int = 0):
    cached = result.logits[0]  # [steps, V]
    replayed = full_logits[0, step_positions(result, 0, suffix)].float()
    torch.testing.assert_close(cached, replayed, atol=1e-4, rtol=1e-4)


def check_slots(lm, result, db, suffix: tuple[int, ...] = ()) -> None:
    """Every injection's slots hold `<|memory_pad|>` with the memory's value vectors in order, after `<recall>`,
    followed by the suffix; no slot is left without its vector."""
    seq = result.sequences[0].tolist()
    for r in result.injections:
        assert seq[r.position - 1] == lm.tokens.recall and r.length == len(db.values(r.memory_index))
        assert seq[r.position:r.position + r.length] == [lm.tokens.memory_pad] * r.length
        assert seq[r.position + r.length:r.position + r.length + len(suffix)] == list(suffix)
        got = torch.stack([result.memory_vectors[0][r.position + i] for i in range(r.length)])
        torch.testing.assert_close(got, db.values(r.memory_index))
    assert sorted(result.memory_vectors[0]) == [i for i, t in enumerate(seq) if t == lm.tokens.memory_pad]


def test_replay_tiny_llama(tiny_llama):
    lm = tiny_llama
    db = bank_for(lm)
    inputs = lm.tokenizer([CHAT.format("What do you remember?")], return_tensors="pt")
    result = run_with_recalls(lm, inputs, db)
    assert len(result.injections) >= 2
    seq, emb = replay_embeds(lm, result)
    for r in result.injections:
        assert seq[0, r.position] == lm.tokens.memory_pad and seq[0, r.position - 1] == lm.tokens.recall
        torch.testing.assert_close(result.memory_vectors[0][r.position], db.vector(r.memory_index))
    with torch.no_grad():
        full = lm.model(inputs_embeds=emb).logits
    check_replay(result, full)


def test_replay_k_slot_memories_tiny_llama(tiny_llama):
    """Memories of 1..5 value slots and a `</recall>` after them: each recall forwards its slots at once, and a
    full forward over the final sequence with the stored vectors gives the loop's logits."""
    lm = tiny_llama
    db = kv_bank_for(lm)
    inputs = lm.tokenizer([CHAT.format("What do you remember?")], return_tensors="pt")
    result = run_with_recalls(lm, inputs, db, steps=40)
    assert len(result.injections) >= 2 and max(r.length for r in result.injections) > 1
    check_slots(lm, result, db, (lm.tokens.recall_end,))
    seq, emb = replay_embeds(lm, result)
    with torch.no_grad():
        full = lm.model(inputs_embeds=emb).logits
    check_replay(result, full, suffix=1)


def test_a_bank_of_token_ids_recalls_as_the_bank_of_their_embeddings(tiny_llama):
    """A `tokens` memory stores its token ids; the loop injects the model's own input embeddings of them: the
    same recalls, tokens and logits as a bank that stores those embeddings as vectors."""
    lm = tiny_llama
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(6, KEY_DIM, generator=g)
    ids = [torch.randint(0, 40_000, (k,), generator=g) for k in (3, 1, 4, 2, 5, 2)]
    tokens = MemoryVectorDB(KEY_DIM, token_values=True)
    tokens.add(keys, [f"fact {i}" for i in range(6)], values=ids)
    vectors = MemoryVectorDB(KEY_DIM, value_dim=lm.hidden_size)
    with torch.no_grad():
        vectors.add(keys, [f"fact {i}" for i in range(6)], values=[lm.model.get_input_embeddings()(i) for i in ids])
    inputs = lm.tokenizer([CHAT.format("What do you remember?")], return_tensors="pt")
    a, b = (run_with_recalls(lm, inputs, db, steps=30) for db in (tokens, vectors))
    assert len(a.injections) >= 2 and a.injections == b.injections and torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(a.logits, b.logits, atol=0, rtol=0)
    check_slots(lm, a, vectors, (lm.tokens.recall_end,))


def test_a_token_memory_is_looked_up_where_the_embedding_lives():
    """(A recall on a GPU looked its token ids up on the device, copied the embeddings to the host and back: a host
    sync between the head and the span.) The lookup stays on the embedding's device; a conversation keeps what it
    injected on the host (`chat.session.on_host`). A meta-device embedding stands for a GPU's: no copy out of it."""
    from chat.session import on_host
    from decoding.memory import Recall
    from memory.shape import Memory

    embed = torch.nn.Embedding(50, 8, device="meta")
    recall = Recall(1, 2).with_tokens(embed)
    memory = Memory(index=0, score=1.0, values=torch.tensor([3, 4, 5]), text="a fact")
    vectors = recall.values(memory)
    assert vectors.device.type == "meta" and vectors.shape == (3, 8) and vectors.dtype == torch.float32
    kept = on_host({7: torch.ones(8)})
    assert kept[7].device.type == "cpu" and torch.equal(kept[7], torch.ones(8))


def test_replay_tiny_qwen3vl_with_image(tiny_qwen3vl, small_image):
    lm = tiny_qwen3vl
    db = bank_for(lm)
    inputs = vl_inputs(lm, small_image)
    result = run_with_recalls(lm, inputs, db)
    assert len(result.injections) >= 2
    seq, emb = replay_embeds(lm, result)
    types = (seq == lm.tokenizer.convert_tokens_to_ids(IMAGE_PAD)).int()
    rope, _ = lm.model.model.get_rope_index(seq, mm_token_type_ids=types, image_grid_thw=inputs["image_grid_thw"])
    text = torch.arange(seq.shape[1])[None, None]
    with torch.no_grad():
        full = lm.model(inputs_embeds=emb, pixel_values=inputs["pixel_values"],
                        image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=types,
                        position_ids=torch.cat([text, rope], dim=0)).logits
    check_replay(result, full)


def test_prompt_ending_with_recall_fires_once_at_prefill(tiny_llama):
    lm = tiny_llama
    db = bank_for(lm)
    prompt = lm.tokenizer([CHAT.format("Recall something.")], return_tensors="pt")["input_ids"]
    ids = torch.cat([prompt, torch.tensor([[lm.tokens.recall]])], dim=1)
    res = generate(lm.model, {"input_ids": ids}, GenerationSettings(max_new_tokens=6), recall=recall_of(lm, db))
    assert res.sequences[0, ids.shape[1]] == lm.tokens.memory_pad
    assert [r.position for r in res.injections] == [ids.shape[1]]
    # greedy memory head: the most similar memory to the <recall> hidden state
    with torch.no_grad():
        query = lm.model(ids, output_hidden_states=True).hidden_states[-1][0, -1]
    best = max(range(len(db)), key=lambda i: float(torch.cosine_similarity(query, db.vector(i), dim=0)))
    assert res.injections[0].memory_index == best
    assert res.injections[0].text == f"fact number {best}"


# --------------------------------------------------------------------------- memory head


def test_memory_head_greedy_picks_highest_cosine():
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(50, 32)).astype(np.float32)
    db = MemoryVectorDB(32)
    db.add(vectors)
    selector = MemorySelector(db, RecallSettings(use_sampling=False, top_k=5))
    for _ in range(20):
        q = rng.normal(size=32).astype(np.float32)
        cos = vectors @ q / np.linalg.norm(vectors, axis=1) / np.linalg.norm(q)
        choice = selector.choose(torch.from_numpy(q))
        assert choice.index == int(np.argmax(cos))
        assert choice.score == pytest.approx(float(cos.max()), abs=1e-5)


def test_a_greedy_head_without_processors_asks_the_bank_for_the_best_alone(monkeypatch):
    """(GPU run 5: torch.topk's radix select was a third of the head's kernels over 100k keys.) Greedy with no memory
    processor and no debug log, the choice is the best memory whatever the warpers: the search asks for k = 1 (on a
    device one reduction, `memory.device._topk`), which ranks as the k-best search's first; sampling, a processor or
    the debug log ask for top_k."""
    from memory.device import _topk

    db = MemoryVectorDB(32)
    db.add(torch.randn(300, 32, generator=torch.Generator().manual_seed(0)))
    asked, topk = [], db.topk
    monkeypatch.setattr(db, "topk", lambda q, k=None: asked.append(k) or topk(q, k))
    q = torch.randn(32, generator=torch.Generator().manual_seed(1))
    for recall, processors, k in [(RecallSettings(use_sampling=False, top_k=5), None, 1),
                                  (RecallSettings(use_sampling=True, top_k=5), None, 5),
                                  (RecallSettings(use_sampling=False, top_k=5), lambda ids, s: s, 5),
                                  (RecallSettings(use_sampling=False, top_k=5, debug=True), None, 5)]:
        asked.clear()
        chosen = MemorySelector(db, recall, processors=processors).choose(q)
        assert asked == [k] and (recall.use_sampling or chosen.index == int(topk(q, 5)[1][0]))
    snap = db._snap
    keys, ids = torch.from_numpy(snap.normed), torch.from_numpy(snap.ids)
    for seed in range(5):
        q = torch.randn(32, generator=torch.Generator().manual_seed(seed))
        best, five = _topk(keys, ids, q, 1), _topk(keys, ids, q, 5)
        assert best[1].tolist() == five[1][:1].tolist() and best[0].shape == (1,)
        torch.testing.assert_close(best[0], five[0][:1])


def test_a_memory_processor_acts_on_the_memory_logits_before_the_warpers():
    """Seed 000's optional logits processor over the memory logits (`Recall.processors`): it sees the candidates'
    memory ids as a token processor sees token ids; one that bans memories already read makes the head read the
    next best memory each time, where without it the same query reads the same memory again."""
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(50, 32)).astype(np.float32)
    db = MemoryVectorDB(32)
    db.add(vectors)
    read: list[int] = []

    def once(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # [1, k] memory ids, [1, k] scores
        return scores.masked_fill(torch.isin(ids, torch.tensor(read, dtype=ids.dtype)), -math.inf)

    q = torch.from_numpy(rng.normal(size=32).astype(np.float32))
    plain = MemorySelector(db, RecallSettings(use_sampling=False, top_k=5))
    banning = MemorySelector.of(Recall(1, 2, db, RecallSettings(use_sampling=False, top_k=5), processors=once))
    order = [int(i) for i in db.topk(q, 5)[1]]
    for n in range(3):
        chosen = banning.choose(q)
        assert chosen.index == order[n] and plain.choose(q).index == order[0]
        read.append(chosen.index)


def reference_distribution(scores: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Temperature, then top-k, then top-p over all scores, written out independently of transformers."""
    logits = scores / temperature
    keep = np.zeros_like(logits, dtype=bool)
    keep[np.argsort(-logits)[:top_k]] = True
    probs = np.where(keep, np.exp(logits - logits.max()), 0.0)
    probs /= probs.sum()
    order = np.argsort(-probs)
    cumulative = np.cumsum(probs[order])
    cut = np.searchsorted(cumulative, top_p) + 1  # smallest prefix reaching top_p
    final = np.zeros_like(probs)
    final[order[:cut]] = probs[order[:cut]]
    return final / final.sum()


def test_memory_head_sampling_matches_warped_softmax():
    rng = np.random.default_rng(1)
    vectors = rng.normal(size=(40, 16)).astype(np.float32)
    db = MemoryVectorDB(16)
    db.add(vectors)
    q = rng.normal(size=16).astype(np.float32)
    cos = vectors @ q / np.linalg.norm(vectors, axis=1) / np.linalg.norm(q)
    recall = RecallSettings(use_sampling=True, temperature=0.1, top_k=6, top_p=0.9)
    expected = reference_distribution(cos, recall.temperature, recall.top_k, recall.top_p)
    assert 2 <= (expected > 0).sum() <= 6

    torch.manual_seed(0)
    selector = MemorySelector(db, recall)
    draws = 4000
    counts = np.bincount([selector.choose(torch.from_numpy(q)).index for _ in range(draws)], minlength=40)
    support = expected > 0
    assert counts[~support].sum() == 0
    stat = chisquare(counts[support], expected[support] * draws)
    assert stat.pvalue > 0.001, (counts[support], expected[support] * draws)


def test_wrong_dimension_bank_is_refused(tiny_llama):
    db = MemoryVectorDB(tiny_llama.hidden_size + 1)
    db.add(torch.randn(3, tiny_llama.hidden_size + 1))
    inputs = tiny_llama.tokenizer(["hi"], return_tensors="pt")
    with pytest.raises(ValueError, match=f"dimension {tiny_llama.hidden_size + 1}.*hidden size is {tiny_llama.hidden_size}"):
        generate(tiny_llama.model, inputs, GenerationSettings(max_new_tokens=2), recall=recall_of(tiny_llama, db))


# --------------------------------------------------------------------------- batch


@pytest.mark.parametrize("bank", [bank_for, kv_bank_for], ids=["one-slot", "k-slot"])
def test_batch_rows_recall_on_their_own_step_and_match_single_runs(tiny_llama, bank):
    """A padded batch: each row as it runs alone. With k-slot memories a row's span gives the other row masked
    columns: the rows' sequences differ from their single runs only by those columns, which count towards
    max_new_tokens like the row's own (so a row may end earlier than alone)."""
    lm = tiny_llama
    db = bank(lm)
    tok = lm.tokenizer
    a = tok(CHAT.format("First question, a long one about many things?"))["input_ids"] + [lm.tokens.recall]
    b = tok(CHAT.format("Second?"))["input_ids"]
    s = GenerationSettings(max_new_tokens=10, sequence_bias=(((lm.tokens.recall,), 2.0),))
    kwargs = dict(recall=recall_of(lm, db))
    singles = [generate(lm.model, {"input_ids": torch.tensor([x])}, s, **kwargs) for x in (a, b)]
    width = max(len(a), len(b))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in (a, b)])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in (a, b)])
    batch = generate(lm.model, {"input_ids": ids, "attention_mask": mask}, s, **kwargs)
    real = batch.attention_mask if batch.attention_mask is not None else torch.ones_like(batch.sequences)
    for row, single in enumerate(singles):
        kept = real[row, width:].bool()
        own = batch.new_tokens[row][kept].tolist()
        assert own == single.new_tokens[0].tolist()[:len(own)] and len(own) > 1
        columns = (width + kept.nonzero()[:, 0]).tolist()  # the row's own positions, in the batch's columns
        assert [(columns.index(r.position) + single.prompt_length, r.memory_index, r.length)
                for r in batch.injections if r.row == row] == \
               [(r.position, r.memory_index, r.length) for r in single.injections
                if r.position < single.prompt_length + len(own)]
    assert {r.row for r in batch.injections} == {0, 1} or len(singles[1].injections) == 0
    assert any(r.row == 0 and r.position == width for r in batch.injections)  # row 0 recalled at prefill
    assert bool(real[:, width:].all()) == (bank is bank_for)  # spans gave the other row masked columns


# --------------------------------------------------------------------------- interrupt and streaming


def test_interrupt_stops_within_one_step_and_model_stays_usable(tiny_qwen3vl, small_image):
    lm = tiny_qwen3vl
    inputs = vl_inputs(lm, small_image)
    s = GenerationSettings(max_new_tokens=40)
    stop = threading.Event()
    tokens_after_stop = 0
    result = None
    for event in stream_generate(lm.model, inputs, s, tokenizer=lm.tokenizer, interrupt=stop):
        if isinstance(event, TokenEvent):
            if stop.is_set():
                tokens_after_stop += 1
            elif event.position - inputs["input_ids"].shape[1] == 4:
                stop.set()
        if isinstance(event, DoneEvent):
            result = event.result
    assert tokens_after_stop == 0
    assert result.finish_reasons == ["interrupted"] and result.steps == 5
    assert lm.model.model.rope_deltas is None  # no stale per-request state left behind
    expected = lm.model.generate(**inputs, generation_config=to_generation_config(s, **ids_of(lm)))
    assert generate(lm.model, inputs, s).sequences.tolist() == expected.tolist()


def test_stream_events_text_and_finish(smollm2):
    lm = smollm2
    inputs = lm.tokenizer([CHAT.format("What is the capital of France?")], return_tensors="pt")
    events = list(stream_generate(lm.model, inputs, GenerationSettings(max_new_tokens=30), tokenizer=lm.tokenizer))
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    finish = [e for e in events if isinstance(e, FinishEvent)]
    assert isinstance(events[-1], DoneEvent)
    result = events[-1].result
    assert text == lm.tokenizer.decode(result.new_tokens[0], skip_special_tokens=True)
    assert "Paris" in text
    assert finish == [FinishEvent(0, "stop")] and result.finish_reasons == ["stop"]


def test_max_new_tokens_gives_length_and_stop_strings_stop(tiny_llama):
    inputs = tiny_llama.tokenizer([CHAT.format("Count.")], return_tensors="pt")
    res = generate(tiny_llama.model, inputs, GenerationSettings(max_new_tokens=5))
    assert res.finish_reasons == ["length"] and res.new_tokens.shape[1] == 5
    first = tiny_llama.tokenizer.decode(res.new_tokens[0, 2:4])
    res2 = generate(
        tiny_llama.model,
        inputs,
        GenerationSettings(max_new_tokens=5, stop_strings=(first,)),
        tokenizer=tiny_llama.tokenizer,
    )
    assert res2.finish_reasons == ["stop"] and res2.new_tokens.shape[1] == 4
    last = tiny_llama.tokenizer.decode(res.new_tokens[0, 3:5])  # (a stop string ending on the last token allowed:
    res3 = generate(tiny_llama.model, inputs, GenerationSettings(max_new_tokens=5, stop_strings=(last,)),  # "length")
                    tokenizer=tiny_llama.tokenizer)
    assert res3.finish_reasons == ["stop"] and res3.new_tokens.shape[1] == 5


def test_early_stop_on_tool_call(smollm2):
    lm = smollm2
    prompt = CHAT.format("Call the weather tool.") + "<tool_call>{\"name\": \"weather\"}"
    inputs = lm.tokenizer([prompt], return_tensors="pt")
    end = lm.tokenizer("</tool_call>", add_special_tokens=False)["input_ids"]  # "</", "tool", "_", "call", ">"
    bias = (((end[0],), 20.0),) + tuple((tuple(end[:i + 1]), 40.0) for i in range(1, len(end)))  # then the rest
    s = GenerationSettings(max_new_tokens=20, early_stop_on_tool_call=True, sequence_bias=bias)
    events = list(stream_generate(lm.model, inputs, s, tokenizer=lm.tokenizer))
    result = events[-1].result
    text = lm.tokenizer.decode(result.new_tokens[0])
    if "</tool_call>" in text:
        assert result.finish_reasons == ["tool_call"] and text.rstrip().endswith("</tool_call>")
    else:
        pytest.fail(f"the biased model did not write </tool_call>: {text!r}")


@pytest.fixture(scope="module")
def tool_lm(smollm2_dir):
    """A tiny Llama whose tokenizer has `<tool_call>` and `</tool_call>` as added special tokens, one token each."""
    lm = make_tiny_llama(smollm2_dir)
    lm.tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]},
                                    replace_extra_special_tokens=False)
    lm.model.resize_token_embeddings(len(lm.tokenizer))
    return lm


def test_a_tool_call_closed_by_a_special_token_stops_and_stays_out_of_the_text(tool_lm):
    lm = tool_lm
    end = lm.tokenizer.convert_tokens_to_ids("</tool_call>")
    inputs = lm.tokenizer([CHAT.format("Call the weather tool.") + '<tool_call>{"name": "weather"}'],
                          return_tensors="pt")
    force = ForceTokens(inputs["input_ids"].shape[1] + 2, [end])  # as the third new token
    s = GenerationSettings(max_new_tokens=8, early_stop_on_tool_call=True)
    events = list(stream_generate(lm.model, inputs, s, tokenizer=lm.tokenizer,
                                  controls=Controls(logits_processor=LogitsProcessorList([force]))))
    result = events[-1].result
    assert result.finish_reasons == ["tool_call"] and result.new_tokens[0].tolist()[2:] == [end]
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert text == lm.tokenizer.decode(result.new_tokens[0], skip_special_tokens=True) and "tool_call" not in text


# --------------------------------------------------------------------------- multi-turn


def test_cache_reuse_across_turns_equals_full_prefill(tiny_qwen3vl, small_image):
    """Turn 2 on turn 1's KV cache (with a recalled memory and a new image) gives the same logits
    as prefilling the whole conversation with every memory vector placed again."""
    lm = tiny_qwen3vl
    db = bank_for(lm)
    first = vl_inputs(lm, small_image)
    first["input_ids"] = torch.cat([first["input_ids"], torch.tensor([[lm.tokens.recall]])], dim=1)
    first["mm_token_type_ids"] = torch.cat([first["mm_token_type_ids"], torch.zeros(1, 1, dtype=torch.int32)], 1)
    kw = dict(recall=recall_of(lm, db))
    turn1 = generate(lm.model, first, GenerationSettings(max_new_tokens=6), **kw)
    assert len(turn1.injections) == 1

    second = vl_inputs(lm, small_image, "And this one?")
    ids = torch.cat([turn1.sequences, second["input_ids"]], dim=1)
    pad = lm.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    inputs = {"input_ids": ids, "mm_token_type_ids": (ids == pad).int(),
              "pixel_values": torch.cat([first["pixel_values"], second["pixel_values"]]),
              "image_grid_thw": torch.cat([first["image_grid_thw"], second["image_grid_thw"]])}
    s = GenerationSettings(max_new_tokens=8)
    cached = generate(
        lm.model,
        Prompt(inputs, cache=turn1.cache, memory_vectors=turn1.memory_vectors[0]),
        s,
        **kw,
        controls=Controls(output_logits=True),
    )
    fresh = generate(
        lm.model, Prompt(inputs, memory_vectors=turn1.memory_vectors[0]), s, **kw, controls=Controls(output_logits=True)
    )
    torch.testing.assert_close(cached.logits, fresh.logits, atol=1e-4, rtol=1e-4)
    assert cached.sequences.tolist() == fresh.sequences.tolist()
    # and the memory really matters: without it the logits differ
    without = generate(
        lm.model, inputs, s, **{**kw, "recall": recall_of(lm, None)}, controls=Controls(output_logits=True)
    )
    assert not torch.allclose(without.logits, fresh.logits, atol=1e-3)


# --------------------------------------------------------------------------- seed 001's debug log, stops at a recall


def test_debug_logs_what_seed_001_lists(tiny_llama, caplog):
    """Each item of seed 001's log of a recall (its section 7, in order), each looked for in the line of its step:
    the <recall> detected, the memory head's search and choice, the injection and the forward that read it."""
    lm = tiny_llama
    db = bank_for(lm)
    prompt = lm.tokenizer([CHAT.format("Hi")], return_tensors="pt")["input_ids"]
    ids = torch.cat([prompt, torch.tensor([[lm.tokens.recall]])], dim=1)
    n, h, vocab = ids.shape[1], lm.hidden_size, lm.model.get_output_embeddings().weight.shape[0]
    with caplog.at_level("INFO"):
        res = generate(lm.model, {"input_ids": ids}, GenerationSettings(max_new_tokens=3),
                       recall=recall_of(lm, db, RecallSettings(debug=True, use_sampling=True, top_k=3, top_p=0.9)))
    r = res.injections[0]
    _, found = db.topk(query_state(lm, ids[0].tolist()), 3)
    e = re.escape
    items = [  # (the line's tag, seed 001's item, what shows it)
        ("[recall]", "the <recall> token and its id", e(f"<recall> (id {lm.tokens.recall}) at position {n - 1}")),
        ("[recall]", "the query's shape", e(f"its hidden state ({h},) is the query")),
        ("[memory head]", "the search's top_k", e("top_k=3: ")),
        ("[memory head]", "the number of candidates", e(": 3 candidates")),
        ("[memory head]", "each candidate's similarity",
         e("[") + ", ".join(rf"\({int(i)}, -?\d\.\d+\)" for i in found)),
        ("[memory head]", "the candidates top-p keeps", r"\d kept after temperature=1, top_k=3, top_p=0\.9"),
        ("[memory head]", "sampling, the index chosen and its probability",
         rf"chose memory {r.memory_index} \(candidate \d, sampled \(p=0\.\d{{4}}\)\)"),
        ("[memory head]", "the chosen memory's similarity", e(f"similarity {r.score:.4f}")),
        ("[inject]", "the injected vector's shape", e(f"input embeddings ({r.length}, {h})")),
        ("[inject]", "its dtype", e(f"{h}) torch.float32 on")),
        ("[inject]", "its device", e("torch.float32 on cpu of")),
        ("[inject]", "the existing KV cache", e("on the existing KV cache")),
        ("[inject]", "the attention mask's growth", e(f"KV cache and attention {n} -> {n + 1} positions")),
        ("[inject]", "the logits' shape after the memory forward", e(f"logits after it (1, {vocab})")),
        ("[inject]", "the injection's position and similarity",
         e(f"(similarity {r.score:.4f}) fills the 1 <|memory_pad|> slots from position {r.position}")),
    ]
    lines = caplog.text.splitlines()
    assert [item for tag, item, shown in items if not any(tag in x and re.search(shown, x) for x in lines)] == []
    caplog.clear()
    with caplog.at_level("INFO"):
        generate(lm.model, {"input_ids": ids}, GenerationSettings(max_new_tokens=3), recall=recall_of(lm, db))
    assert "[recall]" not in caplog.text and "[inject]" not in caplog.text


def recall_at(lm, db, step: int, max_new_tokens: int) -> list:
    """The events of an answer made to write <recall> as its `step`-th new token (1: the first)."""
    inputs = lm.tokenizer([CHAT.format("Go")], return_tensors="pt")
    force = ForceTokens(inputs["input_ids"].shape[1] + step - 1, [lm.tokens.recall])
    return list(stream_generate(lm.model, inputs, GenerationSettings(max_new_tokens=max_new_tokens),
                                recall=recall_of(lm, db), tokenizer=lm.tokenizer,
                                controls=Controls(logits_processor=LogitsProcessorList([force]))))


def test_a_recall_drawn_at_the_length_limit_is_left_unanswered(tiny_llama):
    """<recall> as the last token max_new_tokens allows: the answer ends with it, "length"; no memory is read (no
    RecallEvent, no <|memory_pad|>, no vector), and the cache covers all but that last token, as always."""
    lm = tiny_llama
    events = recall_at(lm, bank_for(lm), 4, 4)
    result = events[-1].result
    assert result.finish_reasons == ["length"] and result.new_tokens[0].tolist()[-1] == lm.tokens.recall
    assert result.injections == [] and result.memory_vectors == [{}]
    assert lm.tokens.memory_pad not in result.sequences[0].tolist()
    assert [type(e) for e in events[-3:]] == [TokenEvent, FinishEvent, DoneEvent]  # <recall> streamed, then finish
    assert result.cache.get_seq_length() == result.sequences.shape[1] - 1


def test_a_recall_drawn_before_the_length_limit_reads_its_whole_memory(tiny_llama):
    """<recall> one token before the limit: its memory's whole span follows (k slots, `</recall>`), past
    max_new_tokens: a memory is never cut."""
    lm = tiny_llama
    db = kv_bank_for(lm)
    result = recall_at(lm, db, 3, 4)[-1].result
    (r,) = result.injections
    assert result.finish_reasons == ["length"] and result.new_tokens.shape[1] == 3 + r.length + 1
    check_slots(lm, result, db, (lm.tokens.recall_end,))


def test_stop_right_after_recall_drops_the_unanswered_recall_token(tiny_llama):
    lm = tiny_llama
    inputs = lm.tokenizer([CHAT.format("Go")], return_tensors="pt")
    s = GenerationSettings(max_new_tokens=30, sequence_bias=(((lm.tokens.recall,), 50.0),))  # recalls at once
    stop = threading.Event()
    events = []
    for e in stream_generate(lm.model, inputs, s, recall=recall_of(lm, bank_for(lm)), interrupt=stop):
        events.append(e)
        if isinstance(e, TokenEvent) and e.token_id == lm.tokens.memory_pad:
            stop.set()  # the next step writes <recall> again; the stop lands right after it
    result = events[-1].result
    assert result.finish_reasons == ["interrupted"]
    seq = result.sequences[0].tolist()
    assert seq[-1] == lm.tokens.memory_pad and seq[-2] == lm.tokens.recall  # whole recalls only
    streamed = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert streamed == seq[result.prompt_length:]  # the dropped <recall> was never streamed
    assert result.cache.get_seq_length() == len(seq) - 1


@pytest.mark.parametrize("stop_on", ["recall", "slot"])
def test_a_stop_in_the_middle_of_a_k_slot_recall_leaves_no_partial_memory(tiny_llama, stop_on):
    """A stop that arrives while a memory's span is being streamed (right at its RecallEvent, or at one of
    its slot tokens) ends the answer after the whole span: every slot has its vector, the suffix follows,
    and a next turn on the cache reads it all."""
    lm = tiny_llama
    db = kv_bank_for(lm)
    inputs = lm.tokenizer([CHAT.format("Go")], return_tensors="pt")
    s = GenerationSettings(max_new_tokens=30, sequence_bias=(((lm.tokens.recall,), 50.0),))
    stop, events = threading.Event(), []
    for e in stream_generate(lm.model, inputs, s, recall=recall_of(lm, db), interrupt=stop, tokenizer=lm.tokenizer):
        events.append(e)
        if stop_on == "recall" and isinstance(e, RecallEvent) or \
                stop_on == "slot" and isinstance(e, TokenEvent) and e.token_id == lm.tokens.memory_pad:
            stop.set()
    result = events[-1].result
    assert result.finish_reasons == ["interrupted"] and len(result.injections) == 1
    check_slots(lm, result, db, (lm.tokens.recall_end,))
    seq = result.sequences[0].tolist()
    assert seq[-1] == lm.tokens.recall_end  # the answer ends with the whole span
    streamed = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert streamed == seq[result.prompt_length:]
    # the next turn continues from the cache (which has not read the span yet) and places the vectors
    more = torch.tensor([seq + lm.tokenizer(CHAT.format("More"))["input_ids"]])
    nxt = generate(
        lm.model,
        Prompt({"input_ids": more}, cache=result.cache, memory_vectors=result.memory_vectors[0]),
        GenerationSettings(max_new_tokens=4),
        recall=recall_of(lm, db),
        controls=Controls(output_logits=True),
    )
    fresh = generate(
        lm.model,
        Prompt({"input_ids": more}, memory_vectors=result.memory_vectors[0]),
        GenerationSettings(max_new_tokens=4),
        recall=recall_of(lm, db),
        controls=Controls(output_logits=True),
    )
    assert nxt.sequences.tolist() == fresh.sequences.tolist()
    torch.testing.assert_close(nxt.logits, fresh.logits, atol=1e-4, rtol=1e-4)


def test_read_prompt_fills_the_cache_and_a_stop_between_chunks_leaves_none(tiny_llama):
    from decoding.engine import Engine, cache_length
    from decoding.request import Prompt

    ids = torch.arange(100, 130)[None]  # 30 tokens: 8 chunks of 4
    from tests_helpers import returned

    engine = Engine(tiny_llama, None, prefill_chunk=4)
    cache, events = returned(engine.read(Prompt({"input_ids": ids})))
    assert cache_length(cache) == 30 and [e.done for e in events] == [4, 8, 12, 16, 20, 24, 28]  # the chunks' events
    stop = threading.Event()
    stop.set()
    assert returned(engine.read(Prompt({"input_ids": ids}), stop)) == (None, [events[0]])  # stopped after one chunk


def test_guidance_feeds_its_unconditional_branch_a_memorys_whole_span(tiny_llama, monkeypatch):
    """Classifier-free guidance with memories of 1..5 slots: each step's unconditional branch has read every position
    the answer added (a memory's slots and `</recall>` too, as their tokens), so its logits equal a fresh forward of
    the unconditional input and the answer so far; transformers' own processor fed a span's last token only."""
    from decoding.processors import Guidance

    lm = tiny_llama
    calls = []
    unconditional = Guidance.get_unconditional_logits

    def spy(self, input_ids):
        logits = unconditional(self, input_ids)
        calls.append((input_ids.clone(), logits[0, -1].clone()))
        return logits

    monkeypatch.setattr(Guidance, "get_unconditional_logits", spy)
    inputs = lm.tokenizer([CHAT.format("What do you remember?")], return_tensors="pt")
    settings = GenerationSettings(max_new_tokens=24, guidance_scale=1.5, sequence_bias=(((lm.tokens.recall,), 6.0),))
    result = generate(lm.model, inputs, settings, recall=kv_recall_of(lm, kv_bank_for(lm)))
    assert max((r.length for r in result.injections), default=0) > 1 and len(calls) > 3
    prompt = inputs["input_ids"].shape[1]
    for ids, logits in calls[1:]:  # (the first call reads the prompt's last token: no negative prompt)
        with torch.no_grad():
            fresh = lm.model(ids[:, prompt - 1:]).logits[0, -1]
        torch.testing.assert_close(logits, fresh, atol=1e-4, rtol=1e-4)

"""The recall loop on llama.cpp (decoding/llamacpp.py): the real llama.cpp on the shipped model's GGUFs.

`recall_lm` is the embedded SmolLM2 with its recall adapter merged and written as a Q8_0 GGUF (once,
models/gguf_export.py); `smollm2` is the same model on transformers (fp32), the reference.
"""

from __future__ import annotations

import threading

import pytest
import torch

from chat import operations as ops
from chat.config import load_config
from chat.service import Service
from chat.session import Conversation
from chat.textsearch import TextSearch
from decoding.request import Controls, Prompt
from decoding import GenerationSettings, generate, stream_generate
from decoding.events import DoneEvent, FinishEvent, RecallEvent, TokenEvent
from decoding.backend import backend_for
from models.llamacpp import LlamaCppModel
from decoding.memory import Recall
from decoding.settings import RecallSettings
from memory import MemoryVectorDB
from models import LoadOptions, load_model
from tests_helpers import result

pytestmark = pytest.mark.slow
QUESTION = "Who keeps the lighthouse of Port Avel?"


@pytest.fixture(scope="module")
def recall_lm(default_lm):
    return default_lm


@pytest.fixture(scope="module")
def text_search():
    return TextSearch()


def config(*overrides: str):
    return load_config(overrides=["generation.max_new_tokens=24", "model.backend=llamacpp", *overrides], environ={})


def prompt(lm, text: str = QUESTION) -> torch.Tensor:
    return lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]


def example_bank(lm) -> MemoryVectorDB:
    from models import build_bank
    from pathlib import Path

    texts = [line for line in (Path(__file__).parents[2] / "assets" / "example_memories.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    return build_bank(lm.model, lm.tokenizer, texts, lm.encoder, progress=False)


def test_the_memory_heads_query_is_transformers_final_state(recall_lm, smollm2):
    """The final hidden state llama.cpp gives at the last position (the memory head's query of a bank keyed by
    hidden states) is transformers' `hidden_states[-1]` there, and so are the logits."""
    ids = prompt(recall_lm)
    assert ids.tolist() == prompt(smollm2).tolist()
    fwd = backend_for(recall_lm.model, want_state=True)
    cache = fwd.cache_for(None, ids.shape[1], True)
    state, logits = fwd.prefill(fwd.embed(ids), None, cache, None, {})
    with torch.no_grad():
        out = smollm2.model(input_ids=ids, output_hidden_states=True)
    ref, ref_logits = out.hidden_states[-1][0, -1], out.logits[0, -1]
    # llama.cpp builds with the machine's own kernels (bench/llamacpp_bounds.py): cosine 0.99923 (AVX2), 0.99908
    # (AVX, no FMA), 0.9988 (an AVX-512 machine); logits corr 0.99921 (AVX2), 0.99903 (AVX)
    assert torch.cosine_similarity(state[0], ref, dim=0) > 0.997
    assert torch.corrcoef(torch.stack([logits[0], ref_logits]))[0, 1] > 0.997
    assert int(logits.argmax()) == int(ref_logits.argmax())
    assert cache.get_seq_length() == ids.shape[1]


def test_a_bank_keyed_by_hidden_states_is_queried_with_llamacpps_recall_state(recall_lm, smollm2):
    """The seeds' memory head on llama.cpp: the `<recall>` position's final state (read from llama.cpp only
    for such a bank) picks the memory whose key is transformers' state there, among random keys."""
    ids = torch.cat([prompt(recall_lm), torch.tensor([[recall_lm.tokens.recall]])], dim=1)
    with torch.no_grad():
        state = smollm2.model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, -1]
    torch.manual_seed(0)
    keys = torch.randn(64, state.shape[0])
    keys[17] = state
    bank = MemoryVectorDB(state.shape[0])
    bank.add(keys, [f"memory {i}" for i in range(64)])
    recall = Recall(recall_lm.tokens.recall, recall_lm.tokens.memory_pad, bank, RecallSettings(top_k=1))
    out = generate(recall_lm.model, {"input_ids": ids}, GenerationSettings(max_new_tokens=3), recall=recall)
    event = out.injections[0]  # (the model may ask again within its 3 tokens: the first one's query is the point)
    # the score is the cosine of llama.cpp's <recall> state with transformers': 0.99809 (AVX2), 0.99803 (AVX)
    assert event.memory_index == 17 and event.score > 0.995 and event.position == ids.shape[1]


def test_first_minute_questions_recall_the_right_memory_and_answer_as_on_transformers(recall_lm, smollm2,
                                                                                        text_search):
    """The README's first minute on the llama.cpp backend: the model recalls by itself, the memory that answers
    the question, and reads the answer from it, as the transformers backend does."""
    answers = {}
    for lm in (recall_lm, smollm2):
        svc = Service(config(), lm, text_search=text_search)
        try:
            s = svc.new_session()
            assert result(svc.banks.build_example(s)) == 36
            for question, memory, value in [
                    (QUESTION, "Mira Castellan is the lighthouse keeper", "Mira Castellan"),
                    ("When does the ferry to Lune Island leave?", "The ferry to Lune Island leaves at seven", "seven")]:
                svc.run(ops.clear, s)
                turn = svc.chat(s, question, [], GenerationSettings(max_new_tokens=32), RecallSettings())
                result(turn.request)
                answer = s.conv.messages[-1]
                assert [r.text for r in answer.recalls][:1] and answer.recalls[0].text.startswith(memory), answer
                assert value in answer.text, answer.text
                answers.setdefault(question, []).append((answer.recalls[0].memory_index, answer.text))
        finally:
            svc.close()
    for question, (llama, torch_) in answers.items():
        assert llama[0] == torch_[0], question  # the same memory
        print(question, llama, torch_)


def test_an_injected_k_slot_memory_is_read_back_exactly(recall_lm):
    """Replay: the logits llama.cpp gave after injecting a memory's k value slots equal a fresh evaluation of
    the same tokens and vectors in one prefill."""
    bank = example_bank(recall_lm)
    conv = Conversation(recall_lm)
    recall = conv.recall(bank, RecallSettings(), QUESTION)
    inputs = {"input_ids": torch.cat([prompt(recall_lm), torch.tensor([[recall_lm.tokens.recall]])], dim=1)}
    out = generate(
        recall_lm.model,
        inputs,
        GenerationSettings(max_new_tokens=24, min_new_tokens=24, repetition_penalty=1.0),
        recall=recall,
        tokenizer=recall_lm.tokenizer,
        controls=Controls(output_logits=True),
    )
    (event,) = out.injections
    assert event.length > 4 and event.text.startswith("Mira Castellan")  # k slots: one a token of the memory
    seq = out.sequences
    assert seq.shape[1] > event.position + event.length + 4  # the last step is well after the memory
    again = generate(
        recall_lm.model,
        Prompt({"input_ids": seq[:, :-1]}, memory_vectors=out.memory_vectors),
        GenerationSettings(max_new_tokens=1),
        recall=recall,
        controls=Controls(output_logits=True),
    )
    step, fresh = out.logits[0, -1], again.logits[0, 0]
    assert int(step.argmax()) == int(fresh.argmax()) == int(seq[0, -1])
    # the same numbers on AVX2 (corr 1.0, max diff 0); AVX-only kernels give the k positions and the prefill
    # other sums: corr 0.99946, max diff 1.8 % of the largest logit (bench/llamacpp_bounds.py)
    assert torch.corrcoef(torch.stack([step, fresh]))[0, 1] > 0.998
    assert (step - fresh).abs().max() < 0.05 * step.abs().max()


def test_a_stop_ends_within_one_step_and_a_second_turn_reads_only_its_new_tokens(recall_lm):
    model: LlamaCppModel = recall_lm.model
    conv = Conversation(recall_lm)
    stop = threading.Event()
    tokens = 0
    for event in conv.stream("Tell me a long story about a ship.", settings=GenerationSettings(max_new_tokens=64),
                             recall=RecallSettings(enabled=False), interrupt_event=stop):
        if isinstance(event, TokenEvent):
            tokens += 1
            if tokens == 3:
                stop.set()
    assert tokens == 3 and conv.messages[-1].finish_reason == "interrupted"
    assert conv.cache.get_seq_length() == len(conv.ids) - 1  # the cache covers all but the newest token
    before, length = model.evaluated, len(conv.ids)
    for _ in conv.stream("And then?", settings=GenerationSettings(max_new_tokens=8),
                         recall=RecallSettings(enabled=False)):
        pass
    assert model.evaluated - before == len(conv.ids) - length  # the new message and answer only, not the first turn


def test_sessions_decoding_together_equal_their_solo_runs(recall_lm, text_search):
    """Four sessions (two recalling first from the example bank), two turns each, greedy: decoding together as
    sequences of llama.cpp batches gives every session what it gets alone; the batches did carry several."""
    def converse(together: bool):
        svc = Service(config(), recall_lm, text_search=text_search)
        try:
            sessions = [svc.new_session() for _ in range(4)]
            for s in sessions[::2]:
                result(svc.banks.build_example(s))
            for turn in range(2):
                chats = []
                for i, s in enumerate(sessions):
                    chats.append(svc.chat(s, f"Question {turn} of session {i}: who keeps the lighthouse?", [],
                                          GenerationSettings(max_new_tokens=32 + 2 * i, min_new_tokens=24),
                                          RecallSettings(),
                                          recall_first=i % 2 == 0))
                    if not together:
                        result(chats[-1].request)
                for c in chats:
                    result(c.request)
            return [(s.conv.ids, [r.memory_index for m in s.conv.messages for r in m.recalls]) for s in sessions]
        finally:
            svc.close()

    alone = converse(False)
    recall_lm.model.most_sequences = 0
    together = converse(True)
    assert together == alone
    assert recall_lm.model.most_sequences == 4  # all four decoded in one llama.cpp batch
    assert all(r for _, r in alone[::2])  # the recalling sessions did recall


def test_a_full_kv_cache_frees_the_least_recently_used_conversation(recall_lm):
    """Three conversations on a context with room for two: the oldest is freed, and its next turn reads its
    whole conversation again and answers exactly as it would have."""
    small = LlamaCppModel(recall_lm.model.path, context=256, sequences=2)
    small.add_token_rows(recall_lm.spec.vocab_size)
    from dataclasses import replace

    lm = replace(recall_lm, model=small, spec=small.spec)
    greedy = GenerationSettings(max_new_tokens=6, repetition_penalty=1.0)
    off = RecallSettings(enabled=False)
    convs = [Conversation(lm) for _ in range(3)]
    for i, conv in enumerate(convs):
        list(conv.stream(f"Say the number {i}.", settings=greedy, recall=off))
    assert convs[0].cache.get_seq_length() == 0 and convs[0].cache.seq is None  # freed for the third
    list(convs[0].stream("And the next one?", settings=greedy, recall=off))
    reference = Conversation(recall_lm)
    list(reference.stream("Say the number 0.", settings=greedy, recall=off))
    list(reference.stream("And the next one?", settings=greedy, recall=off))
    assert convs[0].ids == reference.ids


@pytest.mark.parametrize("setting, names", [
    (dict(entropy_decoding="trough"), "entropy_decoding"),
    (dict(guidance_scale=1.5), "guidance_scale"),
])
def test_what_needs_transformers_is_refused_by_name(recall_lm, setting, names):
    with pytest.raises(ValueError, match=f"{names}.*model.backend: transformers"):
        generate(recall_lm.model, {"input_ids": prompt(recall_lm)}, GenerationSettings(max_new_tokens=2, **setting))


def test_loading_refusals_name_the_setting(tmp_path):
    from models.llamacpp import load_gguf_model

    with pytest.raises(ValueError, match="model.quantize"):
        load_model(None, LoadOptions(backend="llamacpp", quantize="int8"))
    with pytest.raises(ValueError, match="memory.values"):
        load_model(None, LoadOptions(backend="llamacpp", values="state"))
    with pytest.raises(FileNotFoundError, match="not a .gguf file"):
        load_model(str(tmp_path), LoadOptions(backend="llamacpp"))
    with pytest.raises(ValueError, match="model.gguf_type"):
        load_gguf_model(None, LoadOptions(gguf_type="q2_k"))


@pytest.fixture(scope="module")
def own_gguf(tmp_path_factory):
    """A user's own GGUF chat model: the shipped Q4_1 SmolLM2 file, given by path (no recall training)."""
    from models.embedded import embedded_gguf

    return embedded_gguf()


def test_a_users_own_gguf_chats_with_its_template_and_reads_memories_in_the_message(own_gguf, text_search):
    """Any GGUF chat model: its tokenizer and chat template come from the file; recall runs in the mode for
    models never trained to recall (the memory is read at the end of the user's message)."""
    lm = load_model(str(own_gguf))  # backend auto: a .gguf file runs on llama.cpp
    assert lm.backend == "llamacpp" and not lm.recall_trained and lm.encoder.placement == "user"
    assert lm.tokenizer.chat_template and "<|im_start|>" in lm.tokenizer.chat_template
    assert lm.spec.vocab_size == lm.model.n_vocab + 3  # the recall tokens, as rows of the mean
    svc = Service(config(), lm, text_search=text_search)
    try:
        s = svc.new_session()
        result(svc.banks.build_example(s))
        turn = svc.chat(s, QUESTION, [], GenerationSettings(max_new_tokens=24), RecallSettings(), recall_first=True)
        result(turn.request)
        answer = s.conv.messages[-1]
        (event,) = answer.recalls
        assert event.position < answer.start and event.text.startswith("Mira Castellan")  # in the user's message
        assert s.conv.ids[event.position - 1] == lm.tokens.recall and answer.text
    finally:
        svc.close()


def test_a_gguf_without_a_chat_template_is_refused_by_name(own_gguf, tmp_path):
    import subprocess
    import sys

    bare = tmp_path / "bare.gguf"
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--force", "--remove-metadata",
                    "tokenizer.chat_template", str(own_gguf), str(bare)], check=True, capture_output=True)
    with pytest.raises(ValueError, match="bare.gguf has no chat template"):
        load_model(str(bare))


def test_the_mixture_is_refused_on_llamacpp_by_name(recall_lm):
    from decoding.settings import MixtureSettings

    conv = Conversation(recall_lm)
    settings = GenerationSettings(max_new_tokens=2, mixture=MixtureSettings(enabled=True))
    with pytest.raises(ValueError, match="generation.mixture.*model.backend: transformers"):
        list(conv.stream("Hello", settings=settings, recall=RecallSettings(enabled=False)))
    assert conv.messages == [] and conv.ids == []  # nothing half-stored


def test_the_openai_api_serves_the_llamacpp_backend(recall_lm):
    """/v1 on llama.cpp with the official client: a whole answer, and a stream giving the same text."""
    import openai

    from test_app import serve

    with serve(recall_lm, "model.backend=llamacpp") as server:
        api = openai.OpenAI(base_url=server.url + "v1", api_key="unused", max_retries=0, timeout=120)
        ask = dict(model="recall-chat", messages=[{"role": "user", "content": "What is the capital of France?"}],
                   temperature=0, max_tokens=12)
        whole = api.chat.completions.create(**ask)
        assert "Paris" in whole.choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(**ask, stream=True)
                           if c.choices)
        assert streamed == whole.choices[0].message.content
        assert api.models.list().data[0].id == recall_lm.name

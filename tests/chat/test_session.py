import threading

import pytest
import torch

from decoding.request import Controls, Prompt
from decoding.memory import Recall

from chat import transcript
from chat.session import Conversation, TextOnlyModelError
from tests_helpers import returned
from decoding import DoneEvent, GenerationSettings, RecallEvent, RecallSettings, TokenEvent, generate

GREEDY = GenerationSettings(max_new_tokens=8)


def run(conv, *args, **kwargs):
    events = list(conv.stream(*args, **kwargs))
    assert isinstance(events[-1], DoneEvent)
    return events


def test_memory_recalled_in_turn_one_is_still_seen_in_turn_three(tiny_llama, bank):
    lm = tiny_llama
    conv = Conversation(lm)
    events = run(conv, "Who am I?", settings=GREEDY, recall=RecallSettings(), memory_db=bank, recall_first=True)
    recall = next(e for e in events if isinstance(e, RecallEvent))
    p = recall.position
    assert conv.ids[p] == lm.tokens.memory_pad and conv.ids[p - 1] == lm.tokens.recall
    torch.testing.assert_close(conv.memory[p], bank.vector(recall.memory_index))
    assert conv.messages[-1].recalls[0].position == p

    ids_after_1 = list(conv.ids)
    run(conv, "And then?", settings=GREEDY, memory_db=bank)
    assert conv.ids[: len(ids_after_1)] == ids_after_1  # turns only ever append: the cache prefix stays valid
    cache = conv.cache
    assert cache.get_seq_length() == len(conv.ids) - 1

    # turn 3 on the cache of turn 2 ...
    inputs_before = None
    events = run(conv, "Tell me more.", settings=GenerationSettings(max_new_tokens=6), memory_db=bank)
    assert conv.cache is cache  # reused and extended, not rebuilt
    turn3 = [e.token_id for e in events if isinstance(e, TokenEvent)]
    # ... equals a fresh prefill of the whole conversation with the turn-1 memory placed again
    start = conv.messages[-1].start
    prompt = {"input_ids": torch.tensor([conv.ids[:start]])}
    fresh = generate(
        lm.model,
        Prompt(prompt, memory_vectors={p: conv.memory[p]}),
        GenerationSettings(max_new_tokens=6),
        recall=Recall(lm.tokens.recall, lm.tokens.memory_pad, bank),
        controls=Controls(eos_token_id=lm.tokenizer.eos_token_id),
    )
    assert fresh.new_tokens[0].tolist() == turn3
    without = generate(
        lm.model,
        prompt,
        GenerationSettings(max_new_tokens=6),
        controls=Controls(output_logits=True, eos_token_id=lm.tokenizer.eos_token_id),
    )
    with_memory = generate(
        lm.model,
        Prompt(prompt, memory_vectors={p: conv.memory[p]}),
        GenerationSettings(max_new_tokens=6),
        recall=Recall(lm.tokens.recall, lm.tokens.memory_pad),
        controls=Controls(output_logits=True, eos_token_id=lm.tokenizer.eos_token_id),
    )
    assert not torch.allclose(without.logits, with_memory.logits, atol=1e-3)  # the memory matters in turn 3
    del inputs_before


def test_turn_template_matches_the_chat_template(smollm2):
    conv = Conversation(smollm2)
    run(conv, "Hi, who are you?", settings=GenerationSettings(max_new_tokens=12))
    run(conv, "What is 2+2?", settings=GenerationSettings(max_new_tokens=12))
    tok = smollm2.tokenizer
    answer1 = conv.messages[1].text
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "Hi, who are you?"}, {"role": "assistant", "content": answer1},
         {"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True)
    assert tok.decode(conv.ids[: conv.messages[-1].start]) == expected


def test_an_answer_that_opens_a_turn_ends_there_and_is_kept_as_ended(tiny_llama):
    """SmolLM2-135M answered a 9,000-character message with "<|im_start|>user\nYou've already solved the problem."
    (shown as "user\nYou've ..."): the template's turn opener now ends an answer, and the conversation keeps the end
    of the turn in its place, so the next turn's prompt is the chat template's."""
    lm, tok = tiny_llama, tiny_llama.tokenizer
    opener = tok.convert_tokens_to_ids("<|im_start|>")
    assert lm.turn_opener == opener and opener in lm.spec.eos_token_ids
    first = [e.token_id for e in run(Conversation(lm), "Hi.", settings=GREEDY) if isinstance(e, TokenEvent)][0]
    conv = Conversation(lm)  # the same answer, made to open a turn after its first token
    forced = GenerationSettings(max_new_tokens=8, sequence_bias=(((first, opener), 100.0),))
    events = run(conv, "Hi.", settings=forced)
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == [first, opener]
    answer = conv.messages[-1]
    assert answer.finish_reason == "stop" and answer.text == tok.decode([first])
    assert conv.ids[-2:] == [first, tok.eos_token_id]  # (not the opener)
    run(conv, "And?", settings=GREEDY)
    expected = tok.apply_chat_template([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": answer.text},
                                        {"role": "user", "content": "And?"}], tokenize=False, add_generation_prompt=True)
    assert tok.decode(conv.ids[:conv.messages[-1].start]) == expected


def test_a_template_without_a_generation_prompt_has_no_turn_opener(tiny_llama):
    from models.spec import turn_opener

    class NoTemplate:
        def apply_chat_template(self, *a, **k):
            raise ValueError("no chat template")

    assert turn_opener(NoTemplate()) is None and turn_opener(tiny_llama.tokenizer) == 1


def test_stop_in_the_middle_of_a_recall_leaves_nothing_half_done(tiny_llama, bank):
    lm = tiny_llama
    conv = Conversation(lm)
    stop = threading.Event()
    events = []
    for e in conv.stream("Remember", settings=GenerationSettings(max_new_tokens=20), memory_db=bank,
                         interrupt_event=stop, recall_first=True):
        events.append(e)
        if isinstance(e, RecallEvent):
            stop.set()  # right after the memory was chosen, before its position is forwarded
    assert conv.messages[-1].finish_reason == "interrupted"
    assert conv.ids[-1] == lm.tokens.memory_pad and len(conv.messages[-1].recalls) == 1
    p = len(conv.ids) - 1
    assert p in conv.memory  # the chosen vector is kept with its position ...
    assert conv.cache.get_seq_length() == p  # ... and the cache stops before it
    run(conv, "Go on", settings=GREEDY, memory_db=bank)  # the next turn prefills it with its vector
    assert conv.messages[-1].finish_reason in ("length", "stop") and p in conv.memory


def test_abandoned_stream_stores_nothing_of_the_turn(tiny_llama):
    conv = Conversation(tiny_llama)
    run(conv, "First", settings=GREEDY)
    ids, n = list(conv.ids), len(conv.messages)
    stream = conv.stream("Second", settings=GREEDY)
    next(stream)
    stream.close()  # the consumer went away mid-stream: the turn is dropped whole
    assert conv.ids == ids and len(conv.messages) == n and conv.cache is None
    run(conv, "Third", settings=GREEDY)
    assert conv.messages[-2].text == "Third"


def test_regenerate_and_save_load(tiny_llama, bank, tmp_path):
    lm = tiny_llama
    conv = Conversation(lm)
    run(conv, "Hello", settings=GREEDY, memory_db=bank, recall_first=True)
    run(conv, "Again", settings=GREEDY, memory_db=bank)
    answer = conv.messages[-1].text
    ids = list(conv.ids)
    list(conv.regenerate(GREEDY, RecallSettings(), memory_db=bank))
    assert conv.messages[-1].text == answer and conv.ids == ids  # greedy: the same answer again

    saved = transcript.save(conv)
    other = Conversation(lm)
    transcript.load(other, saved, tmp_path)
    assert other.ids == conv.ids and other.memory.keys() == conv.memory.keys()
    assert [m.text for m in other.messages] == [m.text for m in conv.messages]
    run(conv, "Continue", settings=GREEDY, memory_db=bank)
    run(other, "Continue", settings=GREEDY, memory_db=bank)  # no cache: full prefill with vectors placed
    assert other.ids == conv.ids
    with pytest.raises(ValueError, match="format: Input should be 'recall-chat/conversation-2' or "
                                         "'recall-chat/conversation-3'"):
        transcript.load(other, '{"format": "something else"}', tmp_path)


def test_a_turn_out_of_the_models_reading_is_still_shown_and_saved_but_never_read(tiny_llama, bank, tmp_path):
    from chat.state import message_states

    conv = Conversation(tiny_llama)
    run(conv, "Hello", settings=GREEDY, memory_db=bank, recall_first=True)
    run(conv, "Again", settings=GREEDY, memory_db=bank)
    shown = message_states(conv)
    first_ids = tiny_llama.tokenizer("Hello", add_special_tokens=False)["input_ids"]
    conv.drop_oldest_turns()
    assert [m.text for m in conv.messages] == ["Again", shown[3].text]  # what the model reads
    assert message_states(conv) == shown  # what the page shows: every turn, the first answer's memory marker too
    assert shown[1].recalls and not any(conv.ids[i:i + len(first_ids)] == first_ids for i in range(len(conv.ids)))
    # the next answer is the answer to the window alone: the same as a conversation that never had the first turn
    alone = Conversation(tiny_llama)
    alone.ids, alone.messages, alone.memory = list(conv.ids), list(conv.messages), dict(conv.memory)
    run(conv, "Continue", settings=GREEDY, memory_db=bank)
    run(alone, "Continue", settings=GREEDY, memory_db=bank)
    assert conv.ids == alone.ids
    # a saved file keeps the earlier turn, shown again when loaded, and still not read
    other = Conversation(tiny_llama)
    transcript.load(other, transcript.save(conv), tmp_path)
    assert message_states(other) == message_states(conv)  # (the earlier answer's memory marker too: it was lost)
    assert other.ids == conv.ids and [m.text for m in other.messages] == [m.text for m in conv.messages]
    other.clear()
    assert message_states(other) == ()


def test_images_for_a_text_only_model_are_refused_clearly(tiny_llama, small_image):
    conv = Conversation(tiny_llama)
    with pytest.raises(TextOnlyModelError, match="reads text only.*1 attached image"):
        run(conv, "What is this?", [small_image], settings=GREEDY)
    assert conv.ids == [] and conv.messages == []


def test_vision_conversation_with_an_image_each_turn(tiny_qwen3vl, small_image):
    conv = Conversation(tiny_qwen3vl)
    run(conv, "What is this?", [small_image], settings=GREEDY)
    cache = conv.cache
    run(conv, "And this?", [small_image], settings=GREEDY)
    assert conv.cache is cache and len(conv.pixels) == 2
    assert conv.inputs()["image_grid_thw"].shape == (2, 3)


def test_a_mixture_answer_drafts_with_the_configured_head(smollm2_dir, tmp_path):
    """mixture.draft = head: the session loads the head from mixture.head and drafts with it (exact
    whatever the head: greedy equals direct); no folder named is a clear error."""
    from peft import LoraConfig, get_peft_model

    from conftest import make_tiny_llama
    from decoding.draft_head import DraftHead, head_config
    from decoding.settings import MixtureSettings
    lm = make_tiny_llama(smollm2_dir, seed=4)
    lm.model = get_peft_model(lm.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    DraftHead(head_config(lm.model.config)).save(tmp_path / "head")
    answers = {}
    for draft, speculative in (("theta", False), ("head", True)):
        mixture = MixtureSettings(enabled=True, speculative=speculative, draft=draft, head=str(tmp_path / "head"))
        events = run(Conversation(lm), "Hello there", settings=GenerationSettings(max_new_tokens=6, mixture=mixture))
        answers[draft] = events[-1].result
    assert answers["head"].sequences.tolist() == answers["theta"].sequences.tolist() and answers["head"].drafted > 0
    assert ("head", str(tmp_path / "head")) in lm._targets
    with pytest.raises(ValueError, match="names no folder"):
        run(Conversation(lm), "Hello", settings=GenerationSettings(
            max_new_tokens=2, mixture=MixtureSettings(enabled=True, speculative=True, draft="head")))


# --------------------------------------------------------------------------- key/value memories


@pytest.fixture(scope="module")
def text_keys():
    from models.text_keys import TextEncoder
    return TextEncoder(adapter=None)


def kv_model(lm, text_keys, placement: str):
    """`lm` writing `tokens` memories with text keys: as a model never trained (placement user) or as one
    trained to read them between <recall> and </recall> at the start of its answer (placement answer)."""
    import dataclasses
    from models.encoder import MemoryEncoder
    encoder = MemoryEncoder("tokens", text_keys, name="tiny", placement=placement,
                            close="</recall>" if placement == "answer" else None)
    return dataclasses.replace(lm, encoder=encoder)


FACTS = ["Mira Castellan is the lighthouse keeper of Port Avel.", "The ferry to Lune Island leaves at seven.",
         "The baker of Port Avel is called Tomas."]


def kv_bank(lm):
    from models import build_bank
    return build_bank(lm.model, lm.tokenizer, FACTS, lm.encoder, progress=False)


def embedded(lm, ids: torch.Tensor) -> torch.Tensor:
    """What a `tokens` memory injects: the model's own input embeddings of its token ids [k, H]."""
    with torch.no_grad():
        return lm.model.get_input_embeddings()(ids).float()


def test_a_model_never_trained_reads_the_memory_at_the_end_of_the_message(tiny_llama, text_keys, tmp_path):
    lm = kv_model(tiny_llama, text_keys, "user")
    bank = kv_bank(lm)
    conv = Conversation(lm)
    events = run(conv, "Who keeps the lighthouse?", settings=GREEDY, recall=RecallSettings(), memory_db=bank,
                 recall_first=True)
    (recall,) = [e for e in events if isinstance(e, RecallEvent)]
    assert events[0] == recall and recall.memory_index == 0  # read before the answer: the message is the query
    answer = conv.messages[-1]
    p, k = recall.position, recall.length
    assert k == len(lm.tokenizer(FACTS[0], add_special_tokens=False).input_ids) and p + k < answer.start
    assert conv.ids[p - 1] == lm.tokens.recall and conv.ids[p:p + k] == [lm.tokens.memory_pad] * k
    assert lm.tokenizer.decode(conv.ids[p + k:answer.start]).startswith("<|im_end|>")  # the message ends after it
    torch.testing.assert_close(torch.stack([conv.memory[p + i] for i in range(k)]), embedded(lm, bank.values(0)))
    assert answer.recalls == [recall] and lm.tokens.recall not in conv.ids[answer.start:]
    # the file keeps the span; another conversation continues it exactly
    path = tmp_path / "c.json"
    path.write_text(transcript.save(conv))
    again = Conversation(lm)
    transcript.load(again, path.read_text(), tmp_path)
    assert again.ids == conv.ids and again.messages[-1].recalls == [recall] and sorted(again.memory) == sorted(conv.memory)
    run(again, "And the ferry?", settings=GREEDY, memory_db=bank, recall_first=True)
    second = again.messages[-1].recalls[0]
    assert second.memory_index == 1 and again.ids[second.position - 1] == lm.tokens.recall
    # dropping the first turn moves the second turn's memory with it
    again.drop_oldest_turns()
    kept = again.messages[-1].recalls[0]
    assert kept.length == second.length and again.ids[kept.position:kept.position + kept.length] == \
        [lm.tokens.memory_pad] * kept.length
    torch.testing.assert_close(again.memory[kept.position], embedded(lm, bank.values(1))[0])
    path.write_text(transcript.save(again))
    transcript.load(Conversation(lm), path.read_text(), tmp_path)  # still a valid file


def test_a_trained_model_reads_the_memory_between_recall_and_its_close(tiny_llama, text_keys):
    lm = kv_model(tiny_llama, text_keys, "answer")
    bank = kv_bank(lm)
    conv = Conversation(lm)
    run(conv, "When does the ferry leave?", settings=GREEDY, recall=RecallSettings(), memory_db=bank,
        recall_first=True)
    answer = conv.messages[-1]
    recall = answer.recalls[0]
    p, k = recall.position, recall.length
    assert recall.memory_index == 1 and p == answer.start  # <recall> ends the prompt, the slots start the answer
    assert conv.ids[p - 1] == lm.tokens.recall and conv.ids[p:p + k] == [lm.tokens.memory_pad] * k
    assert conv.ids[p + k] == lm.tokens.recall_end
    torch.testing.assert_close(torch.stack([conv.memory[p + i] for i in range(k)]), embedded(lm, bank.values(1)))


def test_a_conversation_file_from_before_key_value_memories_loads(tiny_llama, bank, tmp_path):
    conv = Conversation(tiny_llama)
    run(conv, "Who am I?", settings=GREEDY, recall=RecallSettings(), memory_db=bank, recall_first=True)
    import json
    data = json.loads(transcript.save(conv))
    for m in data["messages"]:
        for r in m["recalls"]:
            del r["length"]  # files written before had no length: one slot
    again = Conversation(tiny_llama)
    transcript.load(again, json.dumps(data), tmp_path)
    assert again.messages[-1].recalls == conv.messages[-1].recalls and again.ids == conv.ids


def test_a_question_about_the_user_reads_only_a_memory_the_fit_check_admits(tiny_llama):
    from models import build_bank
    from models.text_keys import TextEncoder

    lm = kv_model(tiny_llama, TextEncoder(), "answer")  # the shipped key encoder: the fit check's
    assert lm.encoder.fit_check is not None
    texts = ["Nina is the user's cousin.", "The user's job is gardener.", FACTS[0]]
    bank = build_bank(lm.model, lm.tokenizer, texts, lm.encoder, progress=False)
    conv, checked = Conversation(lm), RecallSettings(min_score=0.3, fit_check=True)
    # the score alone reads the cousin for a daughter (0.39 >= min_score): the user bench's abstention misses
    assert conv.recall(bank, RecallSettings(min_score=0.3), "What's the name of my daughter?").bank is bank
    assert conv.recall(bank, checked, "What's the name of my daughter?").bank is None  # "you haven't told me"
    for question, right in [("Do you remember my cousin's name?", 0), ("What work do I do?", 1)]:
        read = conv.recall(bank, checked, question)
        _, ids = read.bank.topk(lm.encoder.message_query(question), 5)
        assert ids.tolist() == [right], question
    # a question not about the user is not checked: the score alone decides
    assert conv.recall(bank, checked, "Who keeps the lighthouse of Port Avel?").bank is bank
    # one about another thing of the user's reads nothing (the fit check admits the cousin for a sister's name)
    admitted = build_bank(lm.model, lm.tokenizer, ["The user's sister is called Lena."], lm.encoder, progress=False)
    assert conv.recall(admitted, checked, "What is my sister's name?").bank is not None
    assert conv.recall(admitted, checked, "What is my mother's name?").bank is None


def test_reading_a_prompt_ahead_changes_no_token_of_the_answer(tiny_llama):
    from decoding.engine import cache_length

    lm = tiny_llama
    settings = GenerationSettings(max_new_tokens=12)
    alone, ahead = Conversation(lm), Conversation(lm)
    for text in ["Hello there, who are you?", "Tell me one thing about the sea."]:  # the second reads on a cache
        assert returned(ahead.read_ahead(text))[0]
        assert cache_length(ahead.cache) == ahead.length_with(text) - 1  # all but the last token: the answer prefills that one
        run(alone, text, settings=settings)
        run(ahead, text, settings=settings)
        assert ahead.ids == alone.ids and ahead.messages[-1].text == alone.messages[-1].text


def test_on_llama_cpp_a_prompt_read_ahead_gives_the_answer_the_same_first_logits(default_lm):
    """The default backend: the first step's logits after a read of all but the last token against a whole
    prefill. Measured equal here (max difference 0.0 at 1 and 2 threads, AVX2; top-1 margins 2.9-5.9); the bound
    leaves room for other kernels (AVX-512) on batches of other sizes."""
    from decoding.events import DoneEvent
    from decoding.loop import read_prompt, stream_generate

    lm = default_lm

    def first_logits(prompt):
        for event in stream_generate(lm.merged(), prompt, GenerationSettings(max_new_tokens=1), tokenizer=lm.tokenizer,
                                     controls=Controls(output_logits=True)):
            if isinstance(event, DoneEvent):
                return event.result.logits[0, 0].float()

    for text in ["Hello there, who are you?", "What is my sister's name?"]:
        ids = torch.tensor([Conversation(lm).ids_with(text)])
        whole = first_logits(Prompt({"input_ids": ids}))
        cache, _ = returned(read_prompt(lm.merged(), Prompt({"input_ids": ids[:, :-1]})))
        split = first_logits(Prompt({"input_ids": ids}, cache))
        assert float((whole - split).abs().max()) <= 0.25, text
        assert int(whole.argmax()) == int(split.argmax()), text


def test_nothing_is_read_ahead_where_a_memory_vector_is_not_cached(tiny_llama, bank):
    conv = Conversation(tiny_llama)
    run(conv, "Who keeps the lighthouse?", settings=GREEDY, recall=RecallSettings(), memory_db=bank, recall_first=True)
    assert conv.memory  # a memory was read into this conversation
    conv.cache = None  # (as after loading it from a file)
    assert returned(conv.read_ahead("And the ferry?")) == (False, []) and conv.cache is None


@pytest.mark.parametrize("how", ["failed", "stopped"])
def test_a_message_read_ahead_but_never_answered_leaves_the_conversation_as_it_was(tiny_llama, how):
    """A failure between the read and the answer (the write decision, the recall), or a stop while reading: the
    next message is answered as if the first had never been read."""
    conv, fresh = Conversation(tiny_llama), Conversation(tiny_llama)
    for c in (conv, fresh):
        run(c, "Hello there, who are you?", settings=GREEDY)
    stop = threading.Event()
    if how == "stopped":
        conv.prefill_chunk = 8  # (the first chunk reads past the template into the message)
        stop.set()
    done, _ = returned(conv.read_ahead("Nope, not that one at all.", stop))
    assert done == (how == "failed")
    longer = "Tell me one thing about the sea, and then one more thing about the ships on it."  # (its prompt is
    for c in (conv, fresh):  # longer than the one read: the cache would be taken as its prefix)
        run(c, longer, settings=GenerationSettings(max_new_tokens=12))
    assert conv.ids == fresh.ids


# --------------------------------------------------------------------------- recall first with nothing that fits


def test_recall_first_with_no_memory_at_min_score_answers_as_without_it(tiny_llama, text_keys):
    """Recall first, no memory at `min_score`: no `<recall>` is forced (after a bare one, with nothing to read, the
    default model ended its answer before it began: an empty answer or a new line). The answer is the one without
    recall first, and the result says the recall was missed (the "none fits" notice). A regenerate with nothing
    to read now drops the `<recall>` an earlier answer was forced to start with."""
    lm = kv_model(tiny_llama, text_keys, "answer")
    bank = kv_bank(lm)
    strict = RecallSettings(min_score=0.99)
    first, plain = Conversation(lm), Conversation(lm)
    events = run(first, "What is the capital of France?", settings=GREEDY, recall=strict, memory_db=bank,
                 recall_first=True)
    run(plain, "What is the capital of France?", settings=GREEDY, recall=strict, memory_db=bank)
    assert lm.tokens.recall not in first.ids and first.ids == plain.ids
    assert not any(isinstance(e, RecallEvent) for e in events) and events[-1].result.missed_recall == [True]

    again, plain = Conversation(lm), Conversation(lm)
    run(again, "When does the ferry leave?", settings=GREEDY, memory_db=bank, recall_first=True)
    assert again.messages[-1].recalls and again.ids[again.messages[-1].start - 1] == lm.tokens.recall  # (read)
    events = list(again.regenerate(GREEDY, strict, bank))
    run(plain, "When does the ferry leave?", settings=GREEDY, recall=strict, memory_db=bank)
    assert again.ids == plain.ids and again.messages[-1].recalls == [] and again.memory == {}
    assert events[-1].result.missed_recall == [True]
    assert again.cache.get_seq_length() == len(again.ids) - 1


def closing(lm):
    """`lm` with the `state` memories of the seeds (a bank keyed by `<recall>` states), as a model trained to read a
    memory between `<recall>` and `</recall>`."""
    import dataclasses
    from models.encoder import MemoryEncoder
    return dataclasses.replace(lm, encoder=MemoryEncoder(close="</recall>"))


def test_a_recall_in_a_bank_of_states_with_nothing_at_min_score_reads_nothing(tiny_llama, bank):
    """A bank keyed by `<recall>` states (bare vectors) can be checked only at the recall: each `<recall>`, forced by
    recall first or written by the model, whose search finds no memory at `min_score` reads an empty memory
    (`</recall>` right after it: nothing injected, no recall event) and the result says it missed its recall. With
    no `min_score` the same answer reads its memories."""
    lm = closing(tiny_llama)
    settings = GenerationSettings(max_new_tokens=16, sequence_bias=(((lm.tokens.recall,), 6.0),))  # (it recalls)
    conv = Conversation(lm)
    events = run(conv, "Who am I?", settings=settings, recall=RecallSettings(min_score=0.9), memory_db=bank,
                 recall_first=True)
    answer = conv.messages[-1]
    at = [i for i, t in enumerate(conv.ids) if t == lm.tokens.recall]
    assert at[0] == answer.start - 1 and len(at) >= 2  # forced, then written by the model
    assert all(conv.ids[i + 1] == lm.tokens.recall_end for i in at if i + 1 < len(conv.ids))
    assert lm.tokens.memory_pad not in conv.ids and conv.memory == {} and answer.recalls == []
    assert not any(isinstance(e, RecallEvent) for e in events) and events[-1].result.missed_recall == [True]
    # the next turn reads the conversation as it is (no vector wanted anywhere)
    run(conv, "And then?", settings=GREEDY, recall=RecallSettings(min_score=0.9), memory_db=bank)

    read = Conversation(lm)
    events = run(read, "Who am I?", settings=settings, recall=RecallSettings(), memory_db=bank, recall_first=True)
    recalls = [e for e in events if isinstance(e, RecallEvent)]
    assert len(recalls) >= 2 and max(e.score for e in recalls) < 0.9 and read.memory
    assert events[-1].result.missed_recall is None


def test_on_llama_cpp_recall_first_with_nothing_that_fits_answers_from_what_it_knows(default_lm):
    """The default model (llama.cpp): recall first on the example bank, a question no memory fits, answered as
    without recall first (it answered nothing, or a new line); a bank of bare vectors (keyed by `<recall>` states,
    none at 0.3) reads nothing and the model answers too."""
    from chat.banks import EXAMPLE_MEMORIES
    from memory import MemoryVectorDB
    from models import build_bank

    texts = [t.strip() for t in EXAMPLE_MEMORIES.read_text().splitlines() if t.strip() and not t.startswith("#")]
    example = build_bank(default_lm.model, default_lm.tokenizer, texts, default_lm.encoder, progress=False)
    recall, settings = RecallSettings(min_score=0.3), GenerationSettings(max_new_tokens=12)
    for text in ["What is the capital of France?", "What is 2+2?"]:
        first, plain = Conversation(default_lm), Conversation(default_lm)
        events = run(first, text, settings=settings, recall=recall, memory_db=example, recall_first=True)
        run(plain, text, settings=settings, recall=recall, memory_db=example)
        assert first.messages[-1].text.strip() and first.ids == plain.ids, text
        assert events[-1].result.missed_recall == [True]
    states = MemoryVectorDB(default_lm.hidden_size)
    states.add(torch.randn(10, default_lm.hidden_size, generator=torch.Generator().manual_seed(0)))
    conv = Conversation(default_lm)
    events = run(conv, "What is the capital of France?", settings=settings, recall=recall, memory_db=states,
                 recall_first=True)
    assert not any(isinstance(e, RecallEvent) for e in events) and "Paris" in conv.messages[-1].text
    assert events[-1].result.missed_recall == [True] and conv.memory == {}


def test_a_stop_ends_the_apps_own_answer_as_it_ends_the_models(tiny_llama, tmp_path):
    """(A forget's answer went on to its end after a stop: the page said "stopped after 12 tokens", the answer
    "done".) It ends at the stop, "interrupted", and the turn is kept as far as it went."""
    from decoding.events import FinishEvent

    conv, stop = Conversation(tiny_llama), threading.Event()
    events = []
    for event in conv.say("Forget my dog.", [], "Forgot: The user's dog is called Rex.",
                          GenerationSettings(max_new_tokens=32), stop):
        events.append(event)
        if isinstance(event, TokenEvent) and len(events) == 2:
            stop.set()
    said = [e for e in events if isinstance(e, TokenEvent)]
    assert len(said) == 2 and [e.reason for e in events if isinstance(e, FinishEvent)] == ["interrupted"]
    assert conv.messages[-1].finish_reason == "interrupted" and conv.messages[-1].text == "".join(e.text for e in said)
    again = Conversation(tiny_llama)
    transcript.load(again, transcript.save(conv), tmp_path)  # (a whole turn: saved and loaded)
    assert again.ids == conv.ids

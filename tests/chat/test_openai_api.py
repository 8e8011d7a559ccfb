"""The OpenAI-compatible API with the official `openai` client against the real server (SmolLM2)."""

from __future__ import annotations

import random
import threading
import time

import httpx
import openai
import pytest

from models import build_bank
from test_app import serve

pytestmark = pytest.mark.slow
PNG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAA"
                                                "DUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="}}  # 1x1
PROMPTS = ["What is the capital of France?", "Name three colours.", "Write one sentence about rain.",
           "What is 2 plus 2?", "Say hello in Spanish.", "Name a big animal.", "What do bees make?",
           "Tell me a short fact about the moon."]


@pytest.fixture(scope="module")
def bank_path(smollm2, tmp_path_factory):
    path = tmp_path_factory.mktemp("bank") / "facts.pt"
    texts = ["Mira Castellan is the lighthouse keeper of Port Avel.", "Biscuit is Mira's grey cat."]
    build_bank(smollm2.model, smollm2.tokenizer, texts, smollm2.encoder, progress=False).save(path)
    return path


@pytest.fixture(scope="module")
def server(smollm2, bank_path):
    with serve(smollm2, f"memory.bank={bank_path}") as s:
        yield s


@pytest.fixture
def api(server):
    return openai.OpenAI(base_url=server.url + "v1", api_key="unused", max_retries=0, timeout=120)


def model_id(api) -> str:
    return api.models.list().data[0].id


def greedy(api, prompt: str, **kw):
    return api.chat.completions.create(model=model_id(api), messages=[{"role": "user", "content": prompt}],
                                       **{"temperature": 0, "max_tokens": 12, **kw})


def test_models_and_a_whole_answer(api, smollm2):
    models = api.models.list().data
    assert [m.id for m in models] == [smollm2.name]
    out = greedy(api, "What is the capital of France?")
    assert "Paris" in out.choices[0].message.content and out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens > 0 and out.usage.prompt_tokens > 10
    alias = api.chat.completions.create(model="recall-chat", messages=[{"role": "user", "content": "What is the "
                                        "capital of France?"}], temperature=0, max_tokens=12)  # the alias: the same
    assert alias.choices[0].message.content == out.choices[0].message.content


def test_streaming_gives_the_same_text_as_a_whole_answer(api):
    """The same text, the same model name, and with `stream_options.include_usage` a last chunk (no choices) with
    the whole answer's usage."""
    whole = greedy(api, "Name three colours.")
    chunks = list(greedy(api, "Name three colours.", stream=True, stream_options={"include_usage": True}))
    *text, usage = chunks
    assert "".join(c.choices[0].delta.content or "" for c in text) == whole.choices[0].message.content
    assert text[-1].choices[0].finish_reason in ("stop", "length")
    assert usage.choices == [] and usage.usage == whole.usage
    assert {c.model for c in chunks} == {whole.model}  # (the chunks named the model as the request did)
    assert all(c.usage is None for c in greedy(api, "Name three colours.", stream=True))


def test_a_developer_message_is_a_system_message(api):
    """OpenAI's newer SDKs send system instructions as "developer"."""
    ask = [{"role": "user", "content": "Name a colour."}]
    system, developer = ([{"role": role, "content": "Answer in French."}, *ask] for role in ("system", "developer"))
    out = [api.chat.completions.create(model=model_id(api), temperature=0, max_tokens=8, messages=m) for m in
           (system, developer)]
    assert out[0].choices[0].message.content == out[1].choices[0].message.content
    assert out[0].usage.prompt_tokens == out[1].usage.prompt_tokens


def test_history_and_system_prompt_are_read_as_the_chat_template_lays_them_out(api, smollm2):
    messages = [{"role": "system", "content": "You are a helpful assistant who answers briefly."},
                {"role": "user", "content": "My name is Oda."}, {"role": "assistant", "content": "Hello Oda!"},
                {"role": "user", "content": "What is my name?"}]
    out = api.chat.completions.create(model=model_id(api), temperature=0, max_tokens=8, messages=messages)
    tok = smollm2.tokenizer
    expected = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"]
    assert out.usage.prompt_tokens == len(expected)


def test_stop_sequences_end_the_answer_and_are_not_returned(api):
    whole = greedy(api, "Write one sentence about rain.", max_tokens=24).choices[0].message.content
    word = whole.split()[3]
    cut = greedy(api, "Write one sentence about rain.", max_tokens=24, stop=[word])
    text = cut.choices[0].message.content
    assert word not in text and whole.startswith(text) and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       greedy(api, "Write one sentence about rain.", max_tokens=24, stop=[word], stream=True))
    assert streamed == text


def test_a_recall_event_travels_in_the_chunks(api):
    chunks = list(api.chat.completions.create(
        model=model_id(api), messages=[{"role": "user", "content": "Who keeps the lighthouse of Port Avel?"}],
        temperature=0, max_tokens=8, stream=True, extra_body={"recall_first": True}))
    recalls = [c.model_extra["recall"] for c in chunks if c.model_extra and "recall" in c.model_extra]
    assert len(recalls) == 1 and recalls[0]["memory_index"] == 0  # the key encoder finds the lighthouse's keeper
    assert recalls[0]["text"] == "Mira Castellan is the lighthouse keeper of Port Avel."
    whole = greedy(api, "Who keeps the lighthouse of Port Avel?", extra_body={"recall_first": True})
    assert whole.model_extra["recalls"][0]["memory_index"] == recalls[0]["memory_index"]


@pytest.mark.parametrize("kw, error, words", [
    (dict(model="gpt-4"), openai.NotFoundError, "does not exist"),
    (dict(temperature=5), openai.BadRequestError, "temperature"),
    (dict(max_tokens=5000), openai.BadRequestError, "max_tokens: expected at most 1024"),
    (dict(max_tokens=True), openai.BadRequestError, "max_tokens: Input should be a valid integer"),  # (it was 1)
    (dict(max_tokens=5, max_completion_tokens=1000), openai.BadRequestError,  # (1000 was used without a word)
     "max_tokens and max_completion_tokens: expected one of them (or the same value), got 5 and 1000"),
    (dict(messages=[{"role": "user", "content": "x" * 200_000}]), openai.BadRequestError, "200000"),
    (dict(messages=[{"role": "assistant", "content": "hi"}]), openai.BadRequestError, "last message"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
     openai.BadRequestError, "nothing is fetched"),
    (dict(extra_body={"num_beams": 4}), openai.BadRequestError, "num_beams is 4: must be 1, because beam search"),
    (dict(extra_body={"diversity_penalty": 0.5, "num_beam_groups": 2}), openai.BadRequestError,
     "num_beam_groups is 2: must be 1, because beam search is not offered in a streaming recall chat"),
    # found while answering (a refusal, not a failure: 400, not 500), worded for the API
    (dict(messages=[{"role": "user", "content": "hello " * 3300}] * 3), openai.BadRequestError,  # (by the texts alone,
     "messages: expected at most 4096 tokens (the server's app.max_input_tokens), got at least 66"),  # at once)
    (dict(messages=[{"role": "user", "content": "a " * 4200}]), openai.BadRequestError,
     "messages: expected at most 4096 tokens (the server's app.max_input_tokens), got 42"),
    (dict(messages=[{"role": "user", "content": [PNG]}]), openai.BadRequestError,
     "reads text only), got 1 image(s) and no text"),
    # OpenAI's fields the server does not do are refused by name, not ignored; the extensions are checked too
    (dict(presence_penalty=0.5), openai.BadRequestError,
     "presence_penalty: not supported by this server (expected 0), got 0.5; use repetition_penalty"),
    (dict(logprobs=True), openai.BadRequestError, "logprobs: not supported by this server (expected False), got True"),
    (dict(response_format={"type": "json_object"}), openai.BadRequestError, "response_format: not supported by this server (expected None), got {'type': 'json_object'}"),
    (dict(logit_bias={"hello": 5}), openai.BadRequestError, "logit_bias: expected token ids as keys"),
    (dict(logit_bias={"42": 300}), openai.BadRequestError, "logit_bias['42']: expected a bias from -100 to 100"),
    (dict(logit_bias={"999999": 5}), openai.BadRequestError,  # (found on the worker: a refusal, not a 500)
     "logit_bias: expected token ids below 49155 (the model's vocabulary), got 999999"),
    (dict(extra_body={"settings": {"generation.bad_words_ids": [[999999]]}}), openai.BadRequestError,
     "settings['generation.bad_words_ids']: bad_words_ids: expected token ids below 49155"),
    (dict(extra_body={"top_k": -1}), openai.BadRequestError, "top_k: Input should be greater than or equal to 0"),
    (dict(extra_body={"settings": {"generation.no_such": 1}}), openai.BadRequestError,
     "settings: unknown setting 'generation.no_such'"),
    (dict(extra_body={"settings": {"generation.max_new_tokens": 9}}), openai.BadRequestError,
     "settings: 'generation.max_new_tokens' is set by a field of the request too"),
    (dict(extra_body={"settings": {"recall.temperature": -1}}), openai.BadRequestError,
     "settings['recall.temperature']: temperature is -1"),
    (dict(extra_body={"settings": {"recall.top_p": 0}}), openai.BadRequestError,
     "settings['recall.top_p']: top_p is 0"),
    (dict(max_tokens=10, extra_body={"settings": {"generation.min_new_tokens": 50}}), openai.BadRequestError,
     "settings['generation.min_new_tokens']: min_new_tokens is 50: must be at most max_new_tokens (10)"),
    (dict(extra_body={"settings": {"mixture.enabled": True, "mixture.draft": "head"}}), openai.BadRequestError,
     "generation.mixture.draft is 'head' but generation.mixture.head names no folder"),  # (a 500 before)
    (dict(stop=""), openai.BadRequestError,  # (an empty stop string matched at once: an empty answer)
     "stop: expected non-empty strings (an empty one ends every answer at once), got ''"),  # (said once)
    (dict(stop=["ok", ""]), openai.BadRequestError, "stop: expected non-empty strings"),
    # checked before it starts: no Python internals in the message
    (dict(seed=2 ** 70), openai.BadRequestError, "seed: Input should be less than or equal to 18446744073709551615"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]), openai.BadRequestError,
     "messages.0.content.1.image_url: expected a PNG or JPEG image, got 8 bytes that are not a readable image "
     "(starting b'\\x89PNG"),
])
def test_bad_requests_get_openai_style_errors(api, kw, error, words):
    args = dict(model=model_id(api), messages=[{"role": "user", "content": "hi"}], max_tokens=4) | kw
    with pytest.raises(error) as info:
        api.chat.completions.create(**args)
    assert words in info.value.message and info.value.body["type"] in ("invalid_request_error",)
    assert "object at 0x" not in info.value.message
    assert greedy(api, "Say hi.").choices[0].message.content  # and the server answers the next one


@pytest.mark.parametrize("kw,param,words", [
    (dict(max_tokens=100_000), "max_tokens", "max_tokens: expected at most"),
    (dict(stop=[f"s{i}" for i in range(17)]), "stop",
     "stop: expected at most 16 strings of at most 100 characters, got 17 of up to 3 characters"),
    # (a malformed part was told as "messages.0.content.str: Input should be a valid string": the wrong shape)
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url",
                                                                                 "image_url": {}}]}]),
     "messages", "messages.0.content.1.image_url.url: Field required"),
    (dict(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]), "messages",
     "messages.0.content.0: Input tag 'input_audio' found using 'type' does not match any of the expected tags"),
    # (an image in a system message was dropped without a word)
    (dict(messages=[{"role": "system", "content": [PNG]},
                    {"role": "user", "content": "ok"}]), "messages",
     "messages.0.content: expected text in a system message (images go in user messages), got 1 image(s)"),
    (dict(messages=[{"role": "user", "content": "x" * 20_001}]), "messages",  # (it came with no field)
     "messages.0.content: expected at most 20000 characters, got 20001"),
    (dict(extra_body={"stream_options": {"include_usage": True}}), "stream_options",  # (as OpenAI refuses it)
     "stream_options: only allowed when stream is true"),
    (dict(stream=True, stream_options={"include_usage": "yes"}), "stream_options",
     "stream_options.include_usage: Input should be a valid boolean"),
    (dict(extra_body={"settings": {"mixture.alpha": -0.1}}), "settings", "settings['mixture.alpha']: mixture alpha"),
    (dict(extra_body={"settings": {"mixture.enabled": True, "mixture.target": "/tmp"}}), "settings",
     "settings['mixture.target']: a file of the server, set by its configuration (generation.mixture.target: None), "
     "not by a request; got '/tmp'"),
    (dict(extra_body={"settings": {"mixture.gguf": "/etc/passwd"}}), "settings", "settings['mixture.gguf']: a file"),
    # (accepted as numbers or true: lax types; a full-width "１２" as token 12; infinity, refused later by no field)
    (dict(temperature=True), "temperature", "temperature: Input should be a valid number"),
    (dict(extra_body={"stream": "yes"}), "stream", "stream: Input should be a valid boolean"),
    (dict(extra_body={"recall_first": "yes"}), "recall_first", "recall_first: Input should be a valid boolean"),
    (dict(logit_bias={"１２": 5}), "logit_bias", "logit_bias: expected token ids as keys"),
    # (a probe: "type a message (or attach an image)", with no field and not what came)
    (dict(messages=[{"role": "user", "content": "  "}]), "messages",
     "messages.0.content: expected the message's text or an image, got '  '"),
    (dict(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": []}]), "messages",
     "messages.1.content: expected the message's text or an image, got no text and no image")])
def test_a_refusal_names_the_field_the_request_sent(api, kw, param, words):
    """(These came with no field, or the engine's name for it: "max_new_tokens", "mixture"; a mixture target, draft
    GGUF or head of any path of the server was loaded, each kept: 600 MB a spelling of one folder, or a 500 that
    told whether a file exists.)"""
    args = dict(model=model_id(api), messages=[{"role": "user", "content": "hi"}], max_tokens=4) | kw
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(**args)
    assert words in info.value.message and info.value.body["param"] == param


def test_an_api_key_is_checked_when_set(smollm2):
    with serve(smollm2, "app.api_key=s3cret-key") as s:
        bad = openai.OpenAI(base_url=s.url + "v1", api_key="wrong-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=s.url + "v1", api_key="s3cret-key", max_retries=0)
        assert good.models.list().data


def test_eight_concurrent_sessions_get_what_they_would_get_alone(api, server):
    """Eight clients of mixed settings at once, three hanging up early: they decode as rows of shared
    forwards, and each gets the answer it gets alone."""
    mixed = {p: {"max_tokens": 12 + 4 * (i % 3), **({"stop": ["."]} if i % 4 == 1 else {})} for i, p in enumerate(PROMPTS)}
    alone = {p: greedy(api, p, **mixed[p]).choices[0].message.content for p in PROMPTS}
    batch = server.service.worker.batch
    forwards, rows = batch.forwards, batch.rows_run
    got: dict[str, str] = {}
    rng = random.Random(0)
    stops = set(rng.sample(PROMPTS, 3))  # these clients hang up after a few chunks

    def run(prompt):
        client = openai.OpenAI(base_url=server.url + "v1", api_key="unused", max_retries=0, timeout=300)
        stream = greedy(client, prompt, **{**mixed[prompt], **({"max_tokens": 300} if prompt in stops else {})},
                        stream=True)
        text = []
        for i, chunk in enumerate(stream):
            text.append(chunk.choices[0].delta.content or "")
            if prompt in stops and i == 4:
                stream.close()
                break
        got[prompt] = "".join(text)

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for p in PROMPTS:
        assert alone[p].startswith(got[p]) or got[p].startswith(alone[p]), (p, got[p], alone[p])
        assert p in stops or got[p] == alone[p], (p, got[p], alone[p])
    assert (batch.rows_run - rows) / (batch.forwards - forwards) > 2  # answers shared their forwards
    deadline = time.monotonic() + 60
    while any(r.label in stops for r in server.service.worker.running) and time.monotonic() < deadline:
        time.sleep(0.1)
    reasons = {r.label: r.reason for r in server.service.worker.history if r.label in stops}
    assert reasons and set(reasons.values()) == {"interrupted"}  # a client that hangs up stops its answer


def test_a_whole_answer_whose_client_hangs_up_stops(server):
    """A client of a whole (not streamed) answer that hangs up stops it, while its tokens still flow: the answer
    ends interrupted, short of the 200 tokens it was asked for (about 9 s of them here; it went on to its end
    before)."""
    prompt = "Tell me a very long story about the dragons of the north."
    body = {"model": httpx.get(server.url + "v1/models").json()["data"][0]["id"], "temperature": 0,
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 200,
            "settings": {"generation.min_new_tokens": 200}}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "v1/chat/completions", json=body, timeout=1.5)
    worker = server.service.worker
    deadline = time.monotonic() + 120
    while not any(r.label == prompt for r in worker.history) and time.monotonic() < deadline:
        time.sleep(0.1)
    done = [r for r in worker.history if r.label == prompt]
    assert done and done[-1].reason == "interrupted" and done[-1].steps < 200, [(r.reason, r.steps) for r in done]


@pytest.fixture(scope="module")
def default_api(default_lm):
    """The server as it starts by default on a CPU (llama.cpp, the recall GGUF), with no bank."""
    with serve(default_lm, "generation.max_new_tokens=40") as s:
        yield openai.OpenAI(base_url=s.url + "v1", api_key="unused", max_retries=0, timeout=120)


def test_a_fact_question_with_no_bank_is_answered_without_recall_junk(default_api):
    """With no bank the model answers from what it knows (no `<recall>`, no `:::` of the recall tokens' text); a
    question only a memory could answer makes it look for one, and the answer carries a notice that none fits (a
    question it knows the answer to may or may not: the shipped adapter no longer asks after "Who wrote ...?")."""
    from chat.service import no_memory
    from decoding.settings import RecallSettings

    NO_MEMORY = no_memory(None, RecallSettings())  # (it said "no bank, none close enough ..., or recall is off")
    assert NO_MEMORY == "the model looked for a memory, but there is no bank to read: it answered from what it knows"

    for question, value, looks in [("Who wrote Romeo and Juliet?", "Shakespeare", None),
                                   ("Who keeps the lighthouse of Port Avel?", None, True)]:
        out = greedy(default_api, question, max_tokens=40)
        text = out.choices[0].message.content
        assert "<recall>" not in text and ":::" not in text and not out.model_extra["recalls"], text
        assert value is None or value in text, text
        assert out.model_extra["notices"] in (([NO_MEMORY],) if looks else ([], [NO_MEMORY])), question
    told = greedy(default_api, "What is my sister's name?", max_tokens=40)  # a question about the user: not told
    assert "haven't told me" in told.choices[0].message.content and not told.model_extra["recalls"]
    chunks = list(greedy(default_api, "Who keeps the lighthouse of Port Avel?", stream=True))
    assert [c.model_extra["notice"] for c in chunks if c.model_extra and "notice" in c.model_extra] == [NO_MEMORY]
    # the notice comes at the answer's end, and the finish chunk still last (clients read the finish from it)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert [c.choices[0].finish_reason is not None for c in chunks].count(True) == 1
    plain = greedy(default_api, "What is the capital of France?")
    assert "Paris" in plain.choices[0].message.content and plain.model_extra["notices"] == []


def test_a_prompt_over_the_models_context_is_a_bad_request_naming_the_limit(default_api):
    """The default model reads 2048 tokens: a prompt over that, less the answer's tokens, is refused with 400 (not
    500) in the API's terms (no conversation to clear, no configured cap beside the context); a stream, already
    under way when the answer finds it, gets the same error as its event."""
    messages = [{"role": "user", "content": "hello " * 3300}]
    with pytest.raises(openai.BadRequestError) as info:
        default_api.chat.completions.create(model="recall-chat", max_tokens=5, messages=messages)
    message = info.value.message
    assert ("messages: expected at most 2043 tokens (the model's context of 2048 tokens less the 5 kept for the "
            "answer, max_tokens), got 3330") in message
    assert "clear the conversation" not in message and "4096" not in message and info.value.body["param"] == "messages"
    with pytest.raises(openai.APIError, match="messages: expected at most 2043 tokens"):
        list(default_api.chat.completions.create(model="recall-chat", max_tokens=5, messages=messages, stream=True))


def test_the_largest_seed_is_accepted_and_repeats_its_answer(api):
    from chat.openai_request import MAX_SEED

    kw = dict(temperature=0.9, seed=MAX_SEED, max_tokens=6)
    first = greedy(api, "Name a big animal.", **kw).choices[0].message.content
    assert first and greedy(api, "Name a big animal.", **kw).choices[0].message.content == first


@pytest.mark.parametrize("body", [b"{", b"[]", b'"x"', b"null", b""], ids=["cut", "list", "string", "null", "empty"])
@pytest.mark.parametrize("path", ["chat/completions", "memories"])
def test_a_body_that_is_not_a_json_object_is_a_400_naming_the_body(server, body, path):
    """Errors about the body as a whole have no field: the API raised IndexError (a plain-text 500) reading one."""
    r = httpx.post(server.url + "v1/" + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith("the request body: ") and error["param"] is None
    assert error["type"] == "invalid_request_error"


def test_null_is_the_default_of_every_optional_field_and_nan_no_number(server):
    """OpenAI's schema lets a client send null for any optional field: `presence_penalty`, `n`, `stream`, ... were
    400s ("Input should be a valid number (got None)"); NaN, which Python's JSON reads, passed as a temperature to
    the range check ("less than or equal to 2 (got nan)")."""
    url, model = server.url + "v1/chat/completions", httpx.get(server.url + "v1/models").json()["data"][0]["id"]
    nulls = dict.fromkeys(("presence_penalty", "frequency_penalty", "logprobs", "n", "stream", "recall_first",
                           "settings", "stream_options", "temperature", "top_p", "seed", "stop", "tools"))
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, **nulls}
    r = httpx.post(url, json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    for bad in (b"NaN", b"Infinity"):
        raw = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "temperature": %s}' % (
            model.encode(), bad)
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
        assert r.json()["error"]["message"].startswith("temperature: Input should be a finite number")
    r = httpx.post(url, json={**body, "model": None}, timeout=60)  # (a required field stays required)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


def test_the_seeds_settings_reach_an_answer_through_the_api(api, smollm2):
    """`logit_bias` (OpenAI's) and the extensions `top_k`, `min_p`, `typical_p`, `repetition_penalty` and `settings`
    (any generation, mixture or recall setting by its configuration key) change the answer; a sampling field with
    no temperature samples (as OpenAI's default temperature does)."""
    [token] = smollm2.tokenizer(" banana", add_special_tokens=False).input_ids
    forced = greedy(api, "What is the capital of France?", max_tokens=3, logit_bias={str(token): 100})
    assert forced.choices[0].message.content == " banana banana banana"
    banned = greedy(api, "What is the capital of France?", max_tokens=12, extra_body={"settings": {
        "generation.bad_words_ids": [smollm2.tokenizer(" Paris", add_special_tokens=False).input_ids]}})
    assert "Paris" not in banned.choices[0].message.content
    plain = greedy(api, "Count from one to ten.", max_tokens=12).choices[0].message.content
    penalised = greedy(api, "Count from one to ten.", max_tokens=12,
                       extra_body={"repetition_penalty": 5.0}).choices[0].message.content
    assert plain.startswith("1. 1\n2. 2") and not penalised.startswith("1. 1\n2. 2")  # (each number once at most)
    kw = dict(model=model_id(api), messages=[{"role": "user", "content": "Write a word."}], max_tokens=8)
    drawn = {api.chat.completions.create(**kw, top_p=0.99, seed=s).choices[0].message.content for s in range(4)}
    assert len(drawn) > 1  # (top_p alone samples: four seeds, more than one answer)
    assert api.chat.completions.create(**kw, top_p=0).choices[0].message.content  # (0 as the page's slider: refused)
    for extra in ({"top_k": 5}, {"min_p": 0.05}, {"typical_p": 0.9}):
        out = api.chat.completions.create(**kw, extra_body=extra, seed=1)
        assert out.choices[0].message.content
    recall = greedy(api, "Who keeps the lighthouse of Port Avel?", max_tokens=24,
                    extra_body={"recall_first": True, "settings": {"recall.min_score": 0.99}})
    assert recall.model_extra["recalls"] == []  # (no memory is that close: the recall settings reached the head)


@pytest.mark.parametrize("settings, param, words", [
    ({"mixture.enabled": True, "generation.entropy_decoding": "trough"}, "settings",
     "mixture enabled is True with entropy_decoding='trough' and guidance_scale=1.0"),
    ({"generation.watermark": True, "generation.watermark_bias": 1e308}, "settings",
     "settings['generation.watermark_bias']: watermark_bias is 1e+308: must be in [0, 100]"),
    ({"mixture.gamma": 20, "mixture.gamma_rule": "seed"}, "settings",
     "mixture gamma is 20: must be from 3 to 10 with gamma_rule='seed'"),
    ({"mixture.gamma": 1000000}, "settings", "mixture gamma is 1000000: must be an int from 1 to 64")])
def test_a_refused_setting_or_pair_of_settings_names_what_came_and_the_field(settings, param, words):
    """(A hostile probe: the mixture with entropy decoding was a 400 with no param and no values; a watermark bias of
    1e308 and a mixture gamma of 1,000,000 were taken, and an adaptive rule's lengths inverted outside [3, 10].)"""
    import json

    from chat.config import load_config, request_settings
    from chat.openai_request import ChatRequest, overrides, parse, settings_error

    body = parse(ChatRequest, json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                          "settings": settings}).encode())
    cfg = load_config(environ={})
    with pytest.raises(ValueError) as refused:
        request_settings(cfg, overrides(body, cfg))
    error = settings_error(refused.value, body)
    assert error.status == 400 and error.param == param and words in error.message, error.message


@pytest.mark.parametrize("settings, words", [
    ({"generation.entropy_decoding": "trough"}, "the llamacpp backend does not run entropy_decoding"),
    ({"generation.guidance_scale": 1.5}, "the llamacpp backend does not run guidance_scale"),
    ({"mixture.enabled": True}, "the llamacpp backend does not run generation.mixture"),
])
def test_what_the_backend_cannot_run_is_a_400_naming_it(default_api, settings, words):
    """A setting this server's model cannot run is the request's to change: 400 (it was a 500 "server_error", and a
    stream's error came after a 200), the same words streamed."""
    kw = dict(model="recall-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
              extra_body={"settings": settings})
    with pytest.raises(openai.BadRequestError) as info:
        default_api.chat.completions.create(**kw)
    assert words in info.value.message and info.value.body["param"] == "settings"
    with pytest.raises(openai.APIError, match=words):
        list(default_api.chat.completions.create(**kw, stream=True))


def test_a_client_gone_while_its_session_is_busy_leaves_the_server_answering_others(server, monkeypatch):
    """(A client that left while the worker held its session froze every other caller: the event loop waited on the
    session there, until the worker let it go, a minute later.) The stream's client goes while its turn holds the
    session; /v1/models answers meanwhile; the turn then ends."""
    svc = server.service
    holding, go = threading.Event(), threading.Event()
    window = svc.window.slide

    def held(conv):  # (what a long history's window held: the session's lock, on the worker)
        holding.set()
        go.wait(120)
        yield from window(conv)

    monkeypatch.setattr(svc.window, "slide", held)
    body = {"model": "recall-chat", "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 4}
    try:
        with httpx.stream("POST", server.url + "v1/chat/completions", json=body, timeout=60):
            assert holding.wait(60)
        time.sleep(1.5)  # (the server sees the client gone at its next half-second look)
        assert httpx.get(server.url + "v1/models", timeout=20).status_code == 200
    finally:
        go.set()


def test_a_body_past_the_upload_limit_or_an_infinite_number_is_refused_by_name(server):
    """(A 100 MB body was read and parsed whole; an infinite penalty was taken, then refused naming no field.)"""
    limit = server.cfg.memory.max_upload_mb * 2 ** 20
    sent = httpx.post(server.url + "v1/chat/completions", content=b" " * (limit + 1),
                      headers={"content-type": "application/json"}, timeout=120)
    assert sent.status_code == 413 and "expected at most" in sent.json()["error"]["message"]

    def chunks():  # (no length told: read up to the limit, no further)
        for _ in range(limit // 2 ** 20 + 2):
            yield b" " * 2 ** 20

    streamed = httpx.post(server.url + "v1/chat/completions", content=chunks(), timeout=120)
    assert streamed.status_code == 413 and "got more" in streamed.json()["error"]["message"]

    infinite = httpx.post(server.url + "v1/chat/completions", timeout=60, headers={"content-type": "application/json"},
                          content=b'{"model": "recall-chat", "messages": [{"role": "user", "content": "hi"}], '
                                  b'"repetition_penalty": Infinity}')
    assert infinite.status_code == 400 and infinite.json()["error"]["param"] == "repetition_penalty"


def test_an_unknown_route_or_method_gets_an_openai_style_error(server):
    """(A probe: {"detail": "Not Found"} and {"detail": "Method Not Allowed"}, not the error JSON of the rest; a
    5,000-character id came back whole in its message.)"""
    missing = httpx.get(server.url + "v1/embeddings", timeout=30)
    assert missing.status_code == 404 and "/v1/embeddings: no such route" in missing.json()["error"]["message"]
    wrong = httpx.put(server.url + "v1/memories", timeout=30)
    assert wrong.status_code == 405 and wrong.json()["error"]["message"] == \
        "PUT /v1/memories: expected DELETE or GET or POST" and wrong.headers["allow"] == "DELETE, GET, POST"
    # (a review: a trailing slash answered 404, FastAPI's own redirect gone; a long path came back whole)
    slash = httpx.get(server.url + "v1/models/", timeout=30)
    assert slash.status_code == 307 and slash.headers["location"].endswith("/v1/models")
    far = httpx.get(server.url + "v1/" + "x" * 3000, timeout=30)
    assert far.status_code == 404 and "(3004 characters)" in far.json()["error"]["message"]
    long = httpx.delete(server.url + "v1/memories/m-" + "a" * 5000, timeout=60)
    assert long.status_code == 404 and "(5002 characters)" in long.json()["error"]["message"]
    assert len(long.json()["error"]["message"]) < 200
    assert httpx.get(server.url + "v1/models", timeout=30).status_code == 200  # (the routes it has still answer)

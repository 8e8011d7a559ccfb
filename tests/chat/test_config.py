from pathlib import Path

import pytest

from chat.config import DEFAULT_PATH, Config, ConfigError, load_config


def test_repo_config_loads_into_typed_objects():
    cfg = load_config(environ={})
    assert isinstance(cfg, Config) and DEFAULT_PATH.name == "config_qwen3vl.yaml"
    assert cfg.model.path is None  # the embedded default
    assert cfg.generation.temperature == 0.7 and cfg.generation.max_new_tokens == 256
    rec = cfg.memory.autoregressive_recall
    assert (rec.enabled, rec.top_k, rec.use_sampling) == (True, 5, False)
    assert cfg.memory.hidden_state.layer == -1 and cfg.memory.hidden_state.pooling == "last"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_unknown_key_names_the_key_and_the_allowed_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'generation.temprature'.*temperature"):
        load_config(write(tmp_path, "generation:\n  temprature: 0.5\n"), environ={})
    with pytest.raises(ConfigError, match=r"memory.autoregressive_recall.topk"):
        load_config(write(tmp_path, "memory:\n  autoregressive_recall:\n    topk: 3\n"), environ={})
    with pytest.raises(ConfigError, match=r"unknown key 'modle'"):
        load_config(write(tmp_path, "modle: {}\n"), environ={})


@pytest.mark.parametrize("text, words", [
    ("generation:\n  top_p: 1.5\n", ["generation", "top_p", "1.5"]),
    ("generation:\n  do_sample: true\n  temperature: 0\n", ["generation", "temperature", "do_sample=False"]),
    ("memory:\n  autoregressive_recall:\n    top_k: -1\n", ["autoregressive_recall", "top_k", "-1"]),
    ("memory:\n  index: annoy\n", ["memory", "index", "annoy", "hnsw"]),
    ("model:\n  dtype: int8\n", ["model", "dtype", "int8", "bfloat16"]),
    ("app:\n  port: 70000\n", ["app", "port", "70000"]),
    ("app:\n  max_running: 0\n", ["app", "max_running", "0", "a positive integer"]),
    ("memory:\n  hidden_state:\n    pooling: max\n", ["hidden_state", "pooling", "max"]),
    # a default over the cap passed the start, then refused every request that kept it
    ("generation:\n  max_new_tokens: 100000\n", ["generation.max_new_tokens", "100000", "app.max_new_tokens_cap",
                                                 "1024"]),
])
def test_out_of_range_values_name_key_value_and_allowed(tmp_path, text, words):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), environ={})
    for word in words:
        assert word in str(err.value)


def test_env_and_command_line_override_in_that_order(tmp_path):
    path = write(tmp_path, "generation:\n  temperature: 0.3\n")
    env = {"RECALL_CHAT__GENERATION__TEMPERATURE": "0.4", "RECALL_CHAT__MEMORY__AUTOREGRESSIVE_RECALL__TOP_K": "9"}
    assert load_config(path, environ={}).generation.temperature == 0.3
    cfg = load_config(path, environ=env)
    assert cfg.generation.temperature == 0.4 and cfg.memory.autoregressive_recall.top_k == 9
    cfg = load_config(path, overrides=["generation.temperature=0.5", "model.device=cpu"], environ=env)
    assert cfg.generation.temperature == 0.5 and cfg.model.device == "cpu"
    with pytest.raises(ConfigError, match="unknown key 'generation.nope'"):
        load_config(path, overrides=["generation.nope=1"], environ={})
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(path, overrides=["generation.temperature"], environ={})


def test_a_gguf_on_transformers_is_refused_by_name():
    """`--backend transformers --model x.gguf` ran on llama.cpp without a word."""
    with pytest.raises(ConfigError, match="model: backend is 'transformers' but path '/x/own.gguf' is a .gguf file, "
                                          "which runs on llama.cpp only"):
        load_config(overrides=["model.backend=transformers", "model.path=/x/own.gguf"], environ={})
    load_config(overrides=["model.backend=auto", "model.path=/x/own.gguf"], environ={})


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml': expected a YAML file, got nothing there"):
        load_config(tmp_path / "nope.yaml", environ={})
    with pytest.raises(ConfigError, match=rf"'{tmp_path}': expected a YAML file, got a folder"):
        load_config(tmp_path, environ={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "generation: [unclosed\n"), environ={})
    # (these ended the start with AttributeError / UnicodeDecodeError tracebacks)
    for text in ("- a\n", "5\n"):
        with pytest.raises(ConfigError, match=r"expected a mapping of sections \(model:, generation:, ...\), got "):
            load_config(write(tmp_path, text), environ={})
    binary = tmp_path / "latin1.yaml"
    binary.write_bytes("app:\n  host: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin1.yaml: expected a UTF-8 YAML file, got bytes that are not UTF-8"):
        load_config(binary, environ={})


def test_a_bare_off_is_off_wherever_it_is_written(tmp_path):
    """YAML reads a bare `off` as false: memory.remember takes it as the `off` it was written as."""
    (tmp_path / "c.yaml").write_text("memory:\n  remember: off\n")
    assert load_config(tmp_path / "c.yaml", environ={}).memory.remember == "off"
    assert load_config(overrides=["memory.remember=off"], environ={}).memory.remember == "off"
    assert load_config(environ={"RECALL_CHAT__MEMORY__REMEMBER": "off"}).memory.remember == "off"
    with pytest.raises(ConfigError, match="remember"):
        load_config(overrides=["memory.remember=sometimes"], environ={})


def test_a_section_left_empty_is_its_defaults(tmp_path):
    """(Its keys all commented out, a section is YAML's null: `model.path` then ended the start with an
    AttributeError, `app:` made `--set app.port` "not a section", an empty `autoregressive_recall:` failed after
    the model loaded.)"""
    for text in ("model:\n  # path: foo\n", "generation:\n", "memory:\n  autoregressive_recall:\n",
                 "memory:\n  hidden_state:\n", "app:\n", "serve:\n"):
        cfg = load_config(write(tmp_path, text), overrides=["app.port=7931"], environ={})
        assert cfg == load_config(write(tmp_path, "{}\n"), overrides=["app.port=7931"], environ={}), text


def test_a_key_given_twice_is_refused(tmp_path):
    """(The last one won: the first section's temperature 0.5 became the default 1.0 without a word.)"""
    with pytest.raises(ConfigError, match="not valid YAML: the key 'generation' is given twice"):
        load_config(write(tmp_path, "generation:\n  temperature: 0.5\ngeneration:\n  top_p: 0.9\n"), environ={})
    with pytest.raises(ConfigError, match="the key 'temperature' is given twice"):
        load_config(write(tmp_path, "generation:\n  temperature: 0.5\n  temperature: 0.6\n"), environ={})


def test_text_keys_take_the_text_as_written_and_a_bad_value_never_shows_a_key(tmp_path):
    """(An API key set to "abcdefgh #team" became "abcdefgh", YAML reading a comment; 12345678 was refused as not a
    string of 8 characters; `--set memory.bank=5` ended the start with a TypeError; a value YAML cannot read, in an
    environment variable, ended it with a traceback that printed the API key.)"""
    env = {"RECALL_CHAT__APP__API_KEY": "abcdefgh #team"}
    assert load_config(environ=env).app.api_key == "abcdefgh #team"
    for given, key in [("app.api_key=12345678", "12345678"), ("app.api_key='0x1f2e3d4c5b'", "0x1f2e3d4c5b"),
                       ("app.api_key=on-and-on", "on-and-on")]:
        assert load_config(overrides=[given], environ={}).app.api_key == key
    assert load_config(overrides=["memory.bank=5"], environ={}).memory.bank == "5"  # (a file named 5)
    assert load_config(overrides=["app.api_key=null"], environ={}).app.api_key is None
    with pytest.raises(ConfigError, match=r"app.api_key is <hidden> \(int\); allowed: text \(in YAML, quote"):
        load_config(write(tmp_path, "app:\n  api_key: 12345678\n"), environ={})
    with pytest.raises(ConfigError, match=r"app.users_file is 5 \(int\); allowed: text"):
        load_config(write(tmp_path, "app:\n  users_file: 5\n"), environ={})
    with pytest.raises(ConfigError, match=r"generation.stop_strings: expected a YAML value .*, got '\[a', which is "
                                          "not one"):
        load_config(overrides=["generation.stop_strings=[a"], environ={})
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["app.host=x"], environ={"RECALL_CHAT__APP__PORT": "%secret123"})
    assert "secret123" in str(err.value)  # (not a key: said as written)


def test_yaml_merge_keys_still_work_and_may_set_a_merged_key_again():
    """(A review found the duplicate-key check refused `<<: *anchor`.)"""
    import yaml

    from chat.config import _Loader

    assert yaml.load("a: &x {t: 1, u: 2}\nb:\n  <<: *x\n  t: 3\n", Loader=_Loader) == {"a": {"t": 1, "u": 2},
                                                                                       "b": {"t": 3, "u": 2}}

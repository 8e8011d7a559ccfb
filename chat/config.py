"""The one configuration: `config_qwen3vl.yaml`, loaded once into frozen, validated dataclasses.

Precedence: defaults < the YAML file < environment variables < command-line `--set` overrides.
An environment variable `RECALL_CHAT__GENERATION__TEMPERATURE=0.5` sets `generation.temperature`
(sections joined by `__`); `--set generation.temperature=0.5` does the same from the command line.
Values are parsed as YAML scalars (`true`, `0.5`, `null`, `[1, 2]`), but a key that takes text (a path, `api_key`)
takes the value as written (`null` or nothing: none), so `--set app.api_key='12345678 #a'` is that key.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from decoding.graph_compile import GQA, MATVEC
from decoding.settings import GenerationSettings, RecallSettings
from models import LoadOptions
from models.load import resolve_backend
from models.encoder import ValueKind
from models.hidden import HiddenStateSpec
from models.llamacpp import GGUF_TYPES
from models.quantize import QUANTIZE
from models.spec import GUIDANCE, LAYERS, MIXTURE, STATES

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "config_qwen3vl.yaml"
ENV_PREFIX = "RECALL_CHAT__"


class ConfigError(ValueError):
    """A configuration key or value that cannot be used; the message names key, value and what is allowed."""


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{key} is {value!r}; allowed: {allowed}")


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # a local model folder; None = the embedded SmolLM2-135M-Instruct
    adapter: str | None = "auto"  # a local PEFT adapter folder; auto = the shipped recall adapter for the embedded model
    device: str = "auto"
    dtype: str = "float32"
    compile: bool = True  # compile the decode step in the background at start (text models; decoding/compiled.py)
    graph_step: bool | str = "auto"  # answer on the graph step (decoding/graph_stream.py): auto (on CUDA) | true | false
    graph_max_len: int = 4096  # positions of the graph step's static cache (a prompt and its answer past it: the loop)
    graph_rows: int = 8  # concurrent answers as rows of a second graph step (decoding/graph_rows.py); 0: in the loop
    graph_freeze: bool = False  # the graph steps' decode forward frozen (q/k/v, gate/up one matmul; a copy of them)
    graph_fuse: bool = True  # q/k/v, gate/up joined in place (decoding/fused.py): one matmul each, no copy
    graph_matvec: str = "auto"  # one-row products: auto | cublas | triton (decoding/graph_compile.py)
    graph_gqa: str = "repeat"  # grouped-query attention of a step or span: repeat | packed (decoding/gqa.py)
    graph_autotune: bool = False  # the graph steps' products autotuned by inductor (decoding/graph_compile.py)
    quantize: str = "none"  # none | int8: int8 weights and activations on the CPU (models/quantize.py; changes outputs)
    backend: str = "auto"  # auto (llama.cpp on a CPU) | transformers | llamacpp (a GGUF on llama.cpp, models/llamacpp.py)
    gguf_type: str = "q8_0"  # the embedded recall model's GGUF on llama.cpp: q8_0 | q4_1 | f16 | f32
    gguf_context: int = 2048  # llama.cpp: the positions each conversation holds (8 stay resident in its KV cache)

    def __post_init__(self):
        if self.backend == "transformers" and str(self.path or "").lower().endswith(".gguf"):  # (it ran on llama.cpp)
            raise ValueError(f"backend is 'transformers' but path {self.path!r} is a .gguf file, which runs on "
                             "llama.cpp only; allowed: backend auto or llamacpp, or a model folder as path")
        _check(re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", str(self.device)) is not None, "device", self.device,
               "auto, cpu, mps, cuda or cuda:N")
        _check(self.dtype in ("float32", "bfloat16", "float16"), "dtype", self.dtype, "float32, bfloat16, float16")
        _check(isinstance(self.compile, bool), "compile", self.compile, "true, false")
        _check(self.graph_step in ("auto", True, False), "graph_step", self.graph_step, "auto, true, false")
        _check(isinstance(self.graph_max_len, int) and 64 <= self.graph_max_len <= 1 << 17, "graph_max_len",
               self.graph_max_len, "an integer from 64 to 131072")
        _check(isinstance(self.graph_rows, int) and not isinstance(self.graph_rows, bool) and 0 <= self.graph_rows <= 256,
               "graph_rows", self.graph_rows, "an integer from 0 to 256")
        _check(isinstance(self.graph_freeze, bool), "graph_freeze", self.graph_freeze, "true, false")
        _check(isinstance(self.graph_fuse, bool), "graph_fuse", self.graph_fuse, "true, false")
        _check(self.graph_matvec in MATVEC, "graph_matvec", self.graph_matvec, ", ".join(MATVEC))
        _check(self.graph_gqa in GQA, "graph_gqa", self.graph_gqa, ", ".join(GQA))
        _check(isinstance(self.graph_autotune, bool), "graph_autotune", self.graph_autotune, "true, false")
        _check(self.quantize in QUANTIZE, "quantize", self.quantize, ", ".join(QUANTIZE))
        _check(self.backend in ("auto", "transformers", "llamacpp"), "backend", self.backend,
               "auto, transformers, llamacpp")
        _check(self.gguf_type in GGUF_TYPES, "gguf_type", self.gguf_type, ", ".join(GGUF_TYPES))
        _check(isinstance(self.gguf_context, int) and 256 <= self.gguf_context <= 1 << 18, "gguf_context",
               self.gguf_context, "an integer from 256 to 262144")


@dataclass(frozen=True)
class MemoryConfig:
    bank: str | None = None  # a bank file (.pt, .safetensors, .npy) loaded at start
    index: str = "flat"  # flat = exact cosine; hnsw / ivf = approximate, for large banks
    hnsw_ef_search: int = 128  # HNSW candidates per search (higher: closer to exact, slower)
    values: str = "auto"  # what a written memory's value is: auto (the adapter's, else tokens) | tokens | chunks:N
                          # | mean | hidden:L | state (one hidden-state vector, also the key)
    key_encoder: str | None = "auto"  # the text encoder's adapter: auto (the shipped one) | none (stock) | a folder
    max_slots: int = 128  # the most value slots one memory may have (a memory of `tokens` has one a token)
    value_dtype: str = "float16"  # how values are stored: float16 | float32
    hidden_state: HiddenStateSpec = field(default_factory=HiddenStateSpec)  # the state of `state` values
    max_upload_mb: int = 64  # any upload (bank, conversation, image): refused before it is stored
    max_memories_per_session: int = 50_000  # a session's own bank (50k x 576 floats x 2 copies = 230 MB)
    max_user_memories: int = 10_000  # each user's own memories (their texts live in the file's 100 MB header)
    autoregressive_recall: RecallSettings = field(default_factory=RecallSettings)
    store: str = "faiss"  # where the shared bank and the users' memories live: faiss (in this process, from `bank`;
                          # each user's a file in `user_dir`) | milvus (`milvus_uri`)
    milvus_uri: str | None = None  # a local path (milvus-lite, one machine) or http://host:19530 (a Milvus server)
    milvus_collection: str = "memories"  # the shared bank's; every user's own memories are in `<name>_people`
    user_dir: str | None = None  # each user's own memories (null: $XDG_DATA_HOME/recall-chat/users, or ~/.local/share/...)
    remember: str = "auto"  # what a message writes to its author's memory: auto (what tells about them) | explicit | off

    def __post_init__(self):
        _check(self.index in ("flat", "hnsw", "ivf"), "index", self.index, "flat, hnsw, ivf")
        _check(self.store in ("faiss", "milvus"), "store", self.store, "faiss, milvus")
        _check(self.store != "milvus" or (isinstance(self.milvus_uri, str) and self.milvus_uri.strip() != ""),
               "milvus_uri", self.milvus_uri, "a local path or http://host:19530 when store is milvus")
        _check(isinstance(self.milvus_collection, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,200}",
               self.milvus_collection) is not None, "milvus_collection", self.milvus_collection,
               "a name of letters, digits and _ (not starting with a digit)")
        if self.remember is False:  # YAML reads a bare `off` as false
            object.__setattr__(self, "remember", "off")
        _check(self.remember in ("auto", "explicit", "off"), "remember", self.remember, "auto, explicit, off")
        _check(self.user_dir is None or (isinstance(self.user_dir, str) and self.user_dir.strip() != ""), "user_dir",
               self.user_dir, "null or a folder")
        if self.values != "auto":
            ValueKind.parse(self.values)  # names the value and the kinds allowed
        _check(self.value_dtype in ("float16", "float32"), "value_dtype", self.value_dtype, "float16, float32")
        _check(isinstance(self.max_slots, int) and not isinstance(self.max_slots, bool) and 1 <= self.max_slots
               <= 100_000, "max_slots", self.max_slots, "an integer from 1 to 100000")
        for key in ("max_upload_mb", "max_memories_per_session", "max_user_memories", "hnsw_ef_search"):
            value = getattr(self, key)
            _check(isinstance(value, int) and not isinstance(value, bool) and value > 0, key, value,
                   "a positive integer")


@dataclass(frozen=True)
class AppConfig:
    host: str = "127.0.0.1"
    port: int = 7860
    recall_first: bool = False  # start every answer with <recall>
    ui_updates_per_second: float = 20.0
    max_message_chars: int = 20_000  # one chat message
    max_input_tokens: int = 4096  # the whole conversation the model reads for one answer
    max_new_tokens_cap: int = 1024  # the most one request may ask for
    context_overflow: str = "refuse"  # refuse | drop_oldest: what happens when a conversation outgrows the limits
    # the most earlier turns the model reads with a new message (past them the oldest go, down to half; they are
    # shown and saved, not read): N, 0 = all, auto = 3 on the embedded model (it answers worse deep in a
    # conversation), all with a model you name
    history_turns: int | str = "auto"
    prefill_chunk_tokens: int = 256  # a long prompt is read in chunks: a stop, and other sessions, wait one chunk
    batching: bool = True  # answers of different sessions decode as rows of one forward; false: they take turns
    max_running: int = 8  # answers decoding at once (rows of the batch); more wait in the queue, their place shown
    session_ttl_s: int = 1800  # a session idle this long is freed (also API clients, which never close a page)
    api_key: str | None = None  # required as "Authorization: Bearer <key>" on /v1 when set
    users_file: str | None = None  # people (recall-users): the page asks for a login, /v1 for a user's key

    def __post_init__(self):
        _check(isinstance(self.port, int) and not isinstance(self.port, bool) and 0 < self.port < 65536, "port",
               self.port, "1..65535")
        _check(isinstance(self.ui_updates_per_second, (int, float)) and self.ui_updates_per_second > 0,
               "ui_updates_per_second", self.ui_updates_per_second, "a positive number")
        for key in ("max_message_chars", "max_input_tokens", "max_new_tokens_cap", "prefill_chunk_tokens",
                    "session_ttl_s", "max_running"):
            value = getattr(self, key)
            _check(isinstance(value, int) and not isinstance(value, bool) and value > 0, key, value,
                   "a positive integer")
        _check(isinstance(self.batching, bool), "batching", self.batching, "true or false")
        _check(self.context_overflow in ("refuse", "drop_oldest"), "context_overflow", self.context_overflow,
               "refuse, drop_oldest")
        _check(self.history_turns == "auto" or isinstance(self.history_turns, int)
               and not isinstance(self.history_turns, bool) and self.history_turns >= 0, "history_turns",
               self.history_turns, "auto, or a whole number of turns (0: all)")
        _check(self.api_key is None or (isinstance(self.api_key, str) and len(self.api_key) >= 8), "api_key",
               "<hidden>", "null, or a string of at least 8 characters")


@dataclass(frozen=True)
class ServeConfig:
    replicas: int = 1  # 1: the model runs in this process; N > 1: N Ray Serve replicas, each with its own model
    ray_address: str | None = None  # null: start a local Ray; or a running cluster's address ("auto", "host:6379")
    replica_cpus: float = 1.0  # CPUs Ray reserves for each replica (its torch threads)
    replica_gpus: float = 0.0  # GPUs Ray reserves for each replica

    def __post_init__(self):
        _check(isinstance(self.replicas, int) and not isinstance(self.replicas, bool) and 1 <= self.replicas <= 256,
               "replicas", self.replicas, "an integer from 1 to 256")
        _check(self.ray_address is None or (isinstance(self.ray_address, str) and self.ray_address.strip() != ""),
               "ray_address", self.ray_address, "null (a local Ray) or a cluster address such as auto or host:6379")
        for key in ("replica_cpus", "replica_gpus"):
            value = getattr(self, key)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0, key, value,
                   "a number >= 0")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    app: AppConfig = field(default_factory=AppConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def __post_init__(self):  # (a default no request may ask for would refuse every request that keeps it)
        cap = self.app.max_new_tokens_cap
        _check(self.generation.max_new_tokens <= cap, "generation.max_new_tokens", self.generation.max_new_tokens,
               f"at most app.max_new_tokens_cap ({cap})")


class _Loader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (the last one won, the first unsaid)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # (`<<: *defaults`: merged keys may be set again)
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _text_key(hint: Any) -> bool:
    """Whether a field of this type takes text alone (`str`, `str | None`)."""
    return hint is str or set(typing.get_args(hint)) == {str, type(None)}


def _hint(dotted: str) -> Any:
    """The type of the configuration key `dotted` (`app.api_key`), or None when there is no such key."""
    cls: Any = Config
    for name in dotted.split("."):
        if not dataclasses.is_dataclass(cls) or name not in (hints := typing.get_type_hints(cls)):
            return None
        cls = hints[name]
    return cls


def _build(cls, data: Any, path: str):
    """`cls(**data)` with nested dataclasses, naming the full key in every error (a section left empty, its keys
    all commented out, is its defaults)."""
    if data is None and path:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'the configuration'} must be a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"unknown key {where!r}; allowed keys here: {', '.join(sorted(names))}")
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        sub = hints[key]
        if value is False and _text_key(sub):  # (YAML reads a bare `off` as false)
            value = "off"
        if _text_key(sub) and value is not None and not isinstance(value, str):
            shown = "<hidden>" if key == "api_key" else repr(value)
            raise ConfigError(f"{where} is {shown} ({type(value).__name__}); allowed: text (in YAML, quote a value "
                              "that reads as a number or true/false)")
        kwargs[key] = _build(sub, value, where) if dataclasses.is_dataclass(sub) else value
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for name in parents:
        if node.get(name) is None:  # (a section left empty)
            node[name] = {}
        node = node[name]
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted!r}: {name!r} is not a section")
    node[leaf] = value


def parse_override(item: str) -> tuple[str, Any]:
    """`"generation.temperature=0.5"` -> `("generation.temperature", 0.5)`."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. generation.temperature=0.5)")
    if not raw.strip() or raw.strip() in ("null", "~"):
        return key, None
    if _text_key(_hint(key)):  # (as written: YAML read "abcdefgh #team" as "abcdefgh", 12345678 as a number)
        text = raw.strip()
        quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
        return key, text[1:-1] if quoted else text
    try:
        return key, yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError as e:
        shown = "<hidden>" if key.endswith("api_key") else repr(raw)
        raise ConfigError(f"{key}: expected a YAML value (a number, true/false, text, [a, b]), got {shown}, which "
                          f"is not one ({getattr(e, 'problem', None) or type(e).__name__})") from None


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Read the YAML file (default: `config_qwen3vl.yaml` at the repo root), apply env and overrides."""
    file = Path(path) if path is not None else DEFAULT_PATH
    if path is not None and not file.is_file():
        raise ConfigError(f"configuration file {str(file)!r}: expected a YAML file, got "
                          + ("a folder" if file.is_dir() else "nothing there"))
    tree: dict = {}
    if file.is_file():
        try:
            tree = yaml.load(file.read_text(encoding="utf-8-sig"), Loader=_Loader) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"{file}: expected a UTF-8 YAML file, got bytes that are not UTF-8 ({e.reason} at "
                              f"byte {e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{file}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{file}: expected a mapping of sections (model:, generation:, ...), got "
                              f"{type(tree).__name__} {tree!r:.60}")
    environ = os.environ if environ is None else environ
    for name, raw in environ.items():
        if name.startswith(ENV_PREFIX):
            key = ".".join(part.lower() for part in name[len(ENV_PREFIX):].split("__"))
            _set(tree, key, parse_override(f"{key}={raw}")[1])
    for item in overrides:
        _set(tree, *parse_override(item))
    return _build(Config, tree, "")


# --------------------------------------------------------------------------- a request's settings


def setting_value(cfg: Config, key: str) -> Any:
    """The configured value of `generation.<field>`, `mixture.<field>` or `recall.<field>`; an unknown
    key is an error."""
    section, _, name = key.partition(".")
    settings = {"generation": cfg.generation, "mixture": cfg.generation.mixture,
                "recall": cfg.memory.autoregressive_recall}.get(section)
    if settings is None or name not in {f.name for f in dataclasses.fields(settings)}:
        raise ConfigError(f"unknown setting {key!r}; settings are generation.<field>, mixture.<field> or "
                           "recall.<field>")
    return getattr(settings, name)


def request_settings(cfg: Config, values: Mapping[str, Any]) -> tuple[GenerationSettings, RecallSettings]:
    """The config's settings with a request's values, keyed `generation.<field>` / `mixture.<field>` /
    `recall.<field>`.

    An unknown key is an error (a renamed control must never switch a setting off silently); the
    engine's ValueError names an invalid value or combination.
    """
    changes: dict[str, dict[str, Any]] = {"generation": {}, "mixture": {}, "recall": {}}
    for key, value in values.items():
        setting_value(cfg, key)  # known?
        section, _, name = key.partition(".")
        changes[section][name] = value
    if changes["mixture"]:
        changes["generation"]["mixture"] = dataclasses.replace(cfg.generation.mixture, **changes["mixture"])
    return (dataclasses.replace(cfg.generation, **changes["generation"]),
            dataclasses.replace(cfg.memory.autoregressive_recall, **changes["recall"]))


def configured_backend(cfg: Config) -> str:
    """The backend the configured model runs on: "transformers" or "llamacpp" (`models.load.resolve_backend`)."""
    return resolve_backend(load_options(cfg), cfg.model.path)


def load_options(cfg: Config) -> LoadOptions:
    """How the configured model loads (`models.load_model`): the `model` keys, the memory encoder's `memory` keys,
    and the capabilities the configured decoders need (so `auto` picks a backend that runs them)."""
    m, mem, gen = cfg.model, cfg.memory, cfg.generation
    needs = frozenset(c for c, on in ((LAYERS, gen.entropy_decoding is not None), (MIXTURE, gen.mixture.enabled),
                                      (GUIDANCE, gen.guidance_scale != 1)) if on)
    if ValueKind.parse("tokens" if mem.values == "auto" else mem.values).kind in ("state", "hidden"):
        needs |= {STATES}  # (hidden states of the model's layers: transformers)
    return LoadOptions(backend=m.backend, adapter=m.adapter, device=m.device, dtype=m.dtype, quantize=m.quantize,
                       values=mem.values, keys=None if mem.key_encoder == "none" else mem.key_encoder,
                       hidden_state=mem.hidden_state, gguf_type=m.gguf_type, gguf_context=m.gguf_context, needs=needs)

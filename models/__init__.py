"""Models: loading the embedded default, local causal LMs, Qwen3-VL and PEFT adapters, with their memory encoder."""

from models.encoder import HiddenStateSpec, MemoryEncoder, MemoryProjector, build_bank
from models.loading import (
    EMBEDDED_NAME, MEMORY_PAD, RECALL, RECALL_ADAPTER, RECALL_END, LoadedModel, SpecialTokens, embedded_model_dir,
    ensure_special_tokens, load_model,
)

__all__ = ["EMBEDDED_NAME", "MEMORY_PAD", "RECALL", "RECALL_ADAPTER", "RECALL_END", "HiddenStateSpec", "LoadedModel",
           "MemoryEncoder", "MemoryProjector", "SpecialTokens", "build_bank", "embedded_model_dir",
           "ensure_special_tokens", "load_model"]

"""Decoding: the recall generation loop, its settings, and the memory head."""

from decoding.compat import custom_generate
from decoding.events import DoneEvent, FinishEvent, GenerationResult, RecallEvent, TokenEvent
from decoding.loop import generate, stream_generate
from decoding.memory import MemorySelector, memory_embedding, memory_head
from decoding.settings import (
    GenerationSettings,
    RecallSettings,
    build_logits_processor,
    build_stopping_criteria,
    make_memory_warper,
)

__all__ = [
    "DoneEvent", "FinishEvent", "GenerationResult", "GenerationSettings", "MemorySelector", "RecallEvent",
    "RecallSettings", "TokenEvent", "build_logits_processor", "build_stopping_criteria", "custom_generate",
    "generate", "make_memory_warper", "memory_embedding", "memory_head", "stream_generate",
]

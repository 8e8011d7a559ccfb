"""Decoding: the recall generation loop, its settings, the memory head, and the seeds' API."""

from decoding.events import DoneEvent, FinishEvent, GenerationResult, RecallEvent, TokenEvent
from decoding.loop import generate, stream_generate
from decoding.request import Controls, Prompt
from decoding.memory import MemorySelector, Recall, inject_memories
from decoding.sampling import sample
from decoding.mixture import generate_mixture, stream_mixture
from decoding.seed_api import OptimalSpeculativeDecoder, custom_generate, memory_embedding, memory_head
from decoding.processors import NegativePrompt, build_logits_processor, build_stopping_criteria, make_memory_warper
from decoding.settings import GenerationSettings, MixtureSettings, RecallSettings

__all__ = [
    "Controls",
    "Prompt",
    "DoneEvent",
    "FinishEvent",
    "GenerationResult",
    "GenerationSettings",
    "MemorySelector",
    "MixtureSettings",
    "NegativePrompt",
    "OptimalSpeculativeDecoder",
    "Recall",
    "RecallEvent",
    "RecallSettings",
    "TokenEvent",
    "build_logits_processor",
    "build_stopping_criteria",
    "custom_generate",
    "generate",
    "generate_mixture",
    "inject_memories",
    "make_memory_warper",
    "memory_embedding",
    "memory_head",
    "sample",
    "stream_generate",
    "stream_mixture",
]

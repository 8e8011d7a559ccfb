"""The seeds' function signatures (seed 000, section 1; seed 001, section 4.1), over the loop."""

from __future__ import annotations

from typing import Any, Mapping

from decoding.loop import generate
from decoding.settings import GenerationSettings, RecallSettings, build_logits_processor


def recall_settings_from_config(config: Mapping[str, Any]) -> RecallSettings:
    """`config["memory"]["autoregressive_recall"]` of the seed's config dict (missing keys: defaults)."""
    section = dict((config or {}).get("memory", {}).get("autoregressive_recall", {}))
    known = RecallSettings.__dataclass_fields__
    return RecallSettings(**{k: v for k, v in section.items() if k in known})


def custom_generate(
    model, processor, memory_db, recall_token_ids, config, inputs, max_new_tokens: int,
    stopping_criteria, logits_processor, temperature: float, top_k: int, top_p: float, do_sample: bool,
    pad_token_id: int, eos_token_id: int, interrupt_event, early_stop_on_tool_call: bool,
):
    """Seed 000's `custom_generate`: the caller's processors, then temperature/top-k/top-p warpers.

    Returns `input_ids` [B, L], or `(input_ids, positions)` when memories were injected, where
    `positions` lists `(token_position, similarity)` (with batch > 1: `(row, token_position, similarity)`).
    """
    settings = GenerationSettings(
        do_sample=do_sample, temperature=float(temperature), top_k=int(top_k or 0), top_p=float(top_p),
        max_new_tokens=int(max_new_tokens), early_stop_on_tool_call=bool(early_stop_on_tool_call))
    input_ids = inputs["input_ids"]
    warpers = build_logits_processor(settings, eos_token_id=eos_token_id, prompt_ids=input_ids,
                                     device=input_ids.device, vocab_size=model.get_output_embeddings().weight.shape[0])
    processors = type(warpers)([*(logits_processor or []), *warpers])
    tokenizer = getattr(processor, "tokenizer", processor)
    result = generate(
        model, inputs, settings, recall=recall_settings_from_config(config), recall_token_ids=recall_token_ids,
        memory_db=memory_db, tokenizer=tokenizer, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        logits_processor=processors, stopping_criteria=stopping_criteria, interrupt_event=interrupt_event)
    if not result.injections:
        return result.sequences
    if result.sequences.shape[0] == 1:
        return result.sequences, [(r.position, r.score) for r in result.injections]
    return result.sequences, [(r.row, r.position, r.score) for r in result.injections]

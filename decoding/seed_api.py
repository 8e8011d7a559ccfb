"""The seeds' signatures, kept public: `custom_generate`, `memory_head`, `memory_embedding` (seed 000)
over the loop of this package, and seed 003's `OptimalSpeculativeDecoder` (now exact)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from decoding.loop import generate
from decoding.request import Controls
from decoding.memory import Recall
from decoding.mixture import OptimalSpeculativeDecoder  # noqa: F401  (seed 003's class, public here)
from decoding.processors import build_logits_processor
from decoding.settings import GenerationSettings, RecallSettings

# What the seed's code reads when `config["memory"]["autoregressive_recall"]` leaves a key out.
SEED_RECALL_DEFAULTS = {"enabled": False, "top_k": 5, "temperature": 1.0, "top_p": 1.0, "use_sampling": True,
                        "debug": False}


def recall_settings_from_config(config: Mapping[str, Any] | None) -> RecallSettings:
    """`config["memory"]["autoregressive_recall"]` of the seed's config dict, missing keys at the seed's defaults."""
    section = dict((config or {}).get("memory", {}).get("autoregressive_recall", {}))
    unknown = set(section) - set(SEED_RECALL_DEFAULTS)
    if unknown:
        raise ValueError(f"config['memory']['autoregressive_recall'] has unknown keys {sorted(unknown)}; "
                         f"known: {sorted(SEED_RECALL_DEFAULTS)}")
    return RecallSettings(**{**SEED_RECALL_DEFAULTS, **section})


def memory_head(query_vector: torch.Tensor, memory_db, debug: bool = False):
    """Like `lm_head` over the bank: (logits = similarities of every memory [N], candidates best first)."""
    candidates = memory_db.search(query_vector.detach().float().cpu(), top_k=len(memory_db), debug=debug)
    logits = torch.tensor([c["score"] for c in candidates], dtype=torch.float32, device=query_vector.device)
    return logits, candidates


def memory_embedding(memory_vector: torch.Tensor, model, device=None, dtype=None) -> torch.Tensor:
    """A memory vector as a `[1, 1, H]` input embedding on the model's device and dtype."""
    while memory_vector.dim() < 3:
        memory_vector = memory_vector.unsqueeze(0)
    if device is None or dtype is None:
        param = next(model.parameters())
        device = param.device if device is None else device
        dtype = param.dtype if dtype is None else dtype
    return memory_vector.to(device=device, dtype=dtype)


@dataclass
class EntropyGenerateOutput:
    """`custom_generate(..., return_dict_in_generate=True)`: seed 002's `GenerateDecoderOnlyOutput` fields.

    Each `entropy_*` field is a tuple over the generated steps: `[B]` layer indices (0..L-1, set
    whenever entropy decoding is on), `[B, L]` argmax of each layer's raw logits and `[B]` decoded
    tokens (those two with `entropy_record_tokens=True`); None where not recorded. Not a seed field,
    `normalised_entropies` has each layer's entropy per step in the seed's unit: bits over log2 V.
    """

    sequences: torch.LongTensor  # [B, prompt + new]
    entropy_selected_layer_indices: tuple[torch.LongTensor, ...] | None = None
    entropy_per_layer_token_ids: tuple[torch.LongTensor, ...] | None = None
    entropy_selected_token_ids: tuple[torch.LongTensor, ...] | None = None
    recall_positions: list[tuple] | None = None  # what the plain call returns as its second value, None without
    normalised_entropies: tuple[torch.Tensor, ...] | None = None  # [B, L] per step, H / log2 V (not a seed field)


def custom_generate(
    model, processor, memory_db, recall_token_ids, config, inputs, max_new_tokens: int,
    stopping_criteria, logits_processor, temperature: float | None, top_k: int | None, top_p: float | None,
    do_sample: bool | None, pad_token_id: int, eos_token_id: int, interrupt_event, early_stop_on_tool_call: bool,
    *, entropy_decoding: str | None = None, entropy_record_tokens: bool = False, return_dict_in_generate: bool = False,
    num_beams: int | None = None, num_beam_groups: int | None = None, diversity_penalty: float | None = None,
):
    """Seed 000's `custom_generate`: the caller's processors, then temperature/top-k/top-p warpers.

    Token parameters given as None come from `config["generation"]`, as the seed reads them.
    Returns `input_ids` [B, L], or `(input_ids, positions)` when memories were injected, where
    `positions` lists `(token_position, similarity)` (with batch > 1: `(row, token_position, similarity)`),
    in the order of the injections. `early_stop_on_tool_call` ends a row once it closes a tool call;
    the other rows go on.

    Seed 002's keywords: `entropy_decoding` ("trough" | "random_after") decodes each step from an
    intermediate layer chosen by entropy; with `return_dict_in_generate=True` the call returns an
    `EntropyGenerateOutput` instead (sequences and the seed's `entropy_*` fields). The caller's
    `logits_processor` then scores every row once per layer ([B*L] rows a step).

    `num_beams`, `num_beam_groups` and `diversity_penalty` (keywords, or `config["generation"]`) are
    refused unless off: no beam search, so no `HammingDiversityLogitsProcessor` (`GenerationSettings`).
    """
    generation = dict((config or {}).get("generation", {}))
    pick = lambda value, key, default: value if value is not None else generation.get(key, default)  # noqa: E731
    settings = GenerationSettings(
        do_sample=bool(pick(do_sample, "do_sample", False)), temperature=float(pick(temperature, "temperature", 1.0)),
        top_k=int(pick(top_k, "top_k", 0) or 0), top_p=float(pick(top_p, "top_p", 1.0)),
        max_new_tokens=int(max_new_tokens), early_stop_on_tool_call=bool(early_stop_on_tool_call),
        entropy_decoding=entropy_decoding, entropy_record_tokens=bool(entropy_record_tokens),
        num_beams=pick(num_beams, "num_beams", 1), num_beam_groups=pick(num_beam_groups, "num_beam_groups", 1),
        diversity_penalty=pick(diversity_penalty, "diversity_penalty", 0.0))
    recall_settings = recall_settings_from_config(config)
    recall = None
    if recall_settings.enabled:
        recall = Recall.from_token_ids(recall_token_ids or {}, memory_db, recall_settings)
    input_ids = inputs["input_ids"]
    vocab = model.get_output_embeddings().weight.shape[0]
    warpers = build_logits_processor(settings, eos_token_id=eos_token_id, prompt_ids=input_ids, vocab_size=vocab)
    processors = type(warpers)([*(logits_processor or []), *warpers])
    tokenizer = getattr(processor, "tokenizer", processor)
    result = generate(model, inputs, settings, recall=recall, tokenizer=tokenizer, interrupt=interrupt_event,
                      controls=Controls(logits_processor=processors, stopping_criteria=stopping_criteria,
                                        eos_token_id=eos_token_id, pad_token_id=pad_token_id))
    positions = None
    if result.injections:
        single = result.sequences.shape[0] == 1
        positions = [(r.position, r.score) if single else (r.row, r.position, r.score) for r in result.injections]
    if return_dict_in_generate:
        return _entropy_output(result, positions)
    return result.sequences if positions is None else (result.sequences, positions)


def _entropy_output(result, positions) -> EntropyGenerateOutput:
    """The result as seed 002's output: per-step tuples of the trace's [B, steps, ...] tensors."""
    trace = result.entropy
    steps = (lambda t: None if t is None else tuple(t.unbind(dim=1)))  # noqa: E731
    if trace is None:
        return EntropyGenerateOutput(result.sequences, recall_positions=positions)
    return EntropyGenerateOutput(result.sequences, steps(trace.selected_layer_indices), steps(trace.per_layer_token_ids),
                                 steps(trace.selected_token_ids), positions, steps(trace.normalised_entropies))

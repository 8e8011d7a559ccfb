"""`ModelSpec`: what the engine and the chat read of a model, resolved once, by the backend that loaded it.

A transformers model's spec comes from its config (`transformers_spec`); a GGUF on llama.cpp gives its
own (`models.llamacpp.LlamaCppModel.spec`). Everything else reads the spec, never the model's config.

Capabilities name what a backend can run beyond one unpadded row of plain decoding; which decoder needs
which is `decoding.backend.NEEDS`, where every refusal is made from.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from models.modeling import unwrap_model

# What a backend can run (decoding/backend.py says which request needs which).
ROWS = "rows"  # a padded batch of rows in one request
LAYERS = "layers"  # every decoder layer's hidden state in one forward (entropy decoding)
GUIDANCE = "guidance"  # a second, unconditional forward of the model (classifier-free guidance)
MIXTURE = "mixture"  # the two-model mixture (both models, PEFT's adapter switched per forward)
COMPILE = "compile"  # the compiled decode step on a static cache
STATES = "states"  # hidden states of a memory's own text at any layer (`state` / `hidden:L` memory values)
TRANSFORMERS = frozenset({ROWS, LAYERS, GUIDANCE, MIXTURE, COMPILE, STATES})
# The configuration key that switches a capability on, for the model's whole life (`LoadOptions.needs`).
SETTING = {LAYERS: "generation.entropy_decoding", GUIDANCE: "generation.guidance_scale",
           MIXTURE: "generation.mixture.enabled"}


@dataclass(frozen=True)
class ModelSpec:
    """What a loaded model is, for the engine and the chat."""

    backend: str  # "transformers" | "llamacpp"
    hidden_size: int
    vocab_size: int  # the logits' width: the tokenizer's tokens, the recall tokens included
    context: int | None  # the most positions one conversation may hold (None: no limit known)
    eos_token_ids: tuple[int, ...]  # the tokens that end an answer (with its chat template: `LoadedModel`)
    pad_token_id: int | None
    capabilities: frozenset[str]

    def can(self, capability: str) -> bool:
        return capability in self.capabilities

    def check_bank(self, bank, query=None) -> None:
        """Refuse a memory bank whose values do not fit this model's hidden size, or whose keys the `<recall>`
        state cannot query when no `query` maps it (a bank keyed by text embeddings)."""
        if not bank.token_values and bank.value_dim != self.hidden_size:  # (token ids: the model embeds them)
            raise ValueError(
                f"memory bank has value vectors of dimension {bank.value_dim}, but the model's hidden size "
                f"is {self.hidden_size}: build the bank with this model (or load the model the bank was "
                "built with)"
            )
        if query is None and bank.dim != self.hidden_size:
            raise ValueError(f"memory bank has keys of dimension {bank.dim} (text embeddings) but no query maps the "
                             f"<recall> state (dimension {self.hidden_size}) to them: give Recall(query=...)")


def transformers_spec(model: nn.Module) -> ModelSpec:
    """The spec of a transformers causal LM (PEFT-wrapped or not), from its config and generation config."""
    base = unwrap_model(model)
    text = base.config.get_text_config(decoder=True)
    eos = base.generation_config.eos_token_id
    eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    pad = base.generation_config.pad_token_id
    context = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    return ModelSpec("transformers", text.hidden_size, text.vocab_size, context, eos, None if pad is None else int(pad),
                     TRANSFORMERS)


def turn_opener(tokenizer) -> int | None:
    """The special token that opens a turn in the tokenizer's chat template (ChatML's `<|im_start|>`, Llama 3's
    `<|start_header_id|>`): the first token of its generation prompt, when that is a special token; None without a
    template or such a token. A model that writes it in an answer is writing the next turn itself (SmolLM2-135M
    answered a 9,000-character message with "<|im_start|>user\nYou've already solved the problem."): it ends the
    answer (Ollama's ChatML models stop at it too)."""
    turn = [{"role": "user", "content": "x"}]
    try:
        without = tokenizer.apply_chat_template(turn, add_generation_prompt=False, tokenize=False)
        prompt = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - no chat template (or one that needs more): no opener known
        return None
    if not (isinstance(prompt, str) and isinstance(without, str)) or not prompt.startswith(without) \
            or prompt == without:
        return None
    ids = tokenizer(prompt[len(without):], add_special_tokens=False)["input_ids"]
    return int(ids[0]) if ids and ids[0] in tokenizer.all_special_ids else None

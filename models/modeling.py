"""What the loop needs to know about a transformers model, through transformers' own accessors.

`base_model` is the backbone that returns the normalised `last_hidden_state` (LlamaModel,
GPT2Model, Qwen3VLModel, ...), `get_output_embeddings()` the output head, `get_decoder()` the
text decoder whose layer list the encoder and entropy decoding walk. `head_logits` applies the
model's own final processing after the head (Gemma-2/3 soft-capping, logit scaling), exactly as
its `forward` does, so the loop's logits equal `model(...).logits`.
"""

from __future__ import annotations

import torch
from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model under PEFT and (Distributed)DataParallel wrappers.

    PEFT injects its adapter layers in place, so the unwrapped model still runs them.
    """
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
            model = model.get_base_model()
        else:
            return model


def shared_weights(model: nn.Module, but: frozenset[int] | set[int] = frozenset()) -> dict[int, object]:
    """A `copy.deepcopy` memo under which the copy shares `model`'s parameters (but those whose id is in `but`), and
    with them the joined weights of its fused groups (`decoding.fused.FusedPart._whole`: not registered parameters,
    so a plain deep copy would copy them apart from the parts that are views of them)."""
    memo: dict[int, object] = {id(p): p for p in model.parameters() if id(p) not in but}
    for m in model.modules():
        whole = getattr(m, "_whole", None)
        if isinstance(whole, list) and id(getattr(m, "weight", None)) in memo:
            memo[id(whole)] = whole
    return memo


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(backbone returning the normalised `last_hidden_state`, output head)."""
    base = unwrap_model(model)
    backbone = base.base_model
    if backbone is base:
        raise ValueError(f"{type(base).__name__} has no separate backbone: expected a causal LM with a head "
                         "(e.g. LlamaForCausalLM, GPT2LMHeadModel, Qwen3VLForConditionalGeneration)")
    return backbone, base.get_output_embeddings()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The text decoder's list of layers (`layers` for most models, `h` for GPT-2)."""
    decoder = unwrap_model(model).get_decoder()
    for name in ("layers", "h", "block", "blocks"):
        layers = getattr(decoder, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the decoder layers of {type(decoder).__name__}: "
                     "expected a ModuleList named layers, h, block or blocks")


def final_norm(model: nn.Module) -> nn.Module:
    """The decoder's final norm (applied to the last layer's output before the head)."""
    decoder = unwrap_model(model).get_decoder()
    for name in ("norm", "ln_f", "final_layernorm", "final_layer_norm"):
        norm = getattr(decoder, name, None)
        if isinstance(norm, nn.Module):
            return norm
    raise ValueError(f"cannot find the final norm of {type(decoder).__name__}")


def head_logits(model: nn.Module, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits [..., V] of normalised hidden states [..., H], with the model's final processing."""
    logits = head(hidden).float()
    config = unwrap_model(model).config.get_text_config(decoder=True)
    scale = getattr(config, "logits_scaling", None)  # Granite divides
    if scale:
        logits = logits / scale
    scale = getattr(config, "logit_scale", None)  # Cohere multiplies
    if scale:
        logits = logits * scale
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma-2/3
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def hidden_size(model: nn.Module) -> int:
    return unwrap_model(model).config.get_text_config(decoder=True).hidden_size


def max_positions(model: nn.Module) -> int | None:
    """The model's context length (`max_position_embeddings`, `n_positions` for GPT-2), if it has one."""
    config = unwrap_model(model).config.get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def is_peft(model: nn.Module) -> bool:
    """A PEFT model (its adapter can be switched off)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def adapter_merged(model: nn.Module) -> bool:
    """Whether a PEFT model's adapter is merged into its base weights (False for other models)."""
    if not is_peft(model):
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(m.merged for m in model.modules() if isinstance(m, BaseTunerLayer))


def set_adapter_merged(model: nn.Module, merged: bool) -> None:
    """Merge a PEFT model's adapter into its base weights (inference at the base model's speed: PEFT's
    trainable-tokens layer otherwise copies the whole embedding on every forward) or unmerge it (needed
    to switch it off for one forward, as the two-model mixture does). Nothing for other models."""
    if not is_peft(model):
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    states = [m.merged for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if merged and not all(states):
        model.merge_adapter()
    elif not merged and any(states):
        model.unmerge_adapter()

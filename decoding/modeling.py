"""What the loop needs to know about a transformers model: its backbone, head and embeddings."""

from __future__ import annotations

import torch


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under PEFT and (Distributed)DataParallel wrappers (seed 000, 4.1).

    PEFT injects its adapter layers in place, so the unwrapped model still runs them.
    """
    while True:
        if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            model = model.module
        elif hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
            model = model.get_base_model()
        else:
            return model


def backbone_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(backbone returning the normalised `last_hidden_state`, `lm_head`)."""
    base = unwrap_model(model)
    return base.model, base.get_output_embeddings()


def hidden_size(model: torch.nn.Module) -> int:
    config = unwrap_model(model).config
    return getattr(config, "text_config", config).hidden_size


def check_bank_dim(model: torch.nn.Module, dim: int) -> None:
    """Refuse a memory bank whose vectors do not fit the model's hidden size."""
    expected = hidden_size(model)
    if dim != expected:
        raise ValueError(
            f"memory bank has vectors of dimension {dim}, but the model's hidden size is {expected}: "
            "build the bank with this model (or load the model the bank was built with)"
        )

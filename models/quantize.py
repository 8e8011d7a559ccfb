"""Optional int8 quantization for the CPU decode path (`model.quantize: int8`), with torchao.

Every linear layer (the `lm_head` included) gets int8 weights, one scale per output channel, and
its input is quantized to int8 per token on the fly (torchao's `Int8DynamicActivationInt8Weight`),
so the compiled decode step runs int8 matrix products. A recall adapter is merged into the weights
first. It changes the numbers (bench/generate.py reports by how much), so the exactness tests run
on the fp32 path. Weight-only int8 (`Int8WeightOnly`) kept the numbers closer but decoded twice
as slowly as fp32 here, and is not offered.
"""

from __future__ import annotations

import logging

import torch

from models.modeling import is_peft

QUANTIZE = ("none", "int8")


def hush_torchao_import() -> None:
    """Drop what importing torchao logs on every start. transformers imports torchao whenever it is
    installed, int8 or not (its torchao quantizer, when `transformers.modeling_utils` is first imported),
    and torchao 0.18 then logs the CUDA kernel libraries it cannot load ("Failed to load ..._C_mxfp8...so")
    and torch warns that torchao registers enums with pytree; none of it concerns the int8 used here."""
    logging.getLogger("torchao").addFilter(lambda r: not r.getMessage().startswith("Failed to load "))
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda r: not (str(r.msg).startswith("%s is an Enum subclass")
                       and getattr(r.args[0] if r.args else None, "__module__", "").startswith("torchao")))


class Int8Linear(torch.nn.Linear):
    """A linear layer with torchao int8 weights that feeds them a 2-D input. torch 2.13's inductor
    miscompiles torchao's int8 linear on a [1, 1, K] input (one row, one position: every decode
    step of one answer) into wrong numbers, while [1, K], [2, 1, K] and [1, 2, K] come out right
    and eager is right: tests/models/test_quantize.py checks the compiled step against eager."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


def int8(model: torch.nn.Module) -> torch.nn.Module:
    """`model` quantized in place, its PEFT adapter merged into the weights for good: the plain model."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model = model.merge_and_unload() if is_peft(model) else model  # (PEFT skips the layers merged already)
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = Int8Linear
    return model


def quantize_int8(lm) -> None:
    """Quantize a `LoadedModel` in place (its adapter merged into the weights for good)."""
    lm.model, lm.merge_adapter, lm.quantized = int8(lm.model), False, "int8"
    lm.name = f"{lm.name} · int8"

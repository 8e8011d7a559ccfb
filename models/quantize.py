"""Optional int8 quantization for the CPU decode path (`model.quantize: int8`), with torchao.

Every linear layer (the `lm_head` included) gets int8 weights, one scale per output channel, and
its input is quantized to int8 per token on the fly (torchao's `Int8DynamicActivationInt8Weight`),
so the compiled decode step runs int8 matrix products. A recall adapter is merged into the weights
first. It changes the numbers (bench/generate.py reports by how much), so the exactness tests run
on the fp32 path. Weight-only int8 (`Int8WeightOnly`) kept the numbers closer but decoded twice
as slowly as fp32 here, and is not offered.
"""

from __future__ import annotations

from decoding.modeling import is_peft

QUANTIZE = ("none", "int8")


def quantize_int8(lm) -> None:
    """Quantize a `LoadedModel` in place (its adapter merged into the weights for good)."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model = lm.model.merge_and_unload() if is_peft(lm.model) else lm.model
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    lm.model, lm.merge_adapter, lm.quantized = model, False, "int8"
    lm.name = f"{lm.name} · int8"

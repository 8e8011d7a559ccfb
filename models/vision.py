"""Qwen3-VL inputs without torchvision: image processor, chat template, placeholder expansion.

`AutoProcessor` for Qwen3-VL needs torchvision (its video processor), which does not work on
every machine, so the pieces are put together here: transformers' PIL image processor, a
ChatML template that places `<|vision_start|><|image_pad|><|vision_end|>` for each image, and
the expansion of every `<|image_pad|>` to as many copies as the image has merged patches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
from PIL import Image
from transformers import PreTrainedTokenizerBase
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"

# ChatML with image parts; message content is a string or a list of {"type": "text"|"image"}.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def load_image_processor(folder: str | Path | None = None, **overrides: Any) -> Qwen2VLImageProcessorPil:
    """Qwen3-VL's image processor settings (patch 16, merge 2, temporal 2), from the checkpoint when it has them."""
    kwargs: dict[str, Any] = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
                              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = Path(folder) / name if folder is not None else None
        if path is not None and path.is_file():
            saved = json.loads(path.read_text())
            saved = saved.get("image_processor", saved)
            for key in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std", "size"):
                if key in saved:
                    kwargs[key] = saved[key]
            break
    kwargs.update(overrides)
    return Qwen2VLImageProcessorPil(**kwargs)


def ensure_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE


def open_image(path_or_image: str | Path | Image.Image) -> Image.Image:
    if isinstance(path_or_image, Image.Image):
        return path_or_image.convert("RGB")
    try:
        with Image.open(path_or_image) as im:
            return im.convert("RGB")
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read image {str(path_or_image)!r}: {e}") from e


def encode_with_images(
    tokenizer: PreTrainedTokenizerBase,
    image_processor: Qwen2VLImageProcessorPil,
    text: str,
    images: Sequence[str | Path | Image.Image] = (),
) -> dict[str, torch.Tensor]:
    """Tokenize `text` (one `<|image_pad|>` per image) and expand the pads to the image sizes.

    Returns `input_ids`, `attention_mask`, `mm_token_type_ids` ([1, L]) and, with images,
    `pixel_values` and `image_grid_thw`.
    """
    pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    n_pads = ids.count(pad_id)
    if n_pads != len(images):
        raise ValueError(f"the prompt has {n_pads} image placeholders but {len(images)} images were given")
    out: dict[str, torch.Tensor] = {}
    if images:
        pixels = image_processor([open_image(im) for im in images], return_tensors="pt")
        grid = pixels["image_grid_thw"]  # [n_images, 3]
        merge = image_processor.merge_size ** 2
        counts = iter((grid.prod(-1) // merge).tolist())
        expanded: list[int] = []
        for tid in ids:
            expanded.extend([pad_id] * next(counts) if tid == pad_id else [tid])
        ids = expanded
        out = {"pixel_values": pixels["pixel_values"], "image_grid_thw": grid}
    input_ids = torch.tensor([ids], dtype=torch.long)
    out["input_ids"] = input_ids
    out["attention_mask"] = torch.ones_like(input_ids)
    out["mm_token_type_ids"] = (input_ids == pad_id).to(torch.int32)
    return out

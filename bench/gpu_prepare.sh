#!/usr/bin/env bash
# Run here, before a GPU run: puts what the GPU machine lacks into artifacts/gpu/ (ignored by git; pass
# carry=["artifacts/gpu"] to the run): the embedded model's tokenizer files (3.5 MB) and the wheels of pytest,
# Pillow and pydantic (the GPU machine has torch, transformers, peft, sentence-transformers, safetensors, pyyaml,
# numpy; no pytest, Pillow, faiss, gradio, pydantic, gguf or llama-cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=/work/main/.venv/bin/python
mkdir -p artifacts/gpu/tokenizer artifacts/gpu/wheels
SRC=$(PYTHONPATH=. "$PY" -c "from models import embedded_model_dir; print(embedded_model_dir())")
cp "$SRC"/tokenizer.json "$SRC"/tokenizer_config.json "$SRC"/chat_template.jinja artifacts/gpu/tokenizer/ 2>/dev/null \
  || cp "$SRC"/tokenizer* artifacts/gpu/tokenizer/
# pytest for the gpu tests; Pillow and pydantic for the chat service (bench/gpu.py's sessions measure)
"$PY" -m pip download --quiet --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d artifacts/gpu/wheels pytest "pillow==12.3.0" "pydantic==2.14.4"
du -sh artifacts/gpu
ls artifacts/gpu/tokenizer artifacts/gpu/wheels

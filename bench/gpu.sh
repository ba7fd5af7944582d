#!/usr/bin/env bash
# The GPU benchmark: verify cost at Qwen3.6-27B layer sizes and decoding on the trained tiny pairs, one
# table, within 8 minutes. Needs a Python with torch (CUDA), transformers, safetensors, omegaconf:
#   PYTHON=/path/to/python bench/gpu.sh            (results also in bench/results/gpu.json)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec timeout 480 "${PYTHON:-python3}" -m bench.gpu "$@"

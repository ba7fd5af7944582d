#!/usr/bin/env bash
# The GPU benchmark: a whole DDTree round eager and compiled (CUDA graphs) and the verify cost at
# Qwen3.6-27B layer sizes, and decoding on the trained tiny pairs, one table, within 9 minutes. Needs a
# Python with torch (CUDA), transformers, safetensors, omegaconf:
#   PYTHON=/path/to/python bench/gpu.sh            (results also in bench/results/gpu.json)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec timeout 540 "${PYTHON:-python3}" -m bench.gpu "$@"

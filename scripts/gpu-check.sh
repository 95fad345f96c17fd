#!/usr/bin/env bash
# Checks the device worker on a machine with an NVIDIA GPU: builds it with `--features cuda`,
# runs the embedding parity test, the generation tests and the out-of-memory test on cuda:0, and
# prints the driver's memory figures. Needs the CUDA toolkit (nvcc) and a driver.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
command -v nvcc >/dev/null || { echo "nvcc not found: install the CUDA toolkit first" >&2; exit 1; }
scripts/fetch-models
export NOMAD_TEST_DEVICE=${NOMAD_TEST_DEVICE:-cuda:0}
# Unit tests of the models on the GPU; --include-ignored adds the accelerator-only ones
# (real CUDA out-of-memory, memory figures).
cargo test --release -p nomad-device-worker --features cuda -- models:: --include-ignored --nocapture 2>&1 \
  | grep -E '^test |test result|device memory|panicked|error' 

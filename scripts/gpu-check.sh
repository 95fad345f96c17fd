#!/usr/bin/env bash
# The device checks: builds the workers for the device, then runs model parity, the
# accelerator-only tests, out-of-memory halving through a real fleet, generation through a real
# fleet and the embed and generate benchmarks, all on that device. Prints one summary line per
# check (PASS, FAIL with the reason, or SKIP with why) and exits non-zero if any check failed.
#
#   scripts/gpu-check.sh [--device cuda:0 | cpu] [--out DIR]
#
# On an NVIDIA machine it needs the repository, a Rust toolchain and the CUDA toolkit (nvcc, and
# the driver's nvidia-smi); `--device cpu` runs the same checks on the CPU with the default build,
# as a dry run of the script. Logs and benchmark tables go to DIR (default gpu-check-results/).
set -uo pipefail
cd "$(dirname "$0")/.."

device=cuda:0
out=gpu-check-results
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=${2:?--device needs a value: cuda:N or cpu}; shift 2 ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    *) echo "unknown argument $1; usage: scripts/gpu-check.sh [--device cuda:N|cpu] [--out DIR]" >&2; exit 2 ;;
  esac
done
case "$device" in
  cpu) features=() ;;
  cuda:[0-9]*) features=(--features nomad-device-worker/cuda) ;;
  *) echo "--device must be cpu or cuda:N, not $device" >&2; exit 2 ;;
esac
mkdir -p "$out"
export NOMAD_TEST_DEVICE=$device
summary=()
failed=0

# check NAME COMMAND...: runs COMMAND with its output in $out/NAME.log and records one line.
check() {
  local name=$1; shift
  local started=$SECONDS
  if "$@" >"$out/$name.log" 2>&1; then
    summary+=("PASS $name ($((SECONDS - started)) s)")
  else
    local status=$?
    # The first error the log names, else its last line.
    local reason
    reason=$(grep -m 1 -E '^error|panicked at|command not found|FAILED' "$out/$name.log" ||
      tail -n 1 "$out/$name.log")
    summary+=("FAIL $name: exit $status after $((SECONDS - started)) s: $reason")
    failed=1
  fi
  echo "${summary[-1]}"
}
skip() { summary+=("SKIP $1: $2"); echo "${summary[-1]}"; }

toolkit() {
  nvcc --version && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
}
gpu_memory() {
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
}

if [ "$device" = cpu ]; then
  skip toolkit "a CPU dry run needs no CUDA toolkit"
else
  check toolkit toolkit
fi
check models scripts/fetch-models
check build cargo build --release --locked --workspace --bins "${features[@]}"
# Embedding parity with sentence-transformers, generation token parity and greedy agreement with
# llama.cpp, the decode loop's batching tests: the worker's model tests on the device.
check parity cargo test --release --locked -p nomad-device-worker "${features[@]}" -- models::
if [ "$device" = cpu ]; then
  skip accelerator "a real allocation failure and the driver's memory figures need an accelerator"
else
  # A real CUDA out-of-memory becomes the OOM outcome; loading shows in the driver's figures.
  check accelerator cargo test --release --locked -p nomad-device-worker "${features[@]}" -- \
    models:: --ignored --nocapture
fi
# A batch over the worker's memory budget fails as out of memory, the scheduler halves it,
# every request is served and the device's memory reaches nomad.device.memory.allocated.
# (The fleet tests run the service binaries the build step made, for the device.)
check oom-halving cargo test --release --locked -p nomad-integration-tests --test devices -- \
  --nocapture
[ "$device" = cpu ] || echo "nvidia-smi after the fleet test: $(gpu_memory)" >>"$out/oom-halving.log"
check generation cargo test --release --locked -p nomad-integration-tests --test generation
# Python models (the original's TorchModuleTool on torch from PyPI) in a model host on the
# device: parity with calling the class directly, faults, and on a GPU a real CUDA allocation
# failure halving the batch. Needs Python 3.12 (NOMAD_TEST_PYTHON312) and PyPI for torch.
check python-models cargo test --release --locked -p nomad-integration-tests --test model_host
if [ "$device" = cpu ]; then
  skip python-cuda-oom "a real CUDA allocation failure needs a GPU"
else
  check python-cuda-oom cargo test --release --locked -p nomad-integration-tests --test model_host \
    -- --ignored --nocapture
fi
check embed-bench target/release/nomad-embed-bench --seconds 3 --batch-size 128
check generate-bench target/release/nomad-generate-bench --concurrency 1,8

echo
echo "device $device:"
printf '  %s\n' "${summary[@]}"
grep -h "device memory" "$out"/*.log 2>/dev/null | sed 's/^/  /'
echo "  logs and benchmark tables: $out/"
exit $failed

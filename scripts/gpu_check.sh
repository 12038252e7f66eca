#!/usr/bin/env bash
# The accelerator check of issue 31 (docs/device.md): GPU tests, the default recipe on cuda against cpu, per-layer
# seconds on a 2-layer Qwen3-30B-A3B-shaped checkpoint, and `moecompress bench kernels`; one JSON summary on stdout.
# Usage: scripts/gpu_check.sh [--dry-run] [--device cuda:N] [--work-dir DIR]   (--dry-run: tiny sizes on the CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
# cuBLAS needs a fixed workspace for deterministic matrix products (torch.use_deterministic_algorithms).
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
exec python scripts/gpu_check.py "$@"

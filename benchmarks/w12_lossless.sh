#!/usr/bin/env bash
# Bench a W12 `final` engine and verify it by token forcing against its setting's `ar` oracle.
#   benchmarks/w12_lossless.sh <setting> [limit] [max_new_tokens] [gpu]
# Prints the engine id, the bench summary and the verify report (exit 1 on a real mismatch).
set -euo pipefail
setting=$1; limit=${2:-8}; tokens=${3:-256}; gpu=${4:-0}
sp() { python3 -m specpilot_build.cli "$@"; }
engine=$(sp engine build --setting "$setting" --arm final | awk '{print $1}')
echo "final engine $engine"
sp serve --engine "$engine" --port 30000 --gpu "$gpu"
trap 'sp stop --port 30000 >/dev/null 2>&1 || true' EXIT
sp bench --engine "$engine" --run "w12-$setting" --port 30000 --limit "$limit" --max-new-tokens "$tokens" --overwrite
sp stop --port 30000
sp verify "w12-$setting" --port 30001

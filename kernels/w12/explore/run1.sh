#!/bin/bash
# Device call 1 of 2026-12-01 (issue #18): GPU tests, the escape ablation, the e2e control. From the repo root.
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
PYTHONPATH=kernels timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -x tests/w12_kernel/test_w12_gpu.py 2>&1 | tail -15
date -u
(cd kernels && PYTHONUNBUFFERED=1 timeout 270 python3 -m w12.explore.escapes --out $OUT/escapes.json) > $OUT/escapes.log 2>&1
tail -3 $OUT/escapes.log; date -u
PYTHONUNBUFFERED=1 PYTHONPATH=kernels:runtimes/reference timeout 160 python3 benchmarks/qwen3_e2e.py --family normal \
    --control --out $OUT/qwen3_e2e_control.json > $OUT/e2e.log 2>&1
tail -25 $OUT/e2e.log; date -u

#!/bin/bash
# Device call 2 of 2026-12-01 (issue #18): GPU tests (escape chunks per step, x.T gathers), the escape arms. Repo root.
date -u
PYTHONPATH=kernels timeout 200 python3 -m pytest -q --noconftest -p no:cacheprovider tests/w12_kernel/test_w12_gpu.py 2>&1 | tail -8
date -u
(cd kernels && PYTHONUNBUFFERED=1 timeout 360 python3 -m w12.explore.escapes --out $OUT/escapes2.json) > $OUT/escapes2.log 2>&1
tail -3 $OUT/escapes2.log; date -u

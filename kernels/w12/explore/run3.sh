#!/bin/bash
# Device call 3 of 2026-12-01 (issue #18): GPU tests of the new escape options, the escape arms at M <= 16. Repo root.
date -u
PYTHONPATH=kernels timeout 100 python3 -m pytest -q --noconftest -p no:cacheprovider tests/w12_kernel/test_w12_gpu.py -k "early or escapes_gathered" 2>&1 | tail -4
date -u
(cd kernels && PYTHONUNBUFFERED=1 timeout 300 python3 -m w12.explore.escapes --ms 1,8,16 --out $OUT/escapes3.json) > $OUT/escapes3.log 2>&1
tail -3 $OUT/escapes3.log; date -u

export PYTHONUNBUFFERED=1 PYTHONPATH=kernels:runtimes/reference
date -u; git log -1 --format=%h 2>/dev/null
timeout 150 python3 -m pytest -q tests/test_runtime_fused.py > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
timeout 120 python3 benchmarks/decode_attention.py > $OUT/decode_attention.md 2>&1; cat $OUT/decode_attention.md
timeout 120 python3 benchmarks/qwen3_step_profile.py --layers 4 > $OUT/step_profile.md 2>&1; grep "###" $OUT/step_profile.md; date -u
timeout 220 python3 benchmarks/qwen3_e2e.py --family normal,student-t4,outliers --dense-fallback --out $OUT/e2e.json > $OUT/e2e.log 2>&1; grep "^| \|graph replay" $OUT/e2e.log | cut -c1-220; date -u
timeout 120 python3 benchmarks/qwen3_e2e.py --family student-t4,outliers --batches 16,32 --lm-head w12 --dense-fallback --out $OUT/e2e_lmhead.json > $OUT/e2e_lmhead.log 2>&1; grep "^| " $OUT/e2e_lmhead.log | cut -c1-220; date -u

export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader; date -u
PYTHONPATH=kernels:runtimes/reference timeout 120 python3 -m pytest -q tests/test_runtime_fused.py > $OUT/tests.log 2>&1; tail -4 $OUT/tests.log
PYTHONPATH=kernels:runtimes/reference timeout 150 python3 w12_carry/e2e_profile.py 4 > $OUT/profile.log 2>&1; tail -2 $OUT/profile.log; date -u
PYTHONPATH=kernels:runtimes/reference timeout 220 python3 benchmarks/qwen3_e2e.py --family normal,student-t4,outliers --dense-fallback --out $OUT/e2e.json > $OUT/e2e.log 2>&1; grep "^| \|graph replay" $OUT/e2e.log; date -u
PYTHONPATH=kernels:w12_carry/old/runtimes/reference timeout 90 python3 benchmarks/qwen3_e2e.py --family normal --dense-fallback --out $OUT/e2e_old.json > $OUT/e2e_old.log 2>&1; grep "^| " $OUT/e2e_old.log; date -u

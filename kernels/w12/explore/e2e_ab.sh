export PYTHONUNBUFFERED=1 PYTHONPATH=kernels:runtimes/reference
for arm in units rows o_rows; do
  case $arm in units) rows="";; rows) rows="10240,5120;5120,8192";; o_rows) rows="5120,8192";; esac
  E2E_ROWS="$rows" python3 w12_carry/e2e_layouts.py --family normal --dense-fallback --out $OUT/e2e_$arm.json > $OUT/e2e_$arm.log 2>&1
  echo "== $arm"; grep "layouts:" $OUT/e2e_$arm.log; grep "^| normal" $OUT/e2e_$arm.log
done

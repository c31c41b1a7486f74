#!/bin/bash
# device call of the qkv/o-units A/B: the hazard test's power (producer's griddepcontrol.wait removed), then the A/B
cd "$(dirname "$0")/../.." || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ -z "$SKIP_PROBE" ]; then
cp w12/csrc/w12_ws.cu /tmp/w12_ws_orig.cu
sed -i 's/^  grid_wait();$/  \/\/ hazard probe: no wait/' w12/csrc/w12_ws.cu
echo "probe lines: $(grep -c 'hazard probe' w12/csrc/w12_ws.cu)"
PYTHONPATH=. timeout 240 python3 -m pytest -q -p no:cacheprovider ../tests/w12_kernel/test_w12_ws.py -k chain 2>&1 | tail -25 | tee $OUT/hazard_probe.txt
cp /tmp/w12_ws_orig.cu w12/csrc/w12_ws.cu
PYTHONPATH=. timeout 240 python3 -m pytest -q -p no:cacheprovider ../tests/w12_kernel/test_w12_ws.py -k chain 2>&1 | tail -3 | tee -a $OUT/hazard_probe.txt
fi
PYTHONPATH=. PYTHONUNBUFFERED=1 python3 -m w12.explore.qkvo_units --deadline-s 330 --out $OUT/qkvo.json 2>&1 | tee $OUT/qkvo.log

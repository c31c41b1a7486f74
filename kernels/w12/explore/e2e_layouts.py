# qwen3_e2e.py with the layout table replaced by $E2E_ROWS's shapes as rows (the A/B of qkv/o layouts end to end)
import os, runpy, sys
import w12.format as fmt
table = dict(fmt._layout_table())
for key in filter(None, os.environ.get("E2E_ROWS", "").split(";")):
    table[tuple(int(v) for v in key.split(","))] = "rows"
fmt._layout_table = lambda: table
print("layouts:", table, flush=True)
sys.argv = ["benchmarks/qwen3_e2e.py"] + sys.argv[1:]
runpy.run_path("benchmarks/qwen3_e2e.py", run_name="__main__")

# qwen3_e2e.py with fused.py's torch path (the forward as before fused.py): the A/B's other arm
import runpy, sys
import specpilot_runtime.fused as fused
fused.triton = None
sys.argv = ["benchmarks/qwen3_e2e.py"] + sys.argv[1:]
runpy.run_path("benchmarks/qwen3_e2e.py", run_name="__main__")

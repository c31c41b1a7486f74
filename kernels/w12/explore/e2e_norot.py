# qwen3_e2e.py with fused.norm_rotate's torch path (the q/k norm and rotary as at 1ff79cf): the A/B's other arm
import runpy, sys
import specpilot_runtime.fused as fused
fused._rotation_fits = lambda *args: False
sys.argv = ["benchmarks/qwen3_e2e.py"] + sys.argv[1:]
runpy.run_path("benchmarks/qwen3_e2e.py", run_name="__main__")

"""Kernels of one decode step (graph replay) of the Qwen3 27B-shaped model with few layers: per-layer count and
time of each kernel, bf16 and W12 (+ fallback), to see where the shared part of the step goes."""
import sys, time, collections
sys.path.insert(0, "benchmarks")
import torch
from torch.profiler import profile, ProfilerActivity
from specpilot_runtime.qwen3 import Qwen3Shape
from specpilot_runtime.decode import DecodeStep, prefill
import qwen3_e2e as e

LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
torch.set_grad_enabled(False)
shape = Qwen3Shape(vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_layers=LAYERS,
                   num_heads=64, num_kv_heads=8, head_dim=128, max_positions=4096)
model = e.drawn_model(shape, "normal", 0, torch.device("cuda"))


def prof(label, batch):
    prompts = torch.randint(0, shape.vocab_size, (batch, 64), generator=torch.Generator().manual_seed(batch)).cuda()
    cache = model.new_cache(batch, 192)
    logits = prefill(model, prompts, cache)
    step = DecodeStep(model, cache, logits.argmax(-1), torch.full((batch,), 64, device="cuda"), True)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 20
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / n * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    stats = collections.defaultdict(lambda: [0, 0.0])
    for ev in p.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            s = stats[ev.name[:90]]
            s[0] += 1
            s[1] += ev.device_time
    total = sum(v[1] for v in stats.values()) / 5
    count = sum(v[0] for v in stats.values()) / 5
    print(f"\n== {label} batch {batch}: step {wall:.1f} us wall (graph), kernels {count:.0f} a step, "
          f"summed {total:.1f} us; gaps {wall - total:.1f} us")
    for name, (c, d) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        print(f"  {c / 5 / LAYERS:6.2f}/layer {d / c:8.2f} us avg {d / 5:9.1f} us/step  {name}")
    del step, cache


for b in (1, 16, 32):
    prof("bf16", b)
model.to_w12(dense_fallback=True)
for b in (1, 16, 32):
    prof("W12 + fallback", b)

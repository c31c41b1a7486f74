"""End to end, issue #18 item 4: the reference runtime greedy-decodes a Qwen3-shaped model at the seed's 27B
shapes with bf16 weights, then with the same weights in W12, the decode step replayed from a CUDA graph, at
batch 1, 8, 16 and 32; one table side by side (results in qwen3_e2e.md).

    PYTHONUNBUFFERED=1 PYTHONPATH=kernels:runtimes/reference python3 benchmarks/qwen3_e2e.py --family normal

`--family normal,student-t4,outliers` runs the families one after the other in one process (one model in
memory at a time), rows of all of them in one table. `smollm2-135m` (SmolLM2-135M's real matrices, each
projection from its own role, the embedding and lm_head from its tied embedding) reads its extract from
$W12_SMOLLM2 (made on CPU by `python -m specpilot_lab.w12_smollm2 --out PATH`; checked before anything runs).

27B shapes: hidden 5120, 64 layers, 64 query heads and 8 KV heads of 128 (qkv 10240x5120, o 5120x8192),
intermediate 17408 (gate_up 34816x5120, down 5120x17408), vocab 151936, untied lm_head. Weights are drawn on
the device from a specpilot_lab.w12_families family (no download), one seed per matrix; norm weights are 1. bf16 needs
about 57 GB. Each batch decodes --prompt-tokens random ids per sequence (seeded per batch, the same prompts
for both formats) and --new-tokens greedy tokens: the first from the prefill (eager), the rest one graph
replay each; tok/s counts the decode steps only, timed after warm-up steps. Then the 64 layers' 256
projections are encoded to W12 in place, layer by layer, each bf16 weight freed once encoded, and every
batch decodes again. The lm_head stays bf16 in both runs by default (--lm-head w12 encodes it too): the
comparison is of the 256 layer matrices, and the logits that decide a near tie come from the same kernel.

Tokens: per batch, how many sequences came out identical; for each that did not, its first divergence is
classified as verify classifies a token, from the bf16 run's logits at that token (same context in both runs up
to there): margin = bf16's top-1 logit minus its logit for W12's token, a near tie within verify's bf16
tolerance (2^-2), else a real difference (a token below bf16's top 2 has no kept logit: real).

`--control` decodes once more with the bf16 weights as an fp32 GEMM of the same values (every product exact,
summed in fp32 as the bf16 GEMM sums, in another kernel's order; eager steps) and classifies its divergences
from plain bf16 the same way: what a different summation order alone does to this model's tokens, beside what
W12's kernel does.

`--dense-fallback` keeps each layer's bf16 matrix beside its W12 form where the W12 GEMM falls back to cuBLAS
for some M bucket (w12.keep_dense; memory: bf16 + W12) and decodes every batch a third time with the fallback
on (the W12 run itself keeps it off): what W12 gives when it is never slower than cuBLAS per GEMM.

Before timing, each format checks that the graph-replayed steps give the eager steps' tokens and logits bit
for bit (8 tokens at the largest batch; printed, and in --out).

Needs torch (CUDA), triton, numpy and the w12 package only. `--device cpu` with small shapes checks the
whole path on a laptop (no graphs; W12 decodes the weights for F.linear there):

    PYTHONPATH=kernels:runtimes/reference python3 benchmarks/qwen3_e2e.py --device cpu --layers 2 \\
        --hidden 256 --intermediate 512 --heads 4 --kv-heads 2 --head-dim 64 --vocab 2048 \\
        --batches 1,4 --prompt-tokens 16 --new-tokens 16
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from specpilot_lab.decode import Decoded, divergences, greedy_decode
from specpilot_lab.qwen3 import Qwen3, Qwen3Shape
from specpilot_lab.w12_families import FAMILIES, draw
from specpilot_lab.w12_smollm2 import load_extract

START = time.perf_counter()


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device visible to torch {torch.__version__}")
    torch.set_grad_enabled(False)
    shape = Qwen3Shape(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_positions=max(4096, args.prompt_tokens + args.new_tokens),
    )
    say(f"{_device_name(device)}, torch {torch.__version__}; {shape}")
    prompts = {
        b: torch.randint(
            0, shape.vocab_size, (b, args.prompt_tokens), generator=torch.Generator().manual_seed(args.seed + b)
        )
        for b in args.batches
    }
    graph = not args.eager and device.type == "cuda"
    runs = [run_family(family, shape, prompts, args, device, graph) for family in args.family]
    rows = [row for run in runs for row in run.pop("rows")]
    print(table(rows))
    for run in runs:
        print(
            f"{run['family']}: W12 {run['w12_weight_bytes'] / 1e9:.2f} GB for bf16 "
            f"{run['bf16_weight_bytes'] / 1e9:.2f} GB, {run['w12_escapes']} escapes; graph replay equals "
            f"eager steps: {run['graph_equals_eager'] or 'not run (no graphs)'}"
        )
    print(
        f"lm_head {args.lm_head} in both runs; {args.prompt_tokens} prompt tokens, {args.new_tokens} new "
        f"tokens ({args.new_tokens - 1} timed decode steps after {args.warmup_steps} warm-up steps); "
        f"{'CUDA graphs' if graph else 'eager steps'}"
    )
    if args.out:
        record = {
            "device": _device_name(device),
            "torch": torch.__version__,
            "shape": shape.__dict__,
            "seed": args.seed,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "warmup_steps": args.warmup_steps,
            "lm_head": args.lm_head,
            "cuda_graphs": graph,
            "families": runs,
            "rows": rows,
            "seconds": time.perf_counter() - START,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        say(f"wrote {args.out}")


def run_family(family: str, shape: Qwen3Shape, prompts: dict, args, device: torch.device, graph: bool) -> dict:
    """Draw the model from `family`, decode every batch with bf16, encode to W12 in place, decode again."""
    model = drawn_model(shape, family, args.seed, device)
    bf16_bytes = _weight_bytes(model)
    largest = prompts[max(prompts)]
    checks = {"bf16": graph_check(model, largest)} if graph else {}
    bf16 = {b: decode(model, "bf16", p, args, graph) for b, p in prompts.items()}
    control = {}
    if args.control:
        with fp32_products(model):
            control = {b: decode(model, "control (fp32 GEMM)", p, args, False) for b, p in prompts.items()}
    plan = layer_plan(args.plan) if args.plan else None
    if plan is not None:
        kept = sorted(f"{k} ({c})" for k, v in plan["shapes"].items() for c in ("light", "heavy") if v[c] == "bf16")
        say(f"layer plan ({plan['tables']}, rows {plan['rows_per_forward']}): bf16 kept for {kept or 'no shape'}")
    say("encoding to W12 in place, layer by layer")
    model.to_w12(
        lm_head=args.lm_head == "w12",
        dense_fallback=args.dense_fallback,
        plan=plan,
        progress=lambda i: (
            (i + 1) % 16 == 0 and say(f"  W12: {i + 1}/{shape.num_layers} layers encoded{_memory(device)}")
        ),
    )
    _release_memory(device)
    w12_bytes, escapes, encoded = _w12_size(model)
    stored_bytes = sum(
        lin.packed.nbytes() if hasattr(lin, "packed") else lin.weight.numel() * 2 for _, lin in model.projections()
    )
    say(
        f"W12: {encoded} matrices, {w12_bytes / 1e9:.2f} GB; all weights as stored {stored_bytes / 1e9:.2f} GB "
        f"(bf16 {bf16_bytes / 1e9:.2f} GB), escapes {escapes}{_memory(device)}"
    )
    fallback = {}
    with fallback_off(model):
        if graph:
            checks["w12"] = graph_check(model, largest)
        w12 = {b: decode(model, "W12", p, args, graph) for b, p in prompts.items()}
    if args.dense_fallback:
        if graph:
            checks["w12_fallback"] = graph_check(model, largest)
        fallback = {b: decode(model, "W12 + bf16 fallback", p, args, graph) for b, p in prompts.items()}
    del model
    _release_memory(device)
    return {
        "family": family,
        "bf16_weight_bytes": bf16_bytes,
        "w12_weight_bytes": w12_bytes,
        "stored_weight_bytes": stored_bytes,
        "plan": plan,
        "w12_escapes": escapes,
        "w12_matrices": encoded,
        "graph_equals_eager": checks,
        "rows": [compare(family, b, bf16[b], w12[b], control.get(b), fallback.get(b)) for b in prompts],
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--family",
        default="normal",
        help=f"weight families, comma-separated, run one after the other ({', '.join(FAMILIES)})",
    )
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--intermediate", type=int, default=17408)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batches", default="1,8,16,32", help="comma-separated batch sizes")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--lm-head", choices=("bf16", "w12"), default="bf16")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (one launch at a time)")
    p.add_argument(
        "--control",
        action="store_true",
        help="also decode bf16 as an fp32 GEMM of the same weights (another summation order)",
    )
    p.add_argument(
        "--dense-fallback",
        action="store_true",
        help="keep bf16 copies where W12 falls back to cuBLAS; decode a third time with the fallback on",
    )
    p.add_argument(
        "--plan",
        metavar="ROWS",
        help="encode only the shapes the W12 layer plan stores in W12 (this GPU's tables; 'all' = every bucket "
        "up to 64 rows, else the rows per forward the plan serves); the rest stay bf16, no copy kept",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", help="write the rows and the run's settings to this JSON file")
    args = p.parse_args()
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches {args.batches!r}: expected comma-separated integers")
    args.family = args.family.split(",")
    for family in args.family:
        if family not in FAMILIES:
            p.error(f"--family {family!r}: expected one of {', '.join(FAMILIES)}")
    if "smollm2-135m" in args.family:
        try:
            load_extract()
        except (OSError, ValueError) as err:
            p.error(f"--family smollm2-135m: {err}")
    if min(args.batches) < 1 or args.new_tokens < 2 or args.prompt_tokens < 1:
        p.error("--batches must be >= 1, --new-tokens >= 2, --prompt-tokens >= 1")
    return args


def drawn_model(shape: Qwen3Shape, family: str, seed: int, device: torch.device) -> Qwen3:
    """The model with every matrix drawn from `family` on `device` (seed + a fixed offset per matrix)."""
    model = Qwen3(shape, torch.bfloat16, device)
    model.embed.copy_(draw(family, shape.vocab_size, shape.hidden_size, seed, device, role="embed"))
    model.lm_head.weight.copy_(draw(family, shape.vocab_size, shape.hidden_size, seed + 1, device, role="embed"))
    for i, (name, linear) in enumerate(model.projections()):
        linear.weight.copy_(draw(family, *linear.weight.shape, seed + 2 + i, device, role=name.rsplit(".", 1)[1]))
        if (i + 1) % 64 == 0:
            say(f"  drew {i + 1} matrices ({name}){_memory(device)}")
    _synchronize(device)
    say(f"drew {family} weights: {_weight_bytes(model) / 1e9:.2f} GB bf16{_memory(device)}")
    return model


def graph_check(model: Qwen3, prompts: torch.Tensor, new_tokens: int = 8) -> bool:
    """Whether replaying the captured step gives the eager step's tokens and logits, bit for bit."""
    eager = greedy_decode(model, prompts, new_tokens, graph=False, warmup_steps=0)
    graphed = greedy_decode(model, prompts, new_tokens, graph=True, warmup_steps=0)
    same = torch.equal(eager.tokens, graphed.tokens) and torch.equal(eager.top, graphed.top)
    say(f"graph replay equals eager steps (batch {prompts.shape[0]}, {new_tokens} tokens): {same}")
    _release_memory(model.device)
    return same


def decode(model: Qwen3, label: str, prompts: torch.Tensor, args, graph: bool) -> Decoded:
    result = greedy_decode(model, prompts, args.new_tokens, graph=graph, warmup_steps=args.warmup_steps)
    steps = args.new_tokens - 1
    say(
        f"{label} batch {prompts.shape[0]:2d}: {result.tokens_per_second:9.1f} tok/s, "
        f"{1e3 * result.seconds / steps:7.2f} ms/step ({'graph' if result.graphed else 'eager'})"
    )
    _release_memory(model.device)
    return result


@contextmanager
def fallback_off(model: Qwen3):
    """The W12 kernel for every M while inside (bf16 copies, where kept, stay in memory unused)."""
    packed = [layer.packed for _, layer in model.projections() if hasattr(layer, "packed")]
    kept = [p.dense_buckets for p in packed]
    for p in packed:
        p.dense_buckets = ()
    try:
        yield
    finally:
        for p, buckets in zip(packed, kept):
            p.dense_buckets = buckets


@contextmanager
def fp32_products(model: Qwen3):
    """Every layer projection as an fp32 GEMM of its bf16 values (TF32 off): the control's other summation order."""
    linears = [linear for _, linear in model.projections()]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    for linear in linears:
        linear.forward = lambda x, w=linear.weight: F.linear(x.float(), w.float()).to(x.dtype)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for linear in linears:
            del linear.forward


def compare(
    family: str,
    batch: int,
    bf16: Decoded,
    w12: Decoded,
    control: Decoded | None = None,
    fallback: Decoded | None = None,
) -> dict:
    """Speed and token identity of one batch; each divergence classified from the bf16 logits there."""
    diverged = divergences(bf16, w12)
    steps = bf16.tokens.shape[1] - 1
    reordered = divergences(bf16, control) if control is not None else None
    fell_back = divergences(bf16, fallback) if fallback is not None else None
    return dict(
        family=family,
        batch=batch,
        bf16_tok_s=bf16.tokens_per_second,
        w12_tok_s=w12.tokens_per_second,
        bf16_ms_step=1e3 * bf16.seconds / steps,
        w12_ms_step=1e3 * w12.seconds / steps,
        speedup=w12.tokens_per_second / bf16.tokens_per_second,
        identical=batch - len(diverged),
        diverged=len(diverged),
        near_ties=sum(d["near_tie"] for d in diverged),
        divergences=diverged,
        cuda_graphs=bf16.graphed and w12.graphed,
        control=None
        if reordered is None
        else dict(
            identical=batch - len(reordered),
            diverged=len(reordered),
            near_ties=sum(d["near_tie"] for d in reordered),
            divergences=reordered,
        ),
        fallback=None
        if fell_back is None
        else dict(
            tok_s=fallback.tokens_per_second,
            speedup=fallback.tokens_per_second / bf16.tokens_per_second,
            ms_step=1e3 * fallback.seconds / steps,
            identical=batch - len(fell_back),
            diverged=len(fell_back),
            near_ties=sum(d["near_tie"] for d in fell_back),
            divergences=fell_back,
            cuda_graphs=fallback.graphed,
        ),
    )


def table(rows: list[dict]) -> str:
    with_fallback = any(r.get("fallback") for r in rows)
    lines = [
        (
            "| family | batch | bf16 tok/s | W12 tok/s | speedup | bf16 ms/step | W12 ms/step "
            "| identical | diverged | near ties | control: identical | control: near ties |"
            + (" W12 + fallback tok/s | speedup | identical | near ties |" if with_fallback else "")
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        + ("---:|---:|---:|---:|" if with_fallback else ""),
    ]
    for r in rows:
        c, f = r["control"], r.get("fallback")
        shown = f"{c['identical']}/{r['batch']} | {c['near_ties']}/{c['diverged']}" if c else "– | –"
        if with_fallback:
            shown += (
                f" | {f['tok_s']:.1f} | {f['speedup']:.3f} | {f['identical']}/{r['batch']} "
                f"| {f['near_ties']}/{f['diverged']}"
                if f
                else " | – | – | – | –"
            )
        lines.append(
            f"| {r['family']} | {r['batch']} | {r['bf16_tok_s']:.1f} | {r['w12_tok_s']:.1f} "
            f"| {r['speedup']:.3f} | {r['bf16_ms_step']:.2f} | {r['w12_ms_step']:.2f} "
            f"| {r['identical']}/{r['batch']} | {r['diverged']} | {r['near_ties']}/{r['diverged']} "
            f"| {shown} |"
        )
    return "\n".join(lines)


def say(message: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s] {message}", flush=True)


def _weight_bytes(model: Qwen3) -> int:
    return sum(linear.weight.numel() * 2 for _, linear in model.projections())


def layer_plan(rows: str) -> dict:
    """The plan an engine on this GPU would ship (specpilot_build.assemble.w12_plan, from w12's own tables)."""
    from pathlib import Path

    import w12.gemm
    from specpilot_build.assemble.w12_plan import choose, read_table

    table = Path(w12.gemm.__file__).with_name(w12.gemm.TABLES["fallback"])
    rows_per_forward = None if rows == "all" else int(rows)
    speedups, classes = read_table(table)
    return choose(speedups, w12.gemm.TABLE_GPU, rows_per_forward, classes)


def _w12_size(model: Qwen3) -> tuple[int, int, int]:
    """(bytes, escapes, matrices) of the W12-encoded layer projections."""
    packed = [layer.packed for _, layer in model.projections() if hasattr(layer, "packed")]
    return sum(p.nbytes() for p in packed), sum(p.escapes for p in packed), len(packed)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


def _memory(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    return f" [GPU {torch.cuda.memory_allocated(device) / 1e9:.1f} GB, peak {torch.cuda.max_memory_allocated(device) / 1e9:.1f} GB]"


def _release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()

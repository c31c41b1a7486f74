"""The W12 layer plan of an engine: which weight shapes are stored in W12 and which stay bf16, chosen at build time.

A shape is stored in W12 only where the W12 GEMM was measured at least 10% faster than cuBLAS on bf16 in every M
bucket the setting serves (kernels/w12/fallback_<gpu>.json, the tables of the setting's GPU), per escape class: a weight
with many escapes (w12.gemm.heavy) is judged by the heavy measurements, so the loader decides it once encoded.
Everything else stays bf16, with no second copy: shapes the table does not have, and every shape when a forward
takes more than 64 rows (there W12 decodes the whole weight before cuBLAS: never faster). A device
without tables (the CPU, a GPU not yet measured) keeps W12 everywhere, untuned, and the plan says so. The plan is
written into the engine as kernels/w12/plan.json (so it is in the manifest and the id); W12's loaders read it
(kernels/w12/plan.py) and the runtime reports each layer's choice."""

from __future__ import annotations

import json
from pathlib import Path

BUCKETS = (8, 16, 32, 64)  # kernels/w12/gemm.py's M buckets
FUSED_MAX_M = 64
# W12 over cuBLAS in every served bucket, with a margin: the isolated GEMM measurement over-predicts end to end
# (smollm2-135m's gate_up and down measured 1.06 and 1.07 at M = 64 on the H100 and decoded at 0.973x of bf16 there)
THRESHOLD = 1.1
RATE_SLACK = 1.5  # a weight up to 1.5x its class's densest measured family's escape rate is taken as measured
PLAN_FILE = "plan.json"


def rows_per_forward(cfg: dict) -> int | None:
    """The most rows one target forward takes while decoding: requests x (1 + draft tokens); None when the
    setting leaves the draft length to the runtime's default (then every bucket up to 64 counts)."""
    requests = int(cfg["batching"]["max_running_requests"])
    drafter = cfg["drafter"]
    if drafter["algorithm"] == "none":
        return requests
    if cfg["runtime"]["name"] == "reference":
        draft = drafter.get("num_draft_tokens")
    else:
        from specpilot_build.assemble.launch import sglang_flags  # the lab imports this module without the build

        draft = sglang_flags(cfg).get("speculative-num-draft-tokens")
    return None if draft is None else requests * (1 + int(draft))


def served_buckets(rows: int | None) -> tuple[int, ...]:
    if rows is None:
        return BUCKETS
    return tuple(b for b in BUCKETS if b < rows) + tuple(b for b in BUCKETS if b >= rows)[:1]


Table = dict[tuple[int, int], dict[tuple[int, bool], float]]


def read_table(table_path: Path) -> tuple[Table, dict]:
    """fallback_<gpu>.json -> ({(N, K): {(bucket, heavy): W12 / cuBLAS}}, its "_classes": per escape class, the
    families measured and the most escapes per weight among them, times RATE_SLACK). Other "_" keys are comments."""
    entries = json.loads(table_path.read_text())
    table: Table = {}
    for key, entry in entries.items():
        if key.startswith("_"):
            continue
        parts = key.split(",")
        n, k, bucket = int(parts[0]), int(parts[1]), int(parts[2])
        table.setdefault((n, k), {})[(bucket, len(parts) == 4)] = float(entry["speedup"])
    classes = {
        cls: {"families": info["families"], "max_escape_rate": info["max_escape_rate"] * RATE_SLACK}
        for cls, info in entries.get("_classes", {}).items()
        if not cls.startswith("_")
    }
    return table, classes


def choose(
    table: Table | None,
    gpu: str,
    rows: int | None,
    classes: dict | None = None,
) -> dict:
    """The plan (plan.json's content) for a device's table (None: no tables), the rows per forward and the escape
    rates the table's classes were measured up to (read_table)."""
    plan: dict = {"gpu": gpu, "rows_per_forward": rows, "threshold": THRESHOLD, "classes": classes or {}}
    if table is None:
        return {**plan, "tables": None, "shapes": {}, "unlisted": "w12", "why": f"no W12 tables for {gpu}: untuned"}
    if rows is not None and rows > FUSED_MAX_M:
        why = f"a forward takes up to {rows} rows (> {FUSED_MAX_M}): W12 decodes the whole weight there"
        return {**plan, "tables": f"fallback_{gpu}.json", "shapes": {}, "unlisted": "bf16", "why": why}
    buckets = served_buckets(rows)
    shapes = {}
    for (n, k), measured in sorted(table.items()):
        entry: dict = {}
        for heavy, cls in ((False, "light"), (True, "heavy")):
            # a weight with many escapes takes the heavy measurement, the light one where it has none (gemm.py)
            found = {b: measured.get((b, heavy), measured.get((b, False))) for b in buckets}
            unmeasured = [b for b, value in found.items() if value is None]
            if unmeasured:
                entry[cls] = "bf16"
                entry[f"{cls}_why"] = f"bucket {unmeasured[0]} not measured"
                continue
            worst = min((value, b) for b, value in found.items() if value is not None)
            entry[cls] = "w12" if worst[0] >= THRESHOLD else "bf16"
            entry[f"{cls}_worst"] = {"speedup": worst[0], "bucket": worst[1]}
        shapes[f"{n},{k}"] = entry
    return {
        **plan,
        "tables": f"fallback_{gpu}.json",
        "buckets": list(buckets),
        "shapes": shapes,
        "unlisted": "bf16",
        "why": "shapes the table does not have stay bf16: W12 is not shown to win there",
    }


def plan_for(cfg: dict, kernel_dir: Path) -> dict:
    """The plan for an engine of `cfg` whose kernels/w12 files are in `kernel_dir`."""
    gpu = cfg["hardware"]["name"]
    table_path = kernel_dir / f"fallback_{gpu}.json"
    if cfg["hardware"].get("device") != "cuda" or not table_path.exists():
        return choose(None, gpu, rows_per_forward(cfg))
    table, classes = read_table(table_path)
    return choose(table, gpu, rows_per_forward(cfg), classes)

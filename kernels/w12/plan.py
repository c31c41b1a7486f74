"""The engine's W12 layer plan (plan.json beside this module, written at build time): which weight shapes are
stored in W12 and which stay bf16, per escape class, and up to which escape rate each class was measured. Without
plan.json (W12 used outside an engine) every weight is W12. Loaders ask `stored_as` before encoding (a shape the
plan keeps bf16 is never encoded) and `keep_bf16` after (the class and escape rate of the encoded weight);
`encode_planned` does both."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

PLAN = Path(__file__).with_name("plan.json")
CLASSES = ("w12", "bf16")


@cache
def load() -> dict | None:
    if not PLAN.exists():
        return None
    plan = json.loads(PLAN.read_text())
    shapes = plan.get("shapes")
    if not isinstance(shapes, dict) or plan.get("unlisted") not in CLASSES:
        raise ValueError(f"{PLAN}: not a W12 plan (needs 'shapes' and 'unlisted': w12 or bf16)")
    for key, entry in shapes.items():
        if not isinstance(entry, dict) or entry.get("light") not in CLASSES or entry.get("heavy") not in CLASSES:
            raise ValueError(f"{PLAN}: shape {key}: needs 'light' and 'heavy', each w12 or bf16")
    return plan


def _plan(plan: dict | None) -> dict | None:
    return load() if plan is None else plan


def stored_as(rows: int, cols: int, heavy: bool | None = None, plan: dict | None = None) -> str | None:
    """ "w12" or "bf16" for a weight of [rows, cols] (out, in); None when the answer depends on the weight's escape
    class and `heavy` is not given."""
    plan = _plan(plan)
    if plan is None:
        return "w12"
    entry = plan["shapes"].get(f"{rows},{cols}")
    if entry is None:
        return plan["unlisted"]
    if entry["light"] == entry["heavy"]:
        return entry["light"]
    return None if heavy is None else entry["heavy" if heavy else "light"]


def keep_bf16(packed, plan: dict | None = None) -> bool:
    """After encoding: whether the plan keeps this weight bf16 after all, because its escape class's measurement
    says W12 loses, or because it has more escapes per weight than any family its class was measured on (more
    escapes, slower kernel: a table does not speak for weights denser than it measured)."""
    plan = _plan(plan)
    if plan is None or plan.get("tables") is None:
        return False
    from .gemm import heavy  # the GEMM's own class of this weight (needs Triton: plans with tables are for GPUs)

    cls = heavy(packed)
    if stored_as(packed.rows, packed.cols, heavy=cls, plan=plan) == "bf16":
        return True
    measured = (plan.get("classes") or {}).get("heavy" if cls else "light", {}).get("max_escape_rate")
    return measured is not None and packed.escapes > measured * packed.rows * packed.cols


def encode_planned(weight, plan: dict | None = None, encode=None):
    """The W12 form of the bf16 `weight` [out, in] (made by `encode`, default format.encode), or None where the plan
    keeps it bf16: its shape before encoding, its escape class and rate after."""
    if encode is None:
        from .format import encode
    if stored_as(*weight.shape, plan=plan) == "bf16":
        return None
    packed = encode(weight)
    return None if keep_bf16(packed, plan) else packed


def summary(choices: dict[str, str]) -> dict:
    """What a runtime reports: the plan's device and reason, and its layers per choice."""
    plan = load()
    counts = {store: sum(1 for c in choices.values() if c == store) for store in CLASSES}
    if plan is None:
        return {"plan": None, "layers": counts}
    return {"plan": {k: plan.get(k) for k in ("gpu", "rows_per_forward", "tables", "why")}, "layers": counts}

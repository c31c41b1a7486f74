"""The W12 layer plan: chosen at build time from the setting's GPU tables and rows per forward, written into the
engine (kernels/w12/plan.json, so in its manifest and id), and obeyed by the loaders: a shape the plan keeps bf16
is never encoded and no second copy of any weight is kept."""

from __future__ import annotations

import json

import pytest
import torch

import w12
import w12.plan
from specpilot_build.assemble.builder import build_engine
from specpilot_build.assemble.w12_plan import RATE_SLACK, choose, plan_for, read_table, rows_per_forward
from specpilot_build.config.compose import compose_setting
from specpilot_build.config.effective import effective_config
from specpilot_build.locations import KERNELS_DIR

# A table by hand: (N, K) -> {(bucket, heavy): W12 / cuBLAS}
TABLE = {
    (100, 50): {(8, False): 1.3, (16, False): 1.2, (32, False): 1.05, (64, False): 0.9},
    (200, 50): {(8, False): 1.4, (16, False): 1.3, (32, False): 1.2, (64, False): 1.12, (64, True): 0.95},
    (300, 50): {(8, False): 1.4, (16, False): 1.3},  # buckets 32 and 64 never measured
}


def stores(plan: dict) -> dict[str, tuple[str, str]]:
    return {shape: (entry["light"], entry["heavy"]) for shape, entry in plan["shapes"].items()}


def test_a_shape_is_w12_only_where_it_won_in_every_bucket_the_setting_serves():
    every = choose(TABLE, "h100", None)  # draft length left to the runtime: every bucket up to 64
    assert every["buckets"] == [8, 16, 32, 64]
    assert stores(every) == {
        "100,50": ("bf16", "bf16"),  # 0.9 at 64 (below the 1.1 margin)
        "200,50": ("w12", "bf16"),  # the heavy class lost at 64; the light one won everywhere
        "300,50": ("bf16", "bf16"),  # not measured at 32 and 64: not shown to win
    }
    assert every["shapes"]["100,50"]["light_worst"] == {"speedup": 0.9, "bucket": 64}
    c1 = choose(TABLE, "h100", 11)  # one request, ten draft tokens: buckets 8 and 16 serve it
    assert c1["buckets"] == [8, 16]
    assert stores(c1) == {"100,50": ("w12", "w12"), "200,50": ("w12", "w12"), "300,50": ("w12", "w12")}
    assert choose(TABLE, "h100", 32)["buckets"] == [8, 16, 32]
    assert stores(choose(TABLE, "h100", 32))["100,50"] == ("bf16", "bf16")  # 1.05 at 32: within the margin


def test_more_than_64_rows_keeps_every_layer_bf16_and_no_tables_keeps_every_layer_w12():
    wide = choose(TABLE, "h200", 16 * 11)
    assert (wide["shapes"], wide["unlisted"]) == ({}, "bf16")
    assert "176 rows" in wide["why"]
    untuned = choose(None, "rtx-pro-6000", 1)
    assert (untuned["tables"], untuned["unlisted"]) == (None, "w12")
    assert "no W12 tables for rtx-pro-6000" in untuned["why"]


def test_the_loader_follows_the_plan_and_encodes_nothing_it_keeps_bf16():
    plan = {**choose(TABLE, "h100", None), "tables": None}  # tables None: no escape-class read-back (no Triton)
    assert w12.plan.stored_as(100, 50, plan=plan) == "bf16"
    assert w12.plan.stored_as(200, 50, plan=plan) is None  # depends on the weight's class
    assert w12.plan.stored_as(200, 50, heavy=False, plan=plan) == "w12"
    assert w12.plan.stored_as(7, 9, plan=plan) == "bf16"  # unlisted
    weight = torch.randn(100, 50).to(torch.bfloat16)
    assert w12.plan.encode_planned(weight, plan) is None
    assert w12.plan.stored_as(7, 9, plan={**plan, "unlisted": "w12"}) == "w12"
    packed = w12.plan.encode_planned(torch.randn(7, 9).to(torch.bfloat16), {**plan, "unlisted": "w12"})
    assert isinstance(packed, w12.W12Tensor)


def test_a_module_under_a_plan_keeps_the_bf16_linears_as_they_are():
    model = torch.nn.Sequential(torch.nn.Linear(50, 100), torch.nn.Linear(100, 7)).to(torch.bfloat16)
    kept = model[0]
    plan = {"tables": None, "shapes": {"100,50": {"light": "bf16", "heavy": "bf16"}}, "unlisted": "w12"}
    assert w12.apply_w12(model, plan=plan) == 1
    assert model[0] is kept and isinstance(model[1], w12.W12Linear)


def test_the_tables_classes_bound_the_escape_rate_a_plan_trusts():
    _, classes = read_table(KERNELS_DIR / "w12" / "fallback_h100.json")
    assert classes["light"]["families"] == ["normal"]
    assert classes["heavy"]["max_escape_rate"] == pytest.approx(2.0e-3 * RATE_SLACK)


@pytest.mark.parametrize(
    "setting, arm, rows",
    [
        ("cpu_c1_stories260k-bf16_ngram", "final", 11),  # reference runtime, tuned-ngram-k10-n8
        ("h200_c1_stories260k-padded-bf16_ngram", "final", 11),  # SGLang, tuned-ngram-sglang: 10 draft tokens
        ("h200_c1_stories260k-padded-bf16_ngram", "ar", 1),
    ],
)
def test_rows_per_forward_come_from_the_composed_setting(setting, arm, rows):
    assert rows_per_forward(effective_config(compose_setting(setting, arm).config)) == rows


def test_an_h200_w12_final_plans_from_the_h200_tables():
    cfg = effective_config(compose_setting("h200_c1_stories260k-padded-bf16_ngram", "final").config)
    plan = plan_for(cfg, KERNELS_DIR / "w12")
    assert (plan["gpu"], plan["tables"], plan["buckets"], plan["unlisted"]) == (
        "h200",
        "fallback_h200.json",
        [8, 16],
        "bf16",
    )
    assert plan["shapes"]["34816,5120"]["light"] == "w12"  # 1.31 and 1.29 at buckets 8 and 16 on the H200
    assert plan["shapes"]["34816,5120"]["heavy"] == "bf16"  # smollm2-135m's 1.015 at 16


def test_an_h100_w12_final_plans_from_the_h100_tables():
    cfg = effective_config(compose_setting("h100_c1_stories260k-padded-bf16_ngram", "final").config)
    plan = plan_for(cfg, KERNELS_DIR / "w12")
    assert (plan["gpu"], plan["tables"], plan["buckets"]) == ("h100", "fallback_h100.json", [8, 16])
    assert plan["shapes"]["34816,5120"]["heavy"] == "w12"  # 1.362 and 1.267 at 8 and 16 on the H100 (H200: bf16)
    assert plan["shapes"]["10240,5120"]["light"] == "w12"  # 1.233 and 1.174
    assert plan["shapes"]["10240,5120"]["heavy"] == "bf16"  # 0.881 at 16


@pytest.mark.slow
def test_a_w12_engine_ships_its_plan_and_the_plan_is_in_its_id(session_data):
    engine = build_engine("cpu_c1_stories260k-bf16_ngram", "final").engine
    plan = json.loads((engine.path / "kernels" / "w12" / "plan.json").read_text())
    assert (plan["gpu"], plan["tables"], plan["unlisted"]) == ("cpu", None, "w12")
    listed = {f["path"] for f in engine.manifest["files"]}
    assert "kernels/w12/plan.json" in listed

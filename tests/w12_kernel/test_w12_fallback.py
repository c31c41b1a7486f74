"""The bf16 fallback (kernels/w12/gemm.py: fallback_buckets, keep_dense; bench.save_fallback), on CPU: which M
buckets fall back to cuBLAS follows the measured table per shape and escape class, a dense copy is kept only
where some bucket falls back and only if it is exactly the encoded matrix, and it travels with the weight."""

import json
from pathlib import Path

import pytest
import torch

import w12
from specpilot_lab import w12_bench as bench
from specpilot_lab.w12_families import SHAPES, normal_with_escapes
from w12 import gemm

FALLBACK_FILE = Path(gemm.__file__).with_name(gemm.TABLES["fallback"])


@pytest.fixture
def speedups(monkeypatch):
    table = {}
    monkeypatch.setattr(gemm, "SPEEDUPS", table)
    return table


def test_measured_buckets_fall_back_where_the_kernel_was_slower(speedups):
    speedups.update(
        {
            (64, 1024, 8, False): 1.2,
            (64, 1024, 16, False): 1.01,
            (64, 1024, 32, False): 0.99,
            (64, 1024, 64, False): 0.5,
            (64, 1024, 16, True): 0.97,
        }
    )
    assert gemm.fallback_buckets(64, 1024) == (32, 64)
    # the heavy class: its own measurement where it has one (bucket 16), else the light one
    assert gemm.fallback_buckets(64, 1024, many_escapes=True) == (16, 32, 64)
    # a shape measured nowhere: the default, whatever the escapes
    assert gemm.fallback_buckets(96, 1024) == gemm.fallback_buckets(96, 1024, True) == gemm.DEFAULT_FALLBACK


def test_every_committed_entry_parses_and_covers_the_benchmark_shapes():
    entries = {k: v for k, v in json.loads(FALLBACK_FILE.read_text()).items() if not k.startswith("_")}
    keys = {gemm.tuned_key(k) for k in entries}
    assert keys == set(gemm.SPEEDUPS)
    assert {(n, k, b, h) for n, k in SHAPES.values() for b in gemm.BUCKETS for h in (False, True)} <= keys
    assert all(entries[gemm.tuned_name(key)]["M"] == key[2] for key in keys)


def test_a_dense_copy_is_kept_only_where_a_bucket_falls_back(speedups):
    weight = normal_with_escapes(64, 1024, 1e-4, seed=3)
    speedups.update({(64, 1024, b, False): 1.1 for b in gemm.BUCKETS})
    packed = w12.encode(weight)
    assert not gemm.keep_dense(packed, weight)
    assert packed.dense is None and packed.dense_buckets == ()
    speedups[(64, 1024, 64, False)] = 0.6
    assert gemm.keep_dense(packed, weight)
    assert packed.dense_buckets == (64,)
    assert packed.dense.data_ptr() == weight.data_ptr()  # the caller's tensor, not a second copy


def test_a_dense_copy_that_is_not_the_encoded_matrix_is_refused(speedups):
    weight = normal_with_escapes(64, 1024, 1e-4, seed=4)
    packed = w12.encode(weight)
    other = weight.clone()
    other.view(torch.int16)[17, 500] ^= 1  # one bit
    with pytest.raises(ValueError, match="differs"):
        gemm.keep_dense(packed, other)
    with pytest.raises(ValueError, match="bf16"):
        gemm.keep_dense(packed, weight.float())
    with pytest.raises(ValueError, match=r"\(64, 1024\)"):
        gemm.keep_dense(packed, weight[:32])
    assert packed.dense is None


def test_the_copy_moves_with_the_weight_and_serves_the_reference_path(speedups, monkeypatch):
    weight = normal_with_escapes(48, 256, 1e-3, seed=5)
    packed = w12.encode(weight)
    assert gemm.keep_dense(packed, weight)  # an unmeasured shape: the default buckets
    moved = packed.to("cpu")
    assert moved.dense_buckets == gemm.DEFAULT_FALLBACK and torch.equal(moved.dense, weight)
    x = torch.randn(70, 256).to(torch.bfloat16)  # M > 64: the reference path, on the copy, not a decode
    monkeypatch.setattr(gemm, "decode", lambda packed: pytest.fail("decoded although a copy is kept"))
    assert torch.equal(w12.linear(x, packed), torch.nn.functional.linear(x, weight))


def test_apply_w12_keeps_copies_only_when_asked(speedups):
    model = torch.nn.Sequential(torch.nn.Linear(256, 48, bias=False)).to(torch.bfloat16)
    assert w12.apply_w12(model) == 1 and model[0].packed.dense is None
    model = torch.nn.Sequential(torch.nn.Linear(256, 48, bias=False)).to(torch.bfloat16)
    original = model[0].weight.detach().clone()
    w12.apply_w12(model, dense_fallback=True)
    kept = model[0].packed
    assert torch.equal(kept.dense.view(torch.int16), original.view(torch.int16))
    assert "bf16 copy for M buckets (32, 64)" in repr(model)


def test_save_fallback_measures_each_class_on_its_families(tmp_path):
    def rows(family, speed):
        return {"table": [dict(N=64, K=1024, M=m, shape="x", family=family, speedup=speed[m]) for m in speed]}

    result = {
        "device": "test GPU",
        "families": {
            "normal": rows("normal", {1: 1.3, 8: 1.2, 16: 1.1, 32: 0.9, 64: 0.5}),
            "student-t4": rows("student-t4", {8: 1.1, 16: 1.02, 32: 0.8, 64: 0.5}),
            "outliers": rows("outliers", {8: 1.1, 16: 0.96, 32: 0.8}),
            "student-t3": rows("student-t3", {16: 0.1}),
        },
    }  # not a class family: ignored
    path = tmp_path / "fallback.json"
    classes = {"heavy": {"families": ["student-t4", "outliers"], "max_escape_rate": 6e-4}}
    path.write_text(json.dumps({"_comment": "old", "_classes": classes, "7,7,8": {"speedup": 0.5, "M": 8}}))
    entries = bench.save_fallback(result, path)
    saved = json.loads(path.read_text())
    assert {k: v["speedup"] for k, v in entries.items()} == {k: v["speedup"] for k, v in saved.items() if k[0] != "_"}
    assert saved["7,7,8"]["speedup"] == 0.5  # kept
    assert saved["64,1024,32"]["speedup"] == 0.9 and "64,1024,1" not in saved  # buckets only
    assert saved["64,1024,16,heavy"]["speedup"] == 0.96  # the slower family of the class
    assert saved["_classes"] == classes  # kept: the escape rates the classes were measured up to
    assert "64,1024,64,heavy" not in saved  # outliers did not measure it
    assert "test GPU" in saved["_comment"]

"""Which fused-kernel config a W12 weight gets (kernels/w12/gemm.py, tuned_<gpu>.json), on CPU: the tuned entries
parse, a weight's escape count chooses between the light and the heavy entry, and the bucket fallbacks hold."""

import json
from pathlib import Path

import pytest

import w12
from specpilot_lab.w12_families import SHAPES, draw, normal_with_escapes
from w12 import gemm

TUNED_FILE = Path(gemm.__file__).with_name(gemm.TABLES["tuned"])


def test_tuned_keys_parse_and_name_round_trip():
    assert gemm.tuned_key("10240,5120,8") == (10240, 5120, 8, False)
    assert gemm.tuned_key("10240,5120,32,heavy") == (10240, 5120, 32, True)
    for key in ((10240, 5120, 8, False), (5120, 8192, 64, True)):
        assert gemm.tuned_key(gemm.tuned_name(key)) == key
    for bad in ("10240,5120", "10240,5120,8,light", "10240,5120,8,heavy,1", "a,b,c"):
        with pytest.raises(ValueError):
            gemm.tuned_key(bad)


def test_every_tuned_entry_loads_and_every_heavy_one_has_a_light_one():
    entries = {k: v for k, v in json.loads(TUNED_FILE.read_text()).items() if not k.startswith("_")}
    keys = {gemm.tuned_key(k) for k in entries}
    assert keys == set(gemm.TUNED)
    assert all((n, k, b, False) in keys for n, k, b, heavy in keys if heavy)
    # the four benchmark shapes are tuned for every bucket, so no weight of theirs runs an untuned default
    assert {(n, k, b) for n, k, b, _ in keys} >= {(n, k, b) for n, k in SHAPES.values() for b in gemm.BUCKETS}


def test_a_weight_with_many_escapes_takes_the_heavy_entry():
    light = w12.encode(normal_with_escapes(64, 1024, 1e-5, seed=1))
    heavy = w12.encode(normal_with_escapes(64, 1024, 2e-3, seed=1))
    assert light.escapes < gemm.HEAVY_ESCAPES * 64 * 1024 <= heavy.escapes
    assert not gemm.heavy(light) and gemm.heavy(heavy)
    n, k = SHAPES["qkv"]
    light_cfg, heavy_cfg = gemm.pick_config(n, k, 32, False), gemm.pick_config(n, k, 32, True)
    assert light_cfg == gemm.TUNED[(n, k, 32, False)] and heavy_cfg == gemm.TUNED[(n, k, 32, True)]
    assert heavy_cfg != light_cfg and heavy_cfg.xt


def test_bucket_fallbacks():
    n, k = SHAPES["qkv"]
    # no heavy entry for this bucket: the light one
    assert (n, k, 8, True) not in gemm.TUNED
    assert gemm.pick_config(n, k, 8, True) == gemm.TUNED[(n, k, 8, False)]
    # an untuned shape: default_config, whatever the escapes
    assert gemm.pick_config(384, 2000, 16, True) == gemm.default_config(384, 2000, 16)


def test_families_fall_on_the_side_of_the_threshold_the_picks_assume():
    """The picks were measured on normal (light) and on Student-t and outlier columns (heavy); laplace-colspread
    (0.18% escapes, most of them its exact zeros) is heavy too, so it takes the heavy picks."""

    def escape_rate(family):
        packed = w12.encode(draw(family, 256, 5120, seed=0))
        return packed.escapes / (packed.rows * packed.cols)

    assert escape_rate("normal") < gemm.HEAVY_ESCAPES
    for family in ("student-t3", "student-t4", "student-t5", "outliers", "laplace-colspread"):
        assert escape_rate(family) >= gemm.HEAVY_ESCAPES, family


def test_escapes_clustered_in_some_row_blocks_make_a_weight_heavy(w12_stories):
    """stories260K's real rows: few escapes on average, but in runs per row, so a tenth of the row blocks carry
    many; the class follows the blocks (a program waits for its own block's escapes), not the mean."""
    for family, is_heavy in (("normal", False), ("student-t5", True), ("stories260k", True)):
        packed = w12.encode(draw(family, 1024, 5120, seed=0))
        assert gemm.heavy(packed) is is_heavy, family
    stories = w12.encode(draw("stories260k", 1024, 5120, seed=0))
    assert stories.escapes < gemm.HEAVY_ESCAPES * stories.rows * stories.cols
    # the same escape count spread evenly over the rows is light
    even = w12.encode(normal_with_escapes(1024, 5120, stories.escapes / (1024 * 5120), seed=2))
    assert abs(even.escapes - stories.escapes) < 0.2 * stories.escapes and not gemm.heavy(even)


def test_pick_times_tiles_with_the_escape_handling_the_shape_has_now():
    from specpilot_lab import w12_bench as bench

    n, k = SHAPES["o"]
    now = gemm.TUNED[(n, k, 8, False)]
    assert now.esc_step  # o at M <= 8 spreads its escapes over the loop (benchmarks/w12_gemm.md)
    tiles = bench.finalists(n, k, 8)
    assert len({(c.block_n, c.num_stages, c.split_k) for c in tiles}) == len(tiles) > 1
    assert all(c.esc_step == now.esc_step and c.xt == now.xt for c in tiles)


def test_save_tuned_replaces_the_picked_keys_and_keeps_the_rest(tmp_path):
    from specpilot_lab import w12_bench as bench

    path = tmp_path / "tuned.json"
    light = dict(vars(gemm.Config()), block_n=64)
    old = {
        "_comment": "kept",
        "1,2,8": light,
        "1,2,8,heavy": dict(light, xt=True),
        "1,2,64": light,
        "1,2,16": dict(light, kernel="ws"),
    }
    path.write_text(json.dumps(old))
    picked = dict(vars(gemm.Config()), block_n=16, esc_step=32)
    bench.save_tuned({"tuned": {"1,2,8": picked, "1,2,16": picked}}, path)
    new = json.loads(path.read_text())
    assert new["_comment"] == "kept" and new["1,2,8"] == picked
    assert new["1,2,8,heavy"] == old["1,2,8,heavy"] and new["1,2,64"] == old["1,2,64"]
    assert new["1,2,16"] == dict(picked, kernel="ws")  # --pick times Triton tiles: the ws choice stays
    # a malformed key is refused before anything is written
    with pytest.raises(ValueError, match="N,K,bucket"):
        bench.save_tuned({"tuned": {"1,2,8,light": picked}}, path)
    assert json.loads(path.read_text()) == new

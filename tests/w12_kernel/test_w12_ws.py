"""w12.ws, the warp-specialized wgmma kernel: its escape table, build settings and nvcc output here; the kernel itself
on an sm_90a GPU (skipped without one), run on the device with
`PYTHONPATH=kernels python3 -m pytest -q tests/w12_kernel/test_w12_ws.py`."""

import ctypes
import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from w12_gpu_helpers import assert_close_to_exact, llm_like

import w12
from w12 import ws


def stand_in(rows: int, cols: int, density: float, seed: int, planted=()) -> SimpleNamespace:
    """The attributes of a format-4 W12Tensor that escape_table reads, with random escapes (and `planted` ones at
    given (row, column)) and random bit patterns, negative int16 ones included."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, cols, generator=g) < density
    for r, c in planted:
        mask[r, c] = True
    row, col = mask.nonzero(as_tuple=True)  # row-major: by row, then column, as the CSR keeps them
    ptr = torch.zeros(rows + 1, dtype=torch.int32)
    ptr[1:] = torch.cumsum(torch.bincount(row, minlength=rows), 0)
    bits = torch.randint(-32768, 32768, (len(row),), generator=g, dtype=torch.int32).to(torch.int16)
    return SimpleNamespace(
        rows=rows,
        cols=cols,
        half=-(-cols // 128) * 64,
        esc_ptr=ptr,
        esc_col=col.to(torch.int32),
        esc_bits=bits,
        escapes=len(row),
    )


def reference_table(p) -> tuple[list[int], list[int]]:
    """escape_table, one escape at a time: (entries as unsigned 32-bit values, pointers)."""
    ks = p.half // 64
    groups = [[] for _ in range(-(-p.rows // 128) * ks * 8)]
    ptr, cols, bits = p.esc_ptr.tolist(), p.esc_col.tolist(), p.esc_bits.tolist()
    for r in range(p.rows):
        for e in range(ptr[r], ptr[r + 1]):
            second, j = (1, cols[e] - p.half) if cols[e] >= p.half else (0, cols[e])
            unit, warp = (r // 128) * ks + j // 64, (r % 128) // 16
            groups[unit * 8 + warp].append((r % 128) | ((j % 64 + 64 * second) << 7) | ((bits[e] & 0xFFFF) << 16))
    pointers = [0]
    for group in groups:
        pointers.append(pointers[-1] + len(group))
    return [entry for group in groups for entry in group] + [0] * 4, pointers


def assert_table_matches(p) -> None:
    esc, esc_ptr = ws.escape_table(p)
    entries, pointers = reference_table(p)
    assert esc.dtype == esc_ptr.dtype == torch.int32
    assert [v & 0xFFFFFFFF for v in esc.tolist()] == entries
    assert esc_ptr.tolist() == pointers


# rows 384 = 3 tiles; cols 300 -> half 192 (3 units a tile), so column 192 is the second half's first
EDGES = [(0, 0), (127, 191), (128, 192), (129, 299), (255, 63), (256, 64), (383, 255), (15, 191), (16, 192)]


@pytest.mark.parametrize(
    "rows, cols, density, planted",
    [
        (384, 300, 0.01, EDGES),
        (384, 300, 0.0, ()),
        (128, 128, 0.0, ()),
        (128, 128, 0.2, ()),
        (200, 1000, 0.003, ()),
        (256, 512, 0.0, [(17, 300)]),
    ],
    ids=str,
)
def test_escape_table_matches_a_reference_one_escape_at_a_time(rows, cols, density, planted):
    p = stand_in(rows, cols, density, seed=rows + cols, planted=planted)
    assert_table_matches(p)
    if density == 0.0 and not planted:
        esc, esc_ptr = ws.escape_table(p)
        assert esc.tolist() == [0] * 4 and not esc_ptr.any()


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    rows=st.integers(1, 400),
    cols=st.integers(1, 700),
    density=st.sampled_from([0.0, 0.001, 0.02, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_escape_table_matches_the_reference_on_random_weights(rows, cols, density, seed):
    assert_table_matches(stand_in(rows, cols, density, seed))


def test_escape_table_of_an_encoded_weight():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 1000, generator=g) * 0.02
    w.view(-1)[torch.randint(0, w.numel(), (400,), generator=g)] *= 2.0**20
    packed = w12.encode(w.to(torch.bfloat16), layout="units")
    assert packed.escapes >= 300 and packed.half == 512
    assert_table_matches(packed)


@settings(max_examples=80, derandomize=True, deadline=None)
@given(tiles=st.integers(1, 300), ks=st.integers(1, 300), sms=st.integers(1, 140))
def test_cta_ranges_split_the_units_as_stream_k_and_name_each_tiles_first_and_last_cta(tiles, ks, sms):
    """The kernel takes its range and each tile's CTAs from this table: CTA c's units are c * units // grid up to
    (c + 1) * units // grid, and a tile's first and last CTA are those holding its first and last unit (found here
    one unit at a time)."""
    units = tiles * ks
    grid = min(sms, units)
    table = ws.cta_ranges(tiles, ks, grid)
    assert table.dtype == torch.int32 and table.numel() == grid + 1 + 2 * tiles
    bounds = table[: grid + 1].tolist()
    assert bounds == [c * units // grid for c in range(grid + 1)]
    cta_of = [c for c in range(grid) for _ in range(bounds[c], bounds[c + 1])]
    assert len(cta_of) == units
    assert table[grid + 1 :].tolist() == [
        cta for t in range(tiles) for cta in (cta_of[t * ks], cta_of[t * ks + ks - 1])
    ]


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECPILOT_W12_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ws.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SPECPILOT_W12_CACHE")
    assert ws.cache_dir() == tmp_path / "xdg" / "specpilot" / "w12"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ws.cache_dir() == tmp_path / "home" / ".cache" / "specpilot" / "w12"


def test_without_nvcc_the_error_names_every_place_looked(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setattr(ws, "NVCC_FALLBACK", tmp_path / "fallback" / "nvcc")
    with pytest.raises(
        RuntimeError,
        match=r"needs nvcc.*\$CUDA_HOME/bin/nvcc \(.*cuda/bin/nvcc\), nvcc on PATH "
        r"\(none\), .*fallback/nvcc$",
    ):
        ws.find_nvcc()
    monkeypatch.delenv("CUDA_HOME")
    with pytest.raises(RuntimeError, match=r"\$CUDA_HOME unset"):
        ws.find_nvcc()


def test_a_failed_build_is_not_retried_in_the_process(monkeypatch):
    attempts = []

    def fails(arch):
        attempts.append(arch)
        raise ws.BuildError(f"nvcc failed for {arch}")

    monkeypatch.setattr(ws, "_BUILD_FAILED", {})
    monkeypatch.setattr(ws, "arch_of", lambda device=None: "sm_90a")
    monkeypatch.setattr(ws, "_load", fails)
    for _ in range(3):
        with pytest.raises(ws.BuildError, match="nvcc failed for sm_90a"):
            ws.build()
    assert attempts == ["sm_90a"]


def test_supported_refuses_what_the_kernel_cannot_take():
    w = (torch.randn(256, 512) * 0.02).to(torch.bfloat16)
    units = w12.encode(w, layout="units")
    assert not ws.supported(units, 8)  # on the CPU
    assert not ws.supported(w12.encode(w, layout="rows"), 8)  # the planes row by row
    for m in (0, 65):
        assert not ws.supported(units, m)


def _nvcc_or_skip():
    try:
        return ws.find_nvcc()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_the_kernel_compiles_without_spills_serialized_wgmma_or_generic_shared_loads(tmp_path, monkeypatch):
    """nvcc's report on csrc/w12_ws.cu: no spills, no wgmma serialized by ptxas (C7513: A registers defined between
    wgmmas; C7518: a divergent path), no generic loads or stores in the SASS (shared memory through LDS/STS); and
    the built library's Args matches ws.Args, kept in the cache directory under one name."""
    nvcc = _nvcc_or_skip()
    out = tmp_path / "w12_ws.so"
    done = subprocess.run(ws.nvcc_command(nvcc, "sm_90a", out) + ["-Xptxas", "-v"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = done.stderr
    assert re.findall(r"(\d+) bytes spill (?:stores|loads)", report) == ["0"] * 8, report
    assert re.findall(r"(\d+) bytes stack frame", report) == ["0"] * 4, report
    assert not re.search(r"C7513|C7518|serialized", report), report
    cuobjdump = shutil.which("cuobjdump", path=str(nvcc.parent))
    if cuobjdump:
        sass = subprocess.run([cuobjdump, "-sass", str(out)], capture_output=True, text=True, check=True).stdout
        ops = re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", sass)
        assert ops.count("HGMMA.64x64x16.F32.BF16") > 0 and "LDS.128" in ops
        assert not [op for op in ops if re.fullmatch(r"(LD|ST)(\.E.*)?", op)]
    monkeypatch.setenv("SPECPILOT_W12_CACHE", str(tmp_path / "cache"))
    first = ws.compiled("sm_90a")
    assert ws.compiled("sm_90a") == first and [p.name for p in first.parent.iterdir()] == [first.name]
    lib = ctypes.CDLL(str(first))
    assert lib.w12_ws_params_size() == ctypes.sizeof(ws.Args)
    assert lib.w12_ws_max_units() == ws.MAX_UNITS_PER_CTA


# --- on the GPU -------------------------------------------------------------------------------------------------

sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90a (compute capability 9.0) GPU",
)


def bucket_of(m: int) -> int:
    return next(b for b in ws.BUCKETS if m <= b)


_WEIGHTS = {}


def weight(n: int, k: int, rate: float = 1 / 500):
    if (n, k, rate) not in _WEIGHTS:
        w = llm_like(n, k, seed=n + k, rate=rate)
        _WEIGHTS[n, k, rate] = (w, w12.encode(w, layout="units"))
    return _WEIGHTS[n, k, rate]


def check(w, packed, m: int, plan=None) -> None:
    """Within one bf16 ulp of the float64 product, the same bits on a second launch and under CUDA-graph replay."""
    plan = plan or ws.WsPlan(packed, bucket_of(m))
    x = torch.randn(m, packed.cols, device="cuda").to(torch.bfloat16)
    y = plan(x, m)
    assert_close_to_exact(x, w, y)
    assert torch.equal(plan(x, m), y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = plan(x, m)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y)


# (256, 1000) and (256, 904): K padded to 1024, so the kernel's x map must read the columns from K on as zeros (for
# 904, the last unit's second-half box lies wholly beyond K)
@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("shape", [(256, 512), (384, 1024), (5120, 5120), (256, 1000), (256, 904)], ids=str)
@pytest.mark.parametrize("m", [1, 8, 16, 31, 32, 48, 64])
def test_ws_gives_the_exact_product_deterministically_and_under_graph_replay(shape, m):
    w, packed = weight(*shape)
    assert packed.escapes > 0 and ws.supported(packed, m)
    check(w, packed, m)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m", [1, 16, 64])
def test_ws_with_more_escapes_per_unit_than_a_stage_holds_and_with_none(m):
    """4.5% escapes: about 700 in a unit, more than the 252 a stage holds (the rest are read from global memory);
    then a weight without escapes (the table is its 4 padding entries)."""
    w, packed = weight(256, 512, rate=0.045)
    esc, esc_ptr = ws.escape_table(packed)
    assert int((esc_ptr[8::8] - esc_ptr[:-8:8]).max()) > 252
    check(w, packed, m)
    g = torch.Generator(device="cuda").manual_seed(m)
    plain = (1 + torch.rand(256, 512, device="cuda", generator=g)) * torch.randn(
        256, 512, device="cuda", generator=g
    ).sign()
    plain = plain.to(torch.bfloat16)
    packed = w12.encode(plain, layout="units")
    assert packed.escapes == 0
    check(plain, packed, m)


@pytest.mark.gpu
@sm90
def test_ws_plan_takes_a_row_slice_of_x_and_one_plan_serves_every_m_of_its_bucket():
    w, packed = weight(384, 1024)
    plan = ws.WsPlan(packed, 64)
    for m in (1, 7, 33, 64):
        x = torch.randn(m + 1, 1024, device="cuda").to(torch.bfloat16)[1:]
        assert_close_to_exact(x, w, plan(x, m))
        assert torch.equal(plan(x, m), plan(x.contiguous(), m))
    unaligned = torch.randn(2 * 1024 + 4, device="cuda").to(torch.bfloat16)[4:].view(2, 1024)
    assert_close_to_exact(unaligned, w, plan(unaligned, 2))  # copied first: TMA needs 16-byte alignment
    with pytest.raises(ValueError, match="takes bf16 x"):
        plan(torch.zeros(65, 1024, dtype=torch.bfloat16, device="cuda"), 65)


@pytest.mark.gpu
@sm90
def test_ws_refusals_on_the_gpu():
    _, packed = weight(256, 512)
    assert ws.supported(packed, 64) and not ws.supported(packed, 65)
    odd = w12.encode(llm_like(200, 512, seed=1), layout="units")  # 200 rows: not a whole number of 128-row tiles
    assert not ws.supported(odd, 8)
    with pytest.raises(ValueError, match="does not take"):
        ws.WsPlan(odd, 8)
    with pytest.raises(ValueError, match="bucket"):
        ws.WsPlan(packed, 12)
    short_lived = w12.encode(llm_like(256, 512, seed=2), layout="units")
    plan = ws.WsPlan(short_lived, 8)
    del short_lived
    with pytest.raises(RuntimeError, match="outlived its weight"):
        plan(torch.zeros(1, 512, dtype=torch.bfloat16, device="cuda"), 1)


@pytest.mark.gpu
@sm90
def test_linear_runs_the_ws_kernel_where_the_config_names_it_and_the_triton_kernel_elsewhere():
    """w12.linear on a units weight whose config says "ws" launches a WsPlan; on the rows layout the same config
    runs the Triton kernel with its tiles; both give the exact product, and fused_gemm (the unprepared path) picks
    the same kernel."""
    from w12.gemm import Config, Plan, fused_gemm, prepare

    w = llm_like(384, 1024, seed=3)
    cfg = Config(32, 128, 2, 3, swap=True, block_m=16, kernel="ws")
    units, rows = w12.encode(w, layout="units"), w12.encode(w, layout="rows")
    assert isinstance(prepare(units, 16, cfg), ws.WsPlan) and isinstance(prepare(rows, 16, cfg), Plan)
    x = torch.randn(16, 1024, device="cuda").to(torch.bfloat16)
    for packed in (units, rows):
        y = w12.linear(x, packed)
        assert_close_to_exact(x, w, y)
        assert torch.equal(fused_gemm(x, packed, cfg), y)


def test_without_a_compiler_the_triton_kernel_runs_instead_with_a_warning(monkeypatch):
    from w12 import gemm

    class NoNvcc:
        def __init__(self, packed, bucket):
            raise ws.BuildError("the W12 ws kernel is compiled at first use and needs nvcc; tried nothing\nmore")

    units = w12.encode((torch.randn(128, 256) * 0.02).to(torch.bfloat16), layout="units")
    monkeypatch.setattr(ws, "supported", lambda packed, m: True)
    monkeypatch.setattr(ws, "WsPlan", NoNvcc)
    with pytest.warns(
        RuntimeWarning,
        match=r"ws kernel is not available \(the W12 ws kernel .* tried nothing\); "
        r"running the Triton kernel instead",
    ):
        assert gemm._ws_plan(units, 16, gemm.Config(kernel="ws")) is None
    assert gemm._ws_plan(units, 16, gemm.Config()) is None  # a Triton config never asks


def test_a_config_names_a_known_kernel_and_units_take_whole_units():
    from w12.gemm import Config, _launch_args

    with pytest.raises(ValueError, match="Config.kernel is one of triton, ws"):
        Config(kernel="cuda")
    units = w12.encode((torch.randn(128, 256) * 0.02).to(torch.bfloat16), layout="units")
    with pytest.raises(ValueError, match="block_k must be a multiple of 64"):
        _launch_args(units, 16, Config(block_k=32))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m", [1, 16, 64])
def test_a_chain_of_dependent_calls_under_programmatic_dependent_launch_reads_each_input_after_it_is_written(m):
    """Each call reads the previous one's y: ws kernels, launched as programmatic dependents of ws and Triton kernels
    (split K among them) that let them launch early, give in one CUDA graph and eagerly the bits of the same calls
    with the device synchronized after each (nothing left to overlap)."""
    from w12.gemm import Config, Plan

    assert ws.PDL and w12.gemm.TRIGGER
    configs = [
        None,
        None,
        Config(32, 128, 2, 3, swap=True, block_m=16),
        None,
        Config(64, 128, 4, 2, split_k=2, block_m=0),
    ] * 2  # None: the ws kernel
    plans, weights = [], []  # a plan holds its weight weakly
    g = torch.Generator(device="cuda").manual_seed(m)
    for cfg in configs:
        # y keeps x's scale; the escapes planted are zeros and tiny weights (a weight x2^20 would overflow in the chain)
        w = torch.randn(2048, 2048, device="cuda", generator=g) * 2048**-0.5
        idx = torch.randint(0, w.numel(), (2048,), device="cuda", generator=g)
        w.view(-1)[idx[::2]] = 0.0
        w.view(-1)[idx[1::2]] *= 2.0**-30
        w = w.to(torch.bfloat16)
        packed = w12.encode(w, layout="units" if cfg is None else "rows")
        assert packed.escapes > 0
        weights.append(packed)
        plans.append(ws.WsPlan(packed, bucket_of(m)) if cfg is None else Plan(packed, bucket_of(m), cfg))
    x0 = torch.randn(m, 2048, device="cuda").to(torch.bfloat16)

    def chain(synchronized: bool):
        x = x0
        for plan in plans:
            x = plan(x, m)
            if synchronized:
                torch.cuda.synchronize()
        return x

    expected = chain(synchronized=True)
    assert expected.isfinite().all() and expected.abs().max() > 0.1
    assert torch.equal(chain(synchronized=False), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(synchronized=False)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)

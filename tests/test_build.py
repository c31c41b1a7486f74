"""The builder: content-addressed, deterministic, idempotent, concurrent-safe engines and clear refusals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specpilot_build.assemble.builder import build_engine
from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import REPO_ROOT
from specpilot_build.store.engines import check_engine, resolve_engine
from specpilot_build.store.manifest import engine_id

EMBEDDED = "cpu_c1_stories260k_ngram"
SOURCES = ["conf", "lockfiles", "runtimes", "specpilot_build", "kernels", "overlays"]


def cli(*args, env=None, cwd=REPO_ROOT, umask=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "specpilot_build.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        timeout=timeout,
        preexec_fn=(lambda: os.umask(umask)) if umask is not None else None,
    )


def engine_dirs(store: Path) -> list[Path]:
    return [p for p in store.iterdir() if len(p.name) == 64] if store.is_dir() else []


@pytest.fixture
def store(tmp_path, monkeypatch):
    path = tmp_path / "engines"
    monkeypatch.setenv("SPECPILOT_ENGINES", str(path))
    return path


def test_the_embedded_default_builds_and_rebuilding_is_a_no_op(store):
    first = build_engine(EMBEDDED, "final")
    assert first.created and first.engine.path == store / first.engine.id
    manifest_bytes = (first.engine.path / "manifest.json").read_bytes()
    assert engine_id(json.loads(manifest_bytes)) == first.engine.id
    again = build_engine(EMBEDDED, "final")
    assert again.engine.id == first.engine.id and not again.created
    assert len(engine_dirs(store)) == 1
    assert check_engine(first.engine) == []
    files = {f["path"] for f in first.engine.manifest["files"]}
    assert {"config.json", "launch.json"} <= files
    assert any(p.startswith("runtime/specpilot_runtime/") for p in files)


def test_arms_are_distinct_engines_and_identical_content_is_stored_once(store):
    ids = {arm: build_engine(EMBEDDED, arm).engine for arm in ("ar", "stock", "final")}
    assert len({e.id for e in ids.values()}) == 3
    server = next(f["path"] for f in ids["ar"].manifest["files"] if f["path"].startswith("runtime/"))
    inodes = {(e.path / server).stat().st_ino for e in ids.values()}
    assert len(inodes) == 1, "the same runtime file should be one object hardlinked into every engine"


def test_the_cli_prints_the_id_and_path(store):
    out = cli("engine", "build", "--setting", EMBEDDED, "--arm", "ar")
    assert out.returncode == 0, out.stderr
    eid, path = out.stdout.split()[:2]
    assert Path(path) == store / eid
    show = cli("engine", "show", eid[:8])
    assert show.returncode == 0 and EMBEDDED in show.stdout and "karpathy/tinyllamas@0bd21da7" in show.stdout
    listing = cli("engine", "ls")
    assert eid[:12] in listing.stdout


def clone_sources(clone: Path) -> Path:
    """The builder's inputs copied to `clone` (a checkout elsewhere); build there with clone_env(clone)."""
    for name in SOURCES:
        if (REPO_ROOT / name).exists():
            shutil.copytree(REPO_ROOT / name, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
    return clone


def clone_env(clone: Path) -> dict:
    return {"PYTHONPATH": str(clone), "SPECPILOT_ENGINES": ""}  # the store: <clone>/engines


def test_ids_are_identical_across_clones_umasks_and_clocks(tmp_path):
    ids = []
    for n, (umask, mtime, tz) in enumerate([(0o022, 1_000_000_000, "UTC"), (0o077, 1_900_000_000, "Asia/Tokyo")]):
        clone = clone_sources(tmp_path / f"clone-{n}" / "deep" / "path")
        for root, _, files in os.walk(clone):
            for f in files:
                os.utime(Path(root) / f, (mtime, mtime))
        out = cli(
            "engine",
            "build",
            "--setting",
            EMBEDDED,
            "--arm",
            "final",
            env={**clone_env(clone), "TZ": tz},
            cwd=clone,
            umask=umask,
        )
        assert out.returncode == 0, out.stderr
        assert str(clone) in out.stdout.split()[1], "the build must use the clone's sources"
        ids.append(out.stdout.split()[0])
    assert ids[0] == ids[1]


# Every setting served by the reference runtime: its engines are the ones whose ids a lab edit must not move.
EMBEDDED_SETTINGS = sorted(
    p.stem for p in (REPO_ROOT / "conf" / "setting").glob("*.yaml") if "override /runtime: reference" in p.read_text()
)
IDS_OF_EVERY_ARM = (
    "import json, sys\n"
    "from specpilot_build.assemble.builder import build_engine\n"
    "print(json.dumps({f'{s}/{a}': build_engine(s, a).engine.id for s in sys.argv[1:]\n"
    "                  for a in ('ar', 'stock', 'final')}))\n"
)


def engine_ids(clone: Path) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", IDS_OF_EVERY_ARM, *EMBEDDED_SETTINGS],
        capture_output=True,
        text=True,
        env={**os.environ, **clone_env(clone)},
        cwd=clone,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + line)


def test_engine_ids_track_only_what_is_served(tmp_path):
    clone = clone_sources(tmp_path / "clone")
    for name in ("lab", "benchmarks"):
        shutil.copytree(REPO_ROOT / name, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
    ids = engine_ids(clone)
    assert len(EMBEDDED_SETTINGS) >= 5 and len(set(ids.values())) == 3 * len(EMBEDDED_SETTINGS)
    # benchmark-only code and results: the Qwen3 research forward, W12's bench, a results page, a new result
    for rel in (
        "lab/specpilot_lab/qwen3.py",
        "lab/specpilot_lab/fused.py",
        "lab/specpilot_lab/w12_bench.py",
        "benchmarks/qwen3_e2e.py",
    ):
        append(clone / rel, "# edited by a benchmark author\n")
    append(clone / "benchmarks" / "w12_gemm.md", "one more run\n")
    (clone / "benchmarks" / "results").mkdir(exist_ok=True)
    (clone / "benchmarks" / "results" / "w12_gemm_h100.json").write_text("{}\n")
    assert engine_ids(clone) == ids
    # a file the server executes: every reference engine moves
    append(clone / "runtimes" / "reference" / "specpilot_runtime" / "engine.py", "# a served change\n")
    moved = engine_ids(clone)
    assert not set(moved.values()) & set(ids.values())
    # a file the W12 kernel package ships: exactly the engines that carry W12 (the bf16 finals) move
    append(clone / "kernels" / "w12" / "gemm.py", "# a kernel change\n")
    again = engine_ids(clone)
    changed = sorted(k for k in again if again[k] != moved[k])
    assert changed == ["cpu_c1_stories260k-bf16_ngram/final", "h200_c1_stories260k-bf16_ngram/final"]


def test_a_kernel_ships_every_file_of_its_package(tmp_path, monkeypatch):
    from specpilot_build.assemble import inputs

    kernel = tmp_path / "kernels" / "k"
    (kernel / "csrc").mkdir(parents=True)
    (kernel / "k.py").write_text("")
    (kernel / "csrc" / "k.cu").write_text("")
    (kernel / "__pycache__").mkdir()
    (kernel / "__pycache__" / "k.cpython-311.pyc").write_bytes(b"")
    monkeypatch.setattr(inputs, "KERNELS_DIR", tmp_path / "kernels")
    assert [rel for rel, _ in inputs.kernel_files("k")] == ["csrc/k.cu", "k.py"]
    (kernel / "tuned_h100.json").write_text("{}")
    assert [rel for rel, _ in inputs.kernel_files("k")] == ["csrc/k.cu", "k.py", "tuned_h100.json"]
    with pytest.raises(SpecPilotError, match="^kernel 'w13': kernels/w13/ does not exist$"):
        inputs.kernel_files("w13")


@pytest.mark.slow
def test_flipping_one_byte_in_any_file_is_named_by_engine_verify(store):
    engine = build_engine(EMBEDDED, "stock").engine
    for entry in engine.manifest["files"]:
        path = engine.path / entry["path"]
        original = path.read_bytes()
        os.chmod(path, 0o644)
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0x01
        path.write_bytes(bytes(flipped))
        try:
            out = cli("engine", "check", engine.id)
            assert out.returncode == 1
            assert f"{entry['path']}: content differs" in out.stdout
            assert out.stdout.count("differs") == 1
        finally:
            path.write_bytes(original)
    assert cli("engine", "check", engine.id).returncode == 0


def test_an_added_or_missing_file_is_reported(store):
    engine = build_engine(EMBEDDED, "ar").engine
    (engine.path / "runtime" / "extra.py").write_text("print('hi')\n")
    problems = check_engine(engine)
    assert problems == ["runtime/extra.py: not in the manifest"]


def test_unique_prefix_lookup_like_git(store):
    a = build_engine(EMBEDDED, "ar").engine
    assert resolve_engine(a.id[:6]).id == a.id
    with pytest.raises(SpecPilotError, match="no engine"):
        resolve_engine("ffff" if not a.id.startswith("ffff") else "0000")
    with pytest.raises(SpecPilotError, match="not an engine id"):
        resolve_engine("xyz")


def test_an_unpinned_checkpoint_builds_nothing_and_says_how_to_pin_it(store):
    out = cli("engine", "build", "--setting", "h100_c1_qwen38-27b_dflash2", "--arm", "stock")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert "Qwen/Qwen3.8-27B" in lines[0] and "not pinned" in lines[0]
    assert "make lock SETTING=h100_c1_qwen38-27b_dflash2" in lines[0]
    assert engine_dirs(store) == []


@pytest.mark.parametrize(
    "args, words",
    [
        (["--setting", "no_such_setting"], ["unknown setting 'no_such_setting'"]),
        (["--setting", EMBEDDED, "hardware=tpu"], ["hardware/tpu"]),
        (["--setting", EMBEDDED, "batching.concurrency=many"], ["batching.concurrency", "many"]),
    ],
)
def test_bad_input_is_a_short_error_and_writes_nothing(store, args, words):
    out = cli("engine", "build", *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) <= 2
    for word in words:
        assert word in out.stderr
    assert engine_dirs(store) == []


def _wheel_lock(tmp_path: Path, sha256: str | None = None) -> Path:
    lock = tmp_path / "lock"
    shutil.copytree(REPO_ROOT / "lockfiles", lock)
    if sha256:
        text = (lock / "runtimes.toml").read_text()
        import re

        (lock / "runtimes.toml").write_text(re.sub(r'sha256 = "[0-9a-f]{64}"', f'sha256 = "{sha256}"', text, count=1))
    return lock


def test_a_corrupt_cached_wheel_is_refused(store, tmp_path):
    data = tmp_path / "data"
    (data / "wheels").mkdir(parents=True)
    from specpilot_build.pins.lockfile import load_lock

    pin = load_lock().runtimes["sglang"]
    (data / "wheels" / pin.filename).write_bytes(b"PK\x03\x04 not really a wheel")
    out = cli(
        "engine",
        "build",
        "--setting",
        "h100_c1_qwen3-8b_dflash",
        "--arm",
        "ar",
        env={"SPECPILOT_DATA": str(data), "SPECPILOT_MIRROR": ""},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert pin.filename in out.stderr and "does not match the pin" in out.stderr
    assert engine_dirs(store) == []


def test_a_wheel_whose_hash_differs_from_the_lock_is_refused(store, tmp_path, session_data):
    from specpilot_build.pins.lockfile import load_lock
    from specpilot_build.pins.wheels import wheel_file

    wheel = wheel_file(load_lock().runtimes["sglang"])  # the genuine pinned wheel, cached for the session
    lock = _wheel_lock(tmp_path, sha256="0" * 64)
    out = cli(
        "engine", "build", "--setting", "h100_c1_qwen3-8b_dflash", "--arm", "ar", env={"SPECPILOT_LOCKFILES": str(lock)}
    )
    assert out.returncode == 2 and "does not match the pin" in out.stderr and wheel.name in out.stderr
    assert engine_dirs(store) == []


@pytest.mark.sglang
@pytest.mark.slow
def test_two_builds_at_once_give_one_engine(store):
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "specpilot_build.cli",
                "engine",
                "build",
                "--setting",
                "h100_c1_qwen3-8b_dflash",
                "--arm",
                "ar",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    ids = {o[0].split()[0] for o in outs}
    assert len(ids) == 1
    assert [p.name for p in engine_dirs(store)] == list(ids)
    assert check_engine(resolve_engine(ids.pop())) == []
    leftovers = list((store / ".tmp").iterdir())
    assert leftovers == []


@pytest.mark.slow
@pytest.mark.sglang
def test_an_interrupted_build_leaves_no_engine(store):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specpilot_build.cli",
            "engine",
            "build",
            "--setting",
            "h100_c1_qwen3-8b_dflash",
            "--arm",
            "ar",
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not any((store / ".tmp").glob("*/python")):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert engine_dirs(store) == []
    build_engine(EMBEDDED, "ar")  # the next build sweeps the dead build's directory
    assert list((store / ".tmp").iterdir()) == []


@pytest.mark.slow
def test_sweep_runs_a_hydra_multirun_and_prints_a_summary(store, session_data):
    out = cli("sweep", "--settings", f"{EMBEDDED},cpu_c16_stories260k_ngram", "--arms", "ar,final")
    assert out.returncode == 0, out.stderr
    summaries = sorted((session_data / "hydra" / "multirun").glob("*/summary.json"))
    rows = json.loads(summaries[-1].read_text())
    assert {(r["setting"], r["arm"]) for r in rows} == {
        (s, a) for s in (EMBEDDED, "cpu_c16_stories260k_ngram") for a in ("ar", "final")
    }
    assert build_engine(EMBEDDED, "final").engine.id in {r["id"] for r in rows}
    for row in rows:
        assert row["id"][:12] in out.stdout
    assert not (REPO_ROOT / "multirun").exists() and not (REPO_ROOT / "outputs").exists()

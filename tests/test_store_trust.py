"""Nothing on the way from setting to engine is trusted (issue 15): damaged objects, the index, links and special
files, names that become paths, damaged engine directories. Each test fails on the code before the issue."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specpilot_build.assemble.builder import build_composed, build_engine
from specpilot_build.config.compose import compose_setting
from specpilot_build.errors import SpecPilotError
from specpilot_build.store.engines import INDEX, check_engine, object_path

REPO = Path(__file__).resolve().parent.parent
EMBEDDED = "cpu_c1_stories260k_ngram"
SGLANG = "h100_c1_qwen3-8b_dflash"  # pinned in lockfiles/; its final arm carries the engine-id overlay
W12 = "cpu_c1_stories260k-bf16_ngram"  # its final arm ships kernels/w12
SERVER = "runtime/specpilot_runtime/server.py"
SERVER_ARGS = "python/sglang/srt/server_args.py"


def cli(*args, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "specpilot_build.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=REPO,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def store(tmp_path, monkeypatch):
    path = tmp_path / "engines"
    monkeypatch.setenv("SPECPILOT_ENGINES", str(path))
    return path


def engine_dirs(store: Path) -> list[Path]:
    return [p for p in store.iterdir() if len(p.name) == 64] if store.is_dir() else []


def snapshot(root: Path, skip: Path | None = None) -> dict:
    """Every entry under root (links and special files as themselves), with type, size and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if skip is not None and (path == skip or skip in path.parents):
                continue
            st = os.lstat(path)
            out[path.relative_to(root).as_posix()] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns)
    return out


def damage(path: Path, how: str) -> None:
    """Damage a read-only file in place (every hardlink of its inode sees it)."""
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    if how == "exec":
        os.chmod(path, mode ^ 0o111)
        return
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[len(data) // 3 :]
    path.write_bytes(bytes(data))
    os.chmod(path, mode)


def entry(engine, rel: str) -> dict:
    return next(f for f in engine.manifest["files"] if f["path"] == rel)


# --- damaged objects spread ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["flip", "truncate", "exec"])
def test_a_damaged_object_is_replaced_and_fsck_and_repair_mend_the_engines_holding_it(
    store, tmp_path, how, monkeypatch
):
    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "reference"))
    clean_final = build_engine(EMBEDDED, "final").engine.id
    monkeypatch.setenv("SPECPILOT_ENGINES", str(store))
    ar = build_engine(EMBEDDED, "ar").engine
    want = entry(ar, SERVER)
    obj = object_path(store, want["blake3"], want["exec"])
    assert os.path.samestat(obj.stat(), (ar.path / SERVER).stat())
    damage(obj, how)  # the engine `ar` holds the damaged inode too
    out = cli("engine", "fsck")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"{ar.id[:12]}: {SERVER}" in out.stdout and obj.name in out.stdout and "1 engines" in out.stdout
    final = build_engine(EMBEDDED, "final").engine  # needs the same runtime file
    assert final.id == clean_final and check_engine(final) == []
    repaired = cli("engine", "check", "--repair", ar.id[:12])
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert check_engine(ar) == [] and check_engine(final) == []
    again = cli("engine", "fsck")
    assert again.returncode == 0 and "0 damaged" in again.stdout, again.stdout


def test_a_damaged_object_repaired_from_the_checkout_and_config_when_no_build_ran(store):
    engine = build_engine(EMBEDDED, "stock").engine
    for rel in (SERVER, "config.json"):
        e = entry(engine, rel)
        damage(object_path(store, e["blake3"], e["exec"]), "flip")
    assert cli("engine", "check", engine.id).returncode == 1
    out = cli("engine", "check", "--repair", engine.id)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the checkout" in out.stdout and "the manifest's config" in out.stdout
    assert check_engine(engine) == [] and cli("engine", "fsck").returncode == 0


@pytest.fixture(scope="module")
def sglang_wheel():
    from specpilot_build.locations import data_dir
    from specpilot_build.pins.lockfile import load_lock

    pin = load_lock().runtimes["sglang"]
    if not (data_dir() / "wheels" / pin.filename).is_file() and os.environ.get("SPECPILOT_MIRROR", "x") == "":
        pytest.skip("the pinned SGLang wheel is not cached")
    return pin


@pytest.mark.slow
@pytest.mark.sglang
def test_a_damaged_sglang_member_does_not_spread_to_the_next_build_and_is_re_extracted(store, sglang_wheel):
    ar = build_engine(SGLANG, "ar").engine
    clean = entry(ar, SERVER_ARGS)
    obj = object_path(store, clean["blake3"], clean["exec"])
    damage(obj, "flip")
    shutil.rmtree(store / INDEX)  # as after any builder change: every key is new
    assert build_engine(SGLANG, "ar").engine.id == ar.id
    stock = build_engine(SGLANG, "stock").engine  # built from the pinned wheel, not the object
    assert entry(stock, SERVER_ARGS) == clean and check_engine(stock) == []
    out = cli("engine", "fsck")
    assert out.returncode == 1 and f"{ar.id[:12]}: {SERVER_ARGS}" in out.stdout
    assert cli("engine", "check", "--repair", ar.id).returncode == 0 and check_engine(ar) == []
    damage(obj, "truncate")  # now held by both engines
    out = cli("engine", "check", "--repair", stock.id)
    assert out.returncode == 0 and "the pinned base wheel" in out.stdout, out.stdout + out.stderr
    assert check_engine(stock) == []
    fsck = cli("engine", "fsck", "--repair")
    assert fsck.returncode == 0 and check_engine(ar) == [], fsck.stdout
    assert cli("engine", "fsck").returncode == 0


@pytest.mark.slow
@pytest.mark.sglang
def test_a_patched_file_is_re_made_by_a_same_id_rebuild_and_otherwise_named_as_unrepairable(store, sglang_wheel):
    patched = "python/sglang/srt/entrypoints/http_server.py"  # written by the engine-id overlay's patch
    final = build_engine(SGLANG, "final").engine
    other = build_engine(SGLANG, "final", ["batching.concurrency=2"]).engine  # an override: another head
    assert entry(other, patched) == entry(final, patched)
    e = entry(final, patched)
    damage(object_path(store, e["blake3"], e["exec"]), "flip")  # both engines hold it
    out = cli("engine", "check", "--repair", other.id)
    assert out.returncode == 4 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert f"cannot repair {patched}" in out.stdout and "gives another engine" in out.stdout
    assert f"engine rm {other.id[:12]}" in out.stdout
    out = cli("engine", "check", "--repair", final.id, timeout=300)
    assert out.returncode == 0 and "a rebuild of its setting" in out.stdout, out.stdout + out.stderr
    assert check_engine(final) == []
    assert cli("engine", "check", "--repair", other.id).returncode == 0 and check_engine(other) == []


# --- the index is a cache -------------------------------------------------------------------------------------


def test_a_forged_index_entry_is_ignored_and_the_right_engine_built(store, tmp_path):
    ar = build_engine(EMBEDDED, "ar").engine
    final = build_engine(EMBEDDED, "final").engine
    key = next(p for p in (store / INDEX).iterdir() if p.read_text().strip() == final.id)
    for forged in (ar.id, str(tmp_path), "../" + ar.id, "0" * 64, ar.id.upper()):
        os.chmod(key, 0o644)
        key.write_text(forged + "\n")
        out = cli("engine", "build", "--setting", EMBEDDED, "--arm", "final")
        assert out.returncode == 0 and out.stdout.split()[0] == final.id, (forged, out.stdout, out.stderr)
        assert key.read_text().strip() == final.id
    shutil.rmtree(final.path)  # an entry naming a removed engine: rebuilt
    assert build_engine(EMBEDDED, "final").engine.id == final.id and check_engine(final) == []


# --- links and special files ----------------------------------------------------------------------------------


def test_links_and_fifos_in_an_engine_are_named_by_verify_and_removed_by_repair(store, tmp_path):
    engine = build_engine(EMBEDDED, "ar").engine
    outside = tmp_path / "outside"
    (outside / "pkg").mkdir(parents=True)
    (outside / "pkg" / "evil.py").write_text("print('loaded from outside')\n")
    os.symlink(outside / "pkg", engine.path / "runtime" / "evil_dir")
    os.symlink(outside / "pkg" / "evil.py", engine.path / "runtime" / "evil.py")
    os.mkfifo(engine.path / "runtime" / "pipe")
    (engine.path / "runtime" / "empty").mkdir()
    out = cli("engine", "check", engine.id, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    for line in (
        "runtime/evil_dir: a symbolic link",
        "runtime/evil.py: a symbolic link",
        "runtime/pipe: a FIFO",
        "runtime/empty/: a directory not in the manifest",
    ):
        assert line in out.stdout
    serve = cli("serve", "--engine", engine.id, "--dry-run", timeout=60)
    assert serve.returncode == 2 and "runtime/evil_dir" in serve.stderr and "--repair" in serve.stderr
    before = snapshot(outside)
    assert cli("engine", "check", "--repair", engine.id, timeout=60).returncode == 0
    assert check_engine(engine) == [] and snapshot(outside) == before


def _scratch_copy(tmp_path: Path, name: str) -> Path:
    copy = tmp_path / name
    shutil.copytree(REPO / name, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


@pytest.mark.parametrize("what", ["folder-link", "dir-link", "file-link", "fifo"])
def test_a_link_or_fifo_in_an_overlay_is_refused_naming_it(store, tmp_path, what):
    overlays = _scratch_copy(tmp_path, "overlays")
    outside = tmp_path / "outside"
    outside.mkdir()
    target = overlays / "engine-id"
    if what == "folder-link":
        shutil.move(target, outside / "engine-id")
        os.symlink(outside / "engine-id", target)
        bad = target
    else:
        (target / "files").mkdir(exist_ok=True)
        bad = target / "files" / "python"
        if what == "dir-link":
            (outside / "python").mkdir()
            os.symlink(outside / "python", bad)
        elif what == "file-link":
            (outside / "x.py").write_text("")
            os.symlink(outside / "x.py", bad)
        else:
            os.mkfifo(bad)
    before = snapshot(tmp_path, skip=store)
    out = cli(
        "engine", "build", "--setting", SGLANG, "--arm", "final", env={"SPECPILOT_OVERLAYS": str(overlays)}, timeout=60
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert str(bad) in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert snapshot(tmp_path, skip=store) == before and engine_dirs(store) == []


@pytest.mark.parametrize("what", ["folder-link", "dir-link", "fifo"])
def test_a_link_or_fifo_in_a_kernel_folder_is_refused_naming_it(store, tmp_path, what):
    kernels = _scratch_copy(tmp_path, "kernels")
    outside = tmp_path / "outside"
    outside.mkdir()
    if what == "folder-link":
        shutil.move(kernels / "w12", outside / "w12")
        bad = kernels / "w12"
        os.symlink(outside / "w12", bad)
    elif what == "dir-link":
        bad = kernels / "w12" / "linked"
        os.symlink(outside, bad)
    else:
        bad = kernels / "w12" / "gemm_pipe.py"
        os.mkfifo(bad)
    before = snapshot(tmp_path, skip=store)
    out = cli(
        "engine", "build", "--setting", W12, "--arm", "final", env={"SPECPILOT_KERNELS": str(kernels)}, timeout=60
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert str(bad) in out.stderr
    assert snapshot(tmp_path, skip=store) == before and engine_dirs(store) == []


@pytest.mark.parametrize("mode, words", [(0o010644, "FIFO"), (0o020644, "device"), (0o120777, "escapes")])
def test_a_wheel_member_that_is_not_a_file_refuses_the_wheel(tmp_path, mode, words):
    from specpilot_build.assemble.tree import _check_member

    wheel = tmp_path / "x-1-py3-none-any.whl"
    info = zipfile.ZipInfo("x/member.py")
    info.external_attr = mode << 16
    with pytest.raises(SpecPilotError, match=words):
        _check_member(wheel, info)


# --- names become paths ---------------------------------------------------------------------------------------


def _with_kernel(composed, kernel: str):
    mechanisms = composed.config["final"]["mechanisms"]
    body = {"kernels": [kernel]}
    if isinstance(mechanisms, dict):  # name -> body
        mechanisms["x"] = body
    else:
        mechanisms.append({"name": "x", **body})
    return composed


@pytest.mark.parametrize("kernel", ["../../../../outside/k", "OUTSIDE", "..", "a/../../k"])
def test_a_kernel_name_that_is_a_path_is_refused_and_nothing_is_written(store, tmp_path, kernel, monkeypatch):
    from specpilot_build.assemble import inputs

    outside = tmp_path / "outside"
    (outside / "k").mkdir(parents=True)
    (outside / "k" / "k.py").write_text("x = 1\n")
    kernels = tmp_path / "a" / "b" / "c" / "kernels"
    kernels.mkdir(parents=True)
    monkeypatch.setattr(inputs, "KERNELS_DIR", kernels)
    name = str(outside / "k") if kernel == "OUTSIDE" else kernel
    before = snapshot(tmp_path, skip=store)
    with pytest.raises(SpecPilotError, match="kernel name .* is not a plain name"):
        build_composed(_with_kernel(compose_setting(EMBEDDED, "final"), name))
    assert snapshot(tmp_path, skip=store) == before and engine_dirs(store) == []


@pytest.mark.parametrize("name", ["../../outside/o", "/etc", ".."])
def test_an_overlay_name_that_is_a_path_is_refused(store, name):
    composed = compose_setting(EMBEDDED, "final")
    composed.config["hardware"]["overlays"] = [name]
    with pytest.raises(SpecPilotError, match="overlay name .* is not a plain name"):
        build_composed(composed)
    assert engine_dirs(store) == []


@pytest.mark.parametrize("filename", ["../../outside.whl", "/tmp/x.whl", "a/b.whl"])
def test_a_lockfile_wheel_filename_that_is_a_path_is_refused(store, tmp_path, filename):
    lock = tmp_path / "lock"
    shutil.copytree(REPO / "lockfiles", lock)
    text = (lock / "runtimes.toml").read_text()
    import re

    (lock / "runtimes.toml").write_text(re.sub(r'filename = "[^"]+"', f'filename = "{filename}"', text, count=1))
    before = snapshot(tmp_path, skip=store)
    out = cli("engine", "build", "--setting", SGLANG, "--arm", "ar", env={"SPECPILOT_LOCKFILES": str(lock)})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "wheel filename" in out.stderr and "not a plain name" in out.stderr and filename in out.stderr
    assert snapshot(tmp_path, skip=store) == before and engine_dirs(store) == []


# --- one damaged directory does not break the store view --------------------------------------------------------


@pytest.mark.slow
def test_a_damaged_engine_directory_is_listed_and_every_verb_says_what_to_do(store):
    engine = build_engine(EMBEDDED, "ar").engine
    bad_json, no_manifest = store / ("ab" * 32), store / ("cd" * 32)
    bad_json.mkdir()
    (bad_json / "manifest.json").write_text("{not json")
    no_manifest.mkdir()
    (no_manifest / "config.json").write_text("{}")
    listing = cli("engine", "ls")
    assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stderr
    assert engine.id in listing.stdout and "damaged" in listing.stdout
    assert "no manifest.json" in listing.stdout and "not valid JSON" in listing.stdout
    for args in (["engine", "check", "cdcd"], ["engine", "show", "cdcd"], ["serve", "--engine", "cdcd", "--dry-run"]):
        out = cli(*args)
        assert out.returncode == 3 and "Traceback" not in out.stderr, (args, out.stderr)
        assert "no manifest.json" in out.stderr and "engine rm cdcdcdcdcdcd" in out.stderr
    fsck = cli("engine", "fsck")
    assert fsck.returncode == 3 and "2 damaged directories" in fsck.stdout
    os.chmod(engine.path / "manifest.json", 0o644)
    (engine.path / "manifest.json").unlink()  # the engine a build finds through the index
    out = cli("engine", "build", "--setting", EMBEDDED, "--arm", "ar")
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr
    assert f"engine rm {engine.id[:12]}" in out.stderr
    for ref in (engine.id, "abab", "cdcd"):
        assert cli("engine", "rm", ref).returncode == 0
    assert engine_dirs(store) == []
    assert build_engine(EMBEDDED, "ar").engine.id == engine.id and check_engine(engine) == []


# --- rm and gc ------------------------------------------------------------------------------------------------


def test_gc_removes_garbage_and_keeps_served_and_rooted_engines(store, tmp_path, monkeypatch):
    data = tmp_path / "data"
    (data / "runs").mkdir(parents=True)
    monkeypatch.setenv("SPECPILOT_DATA", str(data))
    ar, stock, final = (build_engine(EMBEDDED, arm).engine for arm in ("ar", "stock", "final"))
    (store / ".tmp" / "999999999-deadbeef0000").mkdir(parents=True)  # a killed build's tree
    (store / INDEX / ("ef" * 32)).write_text("0" * 64 + "\n")  # dangling
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", ar.id])
    try:
        (data / "runs" / "30123.json").write_text(json.dumps({"port": 30123, "pid": server.pid, "engine_id": ar.id}))
        (store / ".roots").write_text(f"# keep\n{stock.id[:16]}\n")
        refused = cli("engine", "rm", ar.id)
        assert refused.returncode == 2 and "served on port 30123" in refused.stderr
        dry = cli("engine", "gc", "--dry-run", "--engines")
        assert dry.returncode == 0 and f"would remove engine {final.id}" in dry.stdout
        assert final.path.is_dir()
        out = cli("engine", "gc", "--engines")
        assert out.returncode == 0, out.stderr
        assert [p.name for p in sorted(engine_dirs(store))] == sorted([ar.id, stock.id])
        assert not (store / ".tmp" / "999999999-deadbeef0000").exists()
        assert not (store / INDEX / ("ef" * 32)).exists()
        assert "unreferenced objects" in out.stdout and "0 unreferenced objects" not in out.stdout
        assert cli("engine", "fsck").returncode == 0
        assert check_engine(ar) == [] and check_engine(stock) == []
    finally:
        server.kill()
        server.wait()

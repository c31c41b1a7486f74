"""make bundle: the embedded default packed, split, checked and installed with the standard-library installer,
then served from the prefix (nothing of the checkout on the path) exactly like from the store."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import blake3
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_runtime_helpers import free_port

from specpilot_build.assemble.builder import build_engine
from specpilot_build.bundle import install as installer
from specpilot_build.bundle.pack import INDEX_NAME, make_bundle, split_archive
from specpilot_build.errors import IntegrityError
from specpilot_build.locations import REPO_ROOT
from specpilot_build.store.engines import Engine, check_engine

EMBEDDED = "cpu_c1_stories260k_handwritten"  # the embedded model, its final drafting from n-grams alone (no drafter)
PART_BYTES = 256 * 1024  # the embedded bundle is ~1.1 MB: five parts


@pytest.fixture(scope="module")
def engine(shared) -> Engine:
    return build_engine(EMBEDDED, "final").engine


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory) -> Path:
    """A small environment directory standing in for a host's pruned wheels."""
    env = tmp_path_factory.mktemp("env")
    (env / "bundle_probe").mkdir()
    (env / "bundle_probe" / "__init__.py").write_text("WHERE = 'the bundle environment'\n")
    return env


@pytest.fixture(scope="module")
def bundle(engine, env_dir, tmp_path_factory) -> Path:
    return make_bundle(
        [engine], part_bytes=PART_BYTES, env_dir=env_dir, out=tmp_path_factory.mktemp("bundles") / "b"
    ).path


@pytest.fixture(scope="module")
def prefix(bundle, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("host") / "prefix"
    out = run_installer(bundle, target)
    assert out.returncode == 0, out.stderr
    return target


def run_installer(bundle: Path, target: Path) -> subprocess.CompletedProcess:
    """As on the host: the installer beside the parts, with no site-packages at all (-I -S: stdlib only)."""
    return subprocess.run(
        [sys.executable, "-I", "-S", str(bundle / "install.py"), str(bundle), str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def index_of(bundle: Path) -> dict:
    return json.loads((bundle / INDEX_NAME).read_text())


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


# --- pack, split, check, unpack -------------------------------------------------------------------------------


def test_the_index_names_the_archive_and_every_part_by_size_sha256_and_blake3(bundle, engine):
    index = index_of(bundle)
    joined = b"".join((bundle / p["name"]).read_bytes() for p in index["parts"])
    assert len(index["parts"]) == -(-len(joined) // PART_BYTES) >= 2
    assert all(p["size"] <= PART_BYTES for p in index["parts"])
    assert index["archive"]["id"] == "blake3:" + blake3.blake3(joined).hexdigest()
    assert index["archive"]["size"] == len(joined)
    for part in index["parts"]:
        data = (bundle / part["name"]).read_bytes()
        assert part["blake3"] == blake3.blake3(data).hexdigest() and part["size"] == len(data)
    assert [e["id"] for e in index["engines"]] == [engine.id] and index["host"] is None


def test_the_installed_prefix_holds_the_engine_exactly_as_stored(prefix, engine, bundle):
    installed = Engine(engine.id, prefix / "engines" / engine.id)
    assert check_engine(installed) == []
    assert (prefix / "engines" / engine.id / "manifest.json").read_bytes() == (
        engine.path / "manifest.json"
    ).read_bytes()
    converted = engine.manifest["inputs"]["checkpoints"]["model"]["converted"]
    model = next(p for p in (prefix / "data" / "converted").rglob("model.safetensors"))
    assert {f["path"]: f["size"] for f in converted} == {p.name: p.stat().st_size for p in model.parent.iterdir()}
    assert (prefix / "env" / "bundle_probe" / "__init__.py").is_file()
    assert os.access(prefix / "bin" / "specpilot", os.X_OK)
    assert (prefix / "specpilot" / "specpilot_build" / "cli" / "main.py").is_file()
    assert not list((prefix / "specpilot").rglob("test_*.py"))
    assert leftovers(prefix.parent) == ["prefix"]  # the temporary folder is gone


def test_the_installer_prints_the_serve_command(bundle, tmp_path, engine):
    out = run_installer(bundle, tmp_path / "p")
    assert out.returncode == 0, out.stderr
    assert f"{tmp_path / 'p'}/bin/specpilot serve --engine {engine.id} --port 30000" in out.stdout


def test_two_bundles_of_the_same_engine_are_byte_identical(engine, env_dir, bundle, tmp_path):
    model = next((Path(os.environ["SPECPILOT_DATA"]) / "converted").rglob("model.safetensors"))
    os.utime(model, (1, 1))  # mtimes do not enter the archive
    again = make_bundle([engine], part_bytes=PART_BYTES, env_dir=env_dir, out=tmp_path / "again").path
    assert (again / INDEX_NAME).read_bytes() == (bundle / INDEX_NAME).read_bytes()
    for part in index_of(bundle)["parts"]:
        assert (again / part["name"]).read_bytes() == (bundle / part["name"]).read_bytes()


@settings(max_examples=25, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_flipped_byte_in_any_part_is_refused_naming_the_part(bundle, data):
    parts = index_of(bundle)["parts"]
    part = data.draw(st.sampled_from(parts), label="part")
    offset = data.draw(st.integers(0, part["size"] - 1), label="offset")
    bit = data.draw(st.integers(0, 7), label="bit")
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "bundle"
        shutil.copytree(bundle, copy)
        raw = bytearray((copy / part["name"]).read_bytes())
        raw[offset] ^= 1 << bit
        (copy / part["name"]).write_bytes(bytes(raw))
        with pytest.raises(installer.InstallError, match=f"part {part['name']}: sha256 .* damaged"):
            installer.install(copy, Path(scratch) / "host" / "prefix")
        assert leftovers(Path(scratch) / "host") == []


def test_a_missing_part_is_refused_by_name_before_anything_is_read(bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    (copy / "part-001").unlink()
    out = run_installer(copy, tmp_path / "host" / "prefix")
    assert out.returncode == 1 and "missing part part-001" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "host").exists()


def test_a_truncated_part_is_refused_by_name(bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    last = index_of(bundle)["parts"][-1]["name"]
    (copy / last).write_bytes((copy / last).read_bytes()[:-1])
    out = run_installer(copy, tmp_path / "prefix")
    assert out.returncode == 1 and f"part {last}:" in out.stderr and not (tmp_path / "prefix").exists()


def test_an_existing_prefix_is_not_touched(bundle, tmp_path):
    (tmp_path / "prefix").mkdir()
    (tmp_path / "prefix" / "mine").write_text("keep")
    out = run_installer(bundle, tmp_path / "prefix")
    assert out.returncode == 1 and "already exists" in out.stderr
    assert leftovers(tmp_path / "prefix") == ["mine"]


def _hostile_archive(member: tarfile.TarInfo, data: bytes, folder: Path) -> Path:
    """An archive with one good file and `member`, and an index whose digests are all correct."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:xz") as tar:
        good = tarfile.TarInfo("engines/readme.txt")
        good.size = 2
        tar.addfile(good, io.BytesIO(b"ok"))
        tar.addfile(member, io.BytesIO(data) if member.isfile() else None)
    archive = folder / "hostile.tar.xz"
    archive.write_bytes(raw.getvalue())
    split_archive(archive, folder / "bundle", 4096, {"engines": [], "host": None, "environment": False})
    return folder / "bundle"


def _member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "", size: int = 4) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, linkname, size if kind == tarfile.REGTYPE else 0
    return info


@pytest.mark.parametrize(
    "member, says",
    [
        (_member("../escaped"), "would land outside the prefix"),
        (_member("engines/../../escaped"), "would land outside the prefix"),
        (_member("/tmp/escaped-absolute"), "would land outside the prefix"),
        (_member("engines/link", tarfile.SYMTYPE, "/etc/passwd"), "is a symbolic link"),
        (_member("engines/inside", tarfile.SYMTYPE, "readme.txt"), "is a symbolic link"),
        (_member("engines/hard", tarfile.LNKTYPE, "/etc/passwd"), "is a hard link"),
        (_member("engines/fifo", tarfile.FIFOTYPE), "is a device or FIFO"),
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "symlink-out", "symlink-in", "hardlink", "fifo"],
)
def test_a_member_escaping_the_prefix_is_refused_and_nothing_is_written(member, says, tmp_path):
    hostile = _hostile_archive(member, b"evil", tmp_path)
    host = tmp_path / "host"
    host.mkdir()
    out = run_installer(hostile, host / "prefix")
    assert out.returncode == 1 and says in out.stderr and repr(member.name) in out.stderr, out.stderr
    assert leftovers(host) == [] and not (tmp_path / "escaped").exists() and not Path("/tmp/escaped-absolute").exists()


def test_a_tampered_engine_is_refused_at_bundle_time_naming_the_file(tmp_path, monkeypatch, shared):
    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines"))
    engine = build_engine(EMBEDDED, "ar").engine
    target = engine.path / "runtime" / "specpilot_runtime" / "server.py"
    os.chmod(target, 0o644)
    target.write_text(target.read_text() + "\n# tampered\n")
    with pytest.raises(IntegrityError, match="runtime/specpilot_runtime/server.py"):
        make_bundle([engine], part_bytes=PART_BYTES, out=tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_an_environment_that_is_not_what_its_installer_recorded_is_refused(engine, env_dir, tmp_path):
    probe = env_dir / "bundle_probe" / "__init__.py"
    recorded = {"bundle_probe/__init__.py": "blake3:" + blake3.blake3(probe.read_bytes()).hexdigest()}
    assert make_bundle([engine], part_bytes=PART_BYTES, env_dir=env_dir, env_files=recorded, out=tmp_path / "ok")
    with pytest.raises(IntegrityError, match="bundle_probe/other.py is missing"):
        make_bundle(
            [engine],
            part_bytes=PART_BYTES,
            env_dir=env_dir,
            env_files={**recorded, "bundle_probe/other.py": recorded["bundle_probe/__init__.py"]},
            out=tmp_path / "a",
        )
    with pytest.raises(IntegrityError, match="bundle_probe/__init__.py is not in its record"):
        make_bundle([engine], part_bytes=PART_BYTES, env_dir=env_dir, env_files={}, out=tmp_path / "a")
    changed = {"bundle_probe/__init__.py": "blake3:" + blake3.blake3(b"other bytes").hexdigest()}
    with pytest.raises(IntegrityError, match="bundle_probe/__init__.py: its bytes differ"):
        make_bundle([engine], part_bytes=PART_BYTES, env_dir=env_dir, env_files=changed, out=tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# --- serve from the prefix ------------------------------------------------------------------------------------


def prefix_env() -> dict:
    """The host's view: none of the test session's SpecPilot or Hugging Face variables, nothing of the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECPILOT_", "HF_", "PYTHON"))}
    env["PYTHON"] = sys.executable
    return env


def specpilot_in(prefix: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(prefix / "bin" / "specpilot"), *args],
        capture_output=True,
        text=True,
        env=prefix_env(),
        cwd=prefix.parent,
        timeout=timeout,
    )


def test_bin_specpilot_runs_the_prefixs_specpilot_with_the_environment_first(prefix, tmp_path):
    probe = tmp_path / "python"
    probe.write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'import os, specpilot_build, bundle_probe; "
        f'print(specpilot_build.__file__); print(bundle_probe.WHERE); print(os.environ["SPECPILOT_ENGINES"])\'\n'
    )
    probe.chmod(0o755)
    out = subprocess.run(
        [str(prefix / "bin" / "specpilot"), "serve"],
        capture_output=True,
        text=True,
        env={**prefix_env(), "PYTHON": str(probe)},
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    where, probe_says, engines = out.stdout.splitlines()
    assert Path(where).is_relative_to(prefix / "specpilot") and not Path(where).is_relative_to(REPO_ROOT)
    assert probe_says == "the bundle environment" and engines == str(prefix / "engines")


def test_the_engine_gets_the_environment_after_its_own_tree_on_pythonpath(prefix, engine):
    out = specpilot_in(prefix, "serve", "--engine", engine.id, "--dry-run")
    assert out.returncode == 0, out.stderr
    tree = prefix / "engines" / engine.id
    assert f"PYTHONPATH={tree}/runtime:{tree}/kernels:{prefix}/env" in out.stdout.splitlines()


def generate(port: int, golden: dict) -> list[int]:
    n = len(golden["sequence_ids"]) - len(golden["prompt_ids"])
    reply = httpx.post(
        f"http://127.0.0.1:{port}/generate",
        timeout=120,
        json={"input_ids": golden["prompt_ids"], "sampling_params": {"max_new_tokens": n, "temperature": 0}},
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["output_ids"]


@pytest.mark.slow
def test_served_from_the_prefix_it_answers_as_from_the_store_and_a_tampered_tree_is_refused(
    bundle, engine, golden, tmp_path
):
    prefix = tmp_path / "prefix"
    assert run_installer(bundle, prefix).returncode == 0
    store_port, prefix_port = free_port(), free_port()
    store = subprocess.run(
        [sys.executable, "-m", "specpilot_build.cli", "serve", "--engine", engine.id, "--port", str(store_port)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert store.returncode == 0, store.stderr
    try:
        from_store = generate(store_port, golden)
    finally:
        subprocess.run(
            [sys.executable, "-m", "specpilot_build.cli", "stop", "--port", str(store_port)],
            capture_output=True,
            cwd=REPO_ROOT,
            timeout=60,
        )
    served = specpilot_in(prefix, "serve", "--engine", engine.id[:12], "--port", str(prefix_port))
    assert served.returncode == 0, served.stderr
    try:
        record = json.loads((prefix / "data" / "runs" / f"{prefix_port}.json").read_text())
        assert record["engine_id"] == engine.id and str(prefix / "engines" / engine.id) in record["argv"]
        assert httpx.get(f"http://127.0.0.1:{prefix_port}/server_info").json()["engine_id"] == engine.id
        from_prefix = generate(prefix_port, golden)
    finally:
        stopped = specpilot_in(prefix, "stop", "--port", str(prefix_port))
    assert stopped.returncode == 0 and "stopped engine" in stopped.stdout
    assert from_prefix == from_store and len(from_prefix) > 0
    assert golden["prompt_ids"] + from_prefix == golden["sequence_ids"][: len(golden["prompt_ids"]) + len(from_prefix)]

    target = prefix / "engines" / engine.id / "runtime" / "specpilot_runtime" / "server.py"
    target.chmod(target.stat().st_mode | stat.S_IWUSR)
    target.write_text(target.read_text() + "\n# tampered on the host\n")
    refused = specpilot_in(prefix, "serve", "--engine", engine.id, "--port", str(prefix_port))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "runtime/specpilot_runtime/server.py" in refused.stderr and "refusing to serve" in refused.stderr


def test_the_bundle_carries_the_pinned_benchmark_files_where_bench_looks_for_them(tmp_path, monkeypatch):
    import shutil

    from specpilot_build.bundle.contents import dataset_members
    from specpilot_build.measure.datasets import BENCHMARKS, dataset_file, load_split

    members = dataset_members()
    assert len(members) == len(BENCHMARKS)
    prefix_data = tmp_path / "data"  # as install.py lays the prefix out; no mirror on the host
    for m in members:
        (prefix_data / m.name[len("data/") :]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(m.source, prefix_data / m.name[len("data/") :])
    monkeypatch.setenv("SPECPILOT_DATA", str(prefix_data))
    monkeypatch.setenv("SPECPILOT_MIRROR", "")
    import specpilot_build.measure.datasets as datasets

    def no_download(pin, cached):  # the host has no network: a file not where bench looks is a failure here
        raise AssertionError(f"{pin['file']} not found in the prefix")

    monkeypatch.setattr(datasets, "_download", no_download)
    for name in BENCHMARKS:
        assert dataset_file(name).is_relative_to(prefix_data)
        assert len(load_split(name, limit=2)) == 2


# --- measure on a host with only the installed bundle ----------------------------------------------------------


@pytest.fixture(scope="module")
def measured_prefix(engine, tmp_path_factory) -> tuple[Path, Engine]:
    """ar + final bundled and installed: the stock/final arms' oracle is then in the store, never built."""
    ar = build_engine(EMBEDDED, "ar").engine
    bundle = make_bundle([ar, engine], part_bytes=4 * PART_BYTES, out=tmp_path_factory.mktemp("bundles") / "m").path
    target = tmp_path_factory.mktemp("host") / "prefix"
    assert run_installer(bundle, target).returncode == 0
    return target, ar


def without_the_builder(folder: Path) -> dict:
    """The CLI process sees the prefix's SpecPilot, then packages only the builder needs that fail to import,
    as on a host with an installed bundle (this test session's venv has both on its path)."""
    for name in ("specpilot_runtime", "hydra"):
        (folder / "blocked" / name).mkdir(parents=True)
        (folder / "blocked" / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n"
        )
    python = folder / "python"  # bin/specpilot sets PYTHONPATH itself: the folder goes on after it, here
    python.write_text(f'#!/bin/sh\nPYTHONPATH="$PYTHONPATH:{folder / "blocked"}" exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return {**prefix_env(), "PYTHON": str(python)}


@pytest.mark.slow
def test_without_the_builder_bench_and_verify_take_the_ar_engine_by_id(measured_prefix, engine, tmp_path):
    prefix, ar = measured_prefix
    env = without_the_builder(tmp_path)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(prefix / "bin" / "specpilot"), *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=300,
        )

    port = free_port()
    bench = (
        "bench",
        "--engine",
        engine.id[:12],
        "--port",
        str(port),
        "--limit",
        "1",
        "--max-new-tokens",
        "24",
        "--datasets",
        "gsm8k",
    )
    served = cli("serve", "--engine", engine.id[:12], "--port", str(port))
    assert served.returncode == 0, served.stderr
    try:
        pid = json.loads((prefix / "data" / "runs" / f"{port}.json").read_text())["pid"]
        child = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
        assert "blocked" not in child["PYTHONPATH"]  # the engine imports its runtime from its own tree
        built = cli(*bench, "--run", "no_oracle")
        named = cli(*bench, "--run", "final", "--oracle", ar.id)
        wrong = cli(*bench, "--run", "wrong", "--oracle", engine.id)
    finally:
        stopped = cli("stop", "--port", str(port))
    assert stopped.returncode == 0, stopped.stderr

    assert built.returncode == 2 and "Traceback" not in built.stderr, built.stderr
    assert built.stderr.count("\n") == 1 and f"cannot build the ar engine of {EMBEDDED} here" in built.stderr
    assert re.search(r"no module named '(specpilot_runtime|hydra)'", built.stderr), built.stderr
    assert f"pass --oracle {ar.id[:12]}" in built.stderr
    assert not (prefix / "data" / "results" / "no_oracle.json").exists()

    assert named.returncode == 0, named.stderr
    results = json.loads((prefix / "data" / "results" / "final.json").read_text())
    assert results["engine_id"] == engine.id and results["oracle_engine_id"] == ar.id and results["requests"]

    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr
    assert f"--oracle {engine.id[:12]} is {EMBEDDED}/final, not the ar arm of {EMBEDDED}" in wrong.stderr
    assert not (prefix / "data" / "results" / "wrong.json").exists()

    verified = cli("verify", "final", "--oracle", ar.id, "--port", str(free_port()))
    assert verified.returncode == 0 and "lossless" in verified.stdout, verified.stdout + verified.stderr
    report = json.loads((prefix / "data" / "results" / "final.verify.json").read_text())
    assert report["verdict"] == "lossless" and report["oracle_engine_id"] == ar.id


def test_each_engine_file_is_packed_beside_the_same_file_of_the_other_engines(engine, shared):
    """xz only finds a repeat within its window (8 MiB at preset 6): eight SGLang engine trees of ~49 MB each were
    packed one after the other and each compressed on its own (237 MB); packed file by file beside the other engines'
    copy they are stored once (119 MB). The order is fixed, so bundles stay byte-identical."""
    from specpilot_build.bundle.contents import bundle_members

    ar = build_engine(EMBEDDED, "ar").engine
    names = [m.name for m in bundle_members([engine, ar])]
    assert names == [m.name for m in bundle_members([ar, engine])]  # the engines' order does not matter
    trees = [n for n in names if n.startswith("engines/")]
    pairs = [(a, b) for a, b in zip(trees, trees[1:]) if a.split("/", 2)[2] == b.split("/", 2)[2]]
    common = {n.split("/", 2)[2] for n in trees if n.startswith(f"engines/{ar.id}/")} & {
        n.split("/", 2)[2] for n in trees if n.startswith(f"engines/{engine.id}/")
    }
    assert common and len(pairs) == len(common)  # every file both trees hold: the two copies side by side
    assert len(names) == len(set(names))

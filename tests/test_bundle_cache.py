"""Bundles and binary caches agree: `specpilot bundle --cache` takes its engines from a cache (pulled, verified,
then bundled: the same archive as from the store), and `specpilot cache import` pushes a bundle's engines into a
file:// cache that then serves as an air-gapped site's substituter. Against moto's S3 server on loopback and
file://, with the real embedded engines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import test_cache
from test_cache import EMBEDDED, LOOSE, _tampered_object, new_bucket, snapshot, substituting

from specpilot_build.assemble.builder import build_engine
from specpilot_build.bundle.pack import INDEX_NAME, make_bundle
from specpilot_build.cache.maintain import check_cache, list_entries
from specpilot_build.cache.push import push_engine
from specpilot_build.cache.remote import BinaryCache
from specpilot_build.cli.main import main
from specpilot_build.store.engines import Engine, check_engine

pytestmark = pytest.mark.slow  # each test packs or unpacks an xz archive of the engines
PART_MB = "0.25"
moto, source, keys = test_cache.moto, test_cache.source, test_cache.keys  # the same fixtures, this module's scope


def index_of(bundle: Path) -> dict:
    return json.loads((bundle / INDEX_NAME).read_text())


def leftovers(data: Path) -> list[str]:
    """Scratch folders a bundle or an import left in the data directory."""
    return sorted(p.name for p in data.glob(".bundle-pull-*")) + sorted(p.name for p in data.glob(".cache-import-*"))


@pytest.fixture
def data(tmp_path, monkeypatch, shared):
    """An empty store and a data directory of this test's own (the mirror still supplies the models)."""
    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "store"))
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    monkeypatch.delenv("SPECPILOT_DEBUG", raising=False)
    (tmp_path / "data").mkdir()
    return tmp_path / "data"


def test_a_bundle_of_engines_from_an_s3_cache_is_the_bundle_of_the_same_engines_from_the_store(
    moto, source, keys, data, tmp_path, capsys
):
    root, engines = source
    final = engines["final"]
    url = f"s3://{new_bucket()}/specpilot"
    push_engine(final, BinaryCache(url), keys["trusted"], root)
    out = tmp_path / "from-cache"
    args = ["bundle", final.id[:12], "--cache", url, "--trust", keys["public"], "--part-mb", PART_MB]
    assert main([*args, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"pulled 1 engine(s) from {url}" in err and "(verified)" in err
    assert [e["id"] for e in index_of(out)["engines"]] == [final.id]
    assert snapshot(tmp_path / "store") == set() and leftovers(data) == []  # the user's store is untouched
    from_store = make_bundle([final], part_bytes=int(float(PART_MB) * 2**20), out=tmp_path / "from-store")
    assert index_of(out)["archive"] == from_store.index["archive"]  # byte for byte the same archive
    # and it installs: the engine tree in the prefix matches its manifest
    prefix = tmp_path / "host" / "prefix"
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(out / "install.py"), str(out), str(prefix)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert check_engine(Engine(final.id, prefix / "engines" / final.id)) == []


def test_a_bundle_from_a_cache_refuses_what_it_cannot_trust_and_writes_nothing(source, keys, data, tmp_path, capsys):
    root, engines = source
    url = f"file://{tmp_path}/cache"
    cache = BinaryCache(url)
    push_engine(engines["final"], cache, keys["trusted"], root, **LOOSE)
    words = _tampered_object(cache, engines, keys)
    out = tmp_path / "bundle"
    code = main(["bundle", engines["final"].id, "--cache", url, "--trust", keys["public"], "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1 and words in err and "Traceback" not in err
    assert not out.exists() and leftovers(data) == []
    # an untrusted signer: refused too, naming the entry's signer
    code = main(["bundle", engines["final"].id, "--cache", url, "--out", str(out)])
    assert code == 3 and "signed by key 'ci-1', which is not trusted" in capsys.readouterr().err


def test_a_bundle_imported_into_a_file_cache_substitutes_builds_on_the_air_gapped_site(
    source, keys, data, tmp_path, monkeypatch, capsys
):
    root, engines = source
    final, stock = engines["final"], engines["stock"]
    bundle = make_bundle([final, stock], part_bytes=int(float(PART_MB) * 2**20), out=tmp_path / "bundle").path
    url = f"file://{tmp_path}/site-cache"
    assert main(["cache", "import", str(bundle), "--cache", url, "--key", str(keys["secret"])]) == 0
    out = capsys.readouterr().out
    assert out.count(f"to {url}:") == 2 and final.id in out and stock.id in out
    cache = BinaryCache(url)
    report = check_cache(cache, keys["trust"])
    assert report.problems == [] and report.entries == 2 and report.manifests == 2
    # the entries name the build keys the builder computes, so `engine build` on the site substitutes
    assert {(e.engine, e.arm, e.problem) for e in list_entries(cache, keys["trust"])} == {
        (final.id, "final", None),
        (stock.id, "stock", None),
    }
    for arm, engine in (("final", final), ("stock", stock)):
        built = build_engine(EMBEDDED, arm, substituting(url, keys["public"]))
        assert built.pulled_from == url and built.engine.id == engine.id
        assert check_engine(built.engine) == []
    assert leftovers(data) == []


def test_a_damaged_bundle_is_refused_by_name_and_nothing_is_pushed(source, keys, data, tmp_path, capsys):
    root, engines = source
    bundle = make_bundle([engines["final"]], part_bytes=int(float(PART_MB) * 2**20), out=tmp_path / "bundle").path
    part = bundle / "part-001"
    data_bytes = bytearray(part.read_bytes())
    data_bytes[100] ^= 1
    part.write_bytes(bytes(data_bytes))
    url = f"file://{tmp_path}/site-cache"
    code = main(["cache", "import", str(bundle), "--cache", url, "--key", str(keys["secret"])])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1 and "part part-001: sha256" in err and "Traceback" not in err
    assert not (tmp_path / "site-cache").exists() and leftovers(data) == []

"""The store format of docs/store.md, pinned by golden vectors: a tiny tree -> its exact manifest bytes -> its
exact engine id. The literals below were worked out by hand from docs/store.md (the JSON written as a string,
each digest by the blake3 library), not taken from the code under test: any change to canonical JSON, file
digests, entry order or the id fails here by name. Also: the forms an engine id is accepted in, and `engine ls`
listing every directory named like an engine whose manifest is missing or invalid, with the reason."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import blake3
import pytest

from specpilot_build.errors import SpecPilotError
from specpilot_build.store.engines import OBJECTS, commit, new_build_dir, object_path, resolve_engine
from specpilot_build.store.manifest import (
    MANIFEST_NAME,
    SCHEMA,
    canonical_json,
    digest_bytes,
    engine_id,
    source_dir_digest,
)
from specpilot_build.store.names import engine_prefix

REPO = Path(__file__).resolve().parent.parent

# (path, content, executable): byte order puts "B" before "a", and "dir.txt" ('.' 0x2e) before "dir/..." ('/')
TREE = [
    ("B.txt", b"upper\n", False),
    ("a.txt", b"hello\n", False),
    ("bin/run", b"#!/bin/sh\necho hi\n", True),
    ("dir.txt", b"", False),
    ("dir/\u00fc.txt", "grüße\n".encode(), False),
]
HEAD = {
    "schema": "specpilot.manifest/1",
    "setting": "golden",
    "arm": "ar",
    "config": {"x": 0.5, "n": 1, "text": 'tab\there "q" é', "none": None, "flag": True},
}
DIGESTS = {  # blake3 of each content; the empty one is BLAKE3's published test vector for no input
    "B.txt": "8f668586f11d1237890bb7d5d14c7b59bd772c5e768d443c87eaf1f51ff01c35",
    "a.txt": "8e4c7c1b99dbfd50e7a95185fead5ee1448fa904a2fdd778eaf5f2dbfd629a99",
    "bin/run": "4b694fa6468140836e2f43625aca1150ec72032dc23a12e13416ca026c647ef3",
    "dir.txt": "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262",
    "dir/\u00fc.txt": "da86b9ca82b3db35a2d555b9b5f1463be6e18fadb0c87585f6d1a423fc305b52",
}
GOLDEN_MANIFEST = (
    b'{"arm":"ar","config":{"flag":true,"n":1,"none":null,"text":"tab\\there \\"q\\" \xc3\xa9","x":0.5},"files":['
    b'{"blake3":"blake3:8f668586f11d1237890bb7d5d14c7b59bd772c5e768d443c87eaf1f51ff01c35","exec":false,'
    b'"path":"B.txt","size":6},'
    b'{"blake3":"blake3:8e4c7c1b99dbfd50e7a95185fead5ee1448fa904a2fdd778eaf5f2dbfd629a99","exec":false,'
    b'"path":"a.txt","size":6},'
    b'{"blake3":"blake3:4b694fa6468140836e2f43625aca1150ec72032dc23a12e13416ca026c647ef3","exec":true,'
    b'"path":"bin/run","size":18},'
    b'{"blake3":"blake3:af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262","exec":false,'
    b'"path":"dir.txt","size":0},'
    b'{"blake3":"blake3:da86b9ca82b3db35a2d555b9b5f1463be6e18fadb0c87585f6d1a423fc305b52","exec":false,'
    b'"path":"dir/\xc3\xbc.txt","size":8}'
    b'],"schema":"specpilot.manifest/1","setting":"golden"}'
)
GOLDEN_ID = "ee04a171fa5060bcc66c6c2157ccdcfc67b6be2188e01906c1ecc5f9d78244e4"
# the directory digest (runtime, overlay, kernel): canonical JSON of [{blake3, exec, path}] in byte order
GOLDEN_DIR_DIGEST = "blake3:54e2a73caa2252a24c09937b6539dd9831f3ae0af38b67b264d024f23ad1bf38"


def write_tree(tree: Path, file_mode: int = 0o644, exec_mode: int = 0o755, mtime: int = 0) -> None:
    for rel, data, executable in TREE:
        path = tree / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.chmod(path, exec_mode if executable else file_mode)
        os.utime(path, (mtime, mtime))
    (tree / "empty" / "nested").mkdir(parents=True)  # holds no file: not recorded, not kept


def golden_engine(root: Path):
    tree = new_build_dir(root)
    write_tree(tree)
    return commit(tree, HEAD, root)[0]


def cli(*args: str, store: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specpilot_build.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "SPECPILOT_ENGINES": str(store)},
        cwd=REPO,
        timeout=120,
        check=False,
    )


# --- golden vectors ----------------------------------------------------------------------------------------


def test_the_golden_vectors_follow_the_spec_by_an_independent_computation():
    assert blake3.blake3(b"").hexdigest() == DIGESTS["dir.txt"]  # the library is BLAKE3 (published vector)
    for rel, data, _ in TREE:
        assert blake3.blake3(data).hexdigest() == DIGESTS[rel], rel
    entries = ",".join(
        f'{{"blake3":"blake3:{DIGESTS[rel]}","exec":{"true" if x else "false"},"path":"{rel}","size":{len(data)}}}'
        for rel, data, x in TREE
    )
    by_hand = (
        '{"arm":"ar","config":{"flag":true,"n":1,"none":null,"text":"tab\\there \\"q\\" é","x":0.5},'
        f'"files":[{entries}],"schema":"specpilot.manifest/1","setting":"golden"}}'
    ).encode()
    assert by_hand == GOLDEN_MANIFEST
    assert blake3.blake3(GOLDEN_MANIFEST).hexdigest() == GOLDEN_ID


def test_a_tiny_tree_gives_exactly_the_golden_manifest_bytes_and_id(tmp_path):
    root = tmp_path / "engines"
    engine = golden_engine(root)
    assert engine.id == GOLDEN_ID
    assert engine.path == root / GOLDEN_ID
    assert (engine.path / MANIFEST_NAME).read_bytes() == GOLDEN_MANIFEST
    assert stat.S_IMODE(os.lstat(engine.path / MANIFEST_NAME).st_mode) == 0o444
    assert canonical_json(json.loads(GOLDEN_MANIFEST)) == GOLDEN_MANIFEST
    assert engine_id(json.loads(GOLDEN_MANIFEST)) == GOLDEN_ID
    assert not (engine.path / "empty").exists()
    assert SCHEMA == HEAD["schema"]


def test_objects_are_named_by_digest_and_exec_bit_and_hold_the_tree_s_inodes(tmp_path):
    root = tmp_path / "engines"
    engine = golden_engine(root)
    for rel, data, executable in TREE:
        hexdigest = DIGESTS[rel]
        obj = root / OBJECTS / hexdigest[:2] / (hexdigest + (".x" if executable else ""))
        assert object_path(root, digest_bytes(data), executable) == obj
        st = os.lstat(obj)
        assert os.path.samestat(st, os.lstat(engine.path / rel)), rel
        assert stat.S_IMODE(st.st_mode) == (0o555 if executable else 0o444)
        assert obj.read_bytes() == data


def test_mtimes_and_permission_bits_other_than_exec_do_not_move_the_id(tmp_path):
    root = tmp_path / "engines"
    tree = new_build_dir(root)
    write_tree(tree, file_mode=0o600, exec_mode=0o100, mtime=1_700_000_000)
    assert commit(tree, HEAD, root)[0].id == GOLDEN_ID
    other = new_build_dir(tmp_path / "other")
    write_tree(other)
    os.chmod(other / "a.txt", 0o744)  # an exec bit is content
    assert commit(other, HEAD, tmp_path / "other")[0].id != GOLDEN_ID


def test_the_directory_digest_of_the_tiny_tree(tmp_path):
    write_tree(tmp_path / "src")
    (tmp_path / "src" / "__pycache__").mkdir()
    (tmp_path / "src" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"ignored")
    (tmp_path / "src" / "y.pyc").write_bytes(b"ignored")
    assert source_dir_digest(tmp_path / "src") == GOLDEN_DIR_DIGEST


def test_canonical_json_escapes_sorts_and_writes_numbers_as_the_spec_says():
    value = {
        "b": [-0.0, 1e-05, 1e16, 0.1, 1.0, 12345678901234567890],
        "a": '\x00\x1f\b\f\n\r\t\\"/\x7fé€😀',
        "A": {},
        "": [],
    }
    assert canonical_json(value) == (
        b'{"":[],"A":{},"a":"\\u0000\\u001f\\b\\f\\n\\r\\t\\\\\\"/\x7f\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80",'
        b'"b":[-0.0,1e-05,1e+16,0.1,1.0,12345678901234567890]}'
    )


# --- engine references ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ref",
    [GOLDEN_ID, GOLDEN_ID[:4], f"blake3:{GOLDEN_ID}", f"blake3:{GOLDEN_ID[:8]}", f"  BLAKE3:{GOLDEN_ID[:12].upper()} "],
)
def test_an_engine_is_found_by_its_id_or_prefix_bare_or_typed(tmp_path, ref):
    root = tmp_path / "engines"
    golden_engine(root)
    assert engine_prefix(ref) == ref.strip().lower().removeprefix("blake3:")
    assert resolve_engine(ref, root).id == GOLDEN_ID


@pytest.mark.parametrize("ref", ["", "ee0", "blake3:", "blake3:ee0", "sha256:ee04a171", "ee04-a171", "x" * 8, "e" * 65])
def test_what_is_not_an_engine_reference_is_refused_by_name(ref):
    with pytest.raises(SpecPilotError, match="is not an engine id"):
        engine_prefix(ref)


def test_the_cli_takes_the_typed_id_wherever_it_takes_an_id(tmp_path):
    store = tmp_path / "engines"
    golden_engine(store)
    check = cli("engine", "check", f"blake3:{GOLDEN_ID[:10]}", store=store)
    assert check.returncode == 0 and f"engine {GOLDEN_ID[:12]}: 5 files match the manifest" in check.stdout, check
    wrong = cli("engine", "check", f"sha256:{GOLDEN_ID[:10]}", store=store)
    assert wrong.returncode == 2 and "is not an engine id" in wrong.stderr and "Traceback" not in wrong.stderr
    removed = cli("engine", "rm", f"blake3:{GOLDEN_ID}", store=store)
    assert removed.returncode == 0 and f"removed {GOLDEN_ID}" in removed.stdout, removed
    assert not (store / GOLDEN_ID).exists()


# --- damaged directories ----------------------------------------------------------------------------------


def test_engine_ls_lists_every_directory_without_a_valid_manifest_with_the_reason(tmp_path):
    store = tmp_path / "engines"
    golden_engine(store)
    not_a_manifest = b'{"files":[]}'
    bad_entry = GOLDEN_MANIFEST.replace(b'"size":6}', b'"size":"6"}', 1)
    cases: dict[str, tuple[bytes | None, str]] = {
        "11" * 32: (None, "no manifest.json"),
        "22" * 32: (GOLDEN_MANIFEST[:100], "manifest.json is not valid JSON"),
        "33" * 32: (b"\xff\xfenot json", "manifest.json is not valid JSON"),
        "44" * 32: (GOLDEN_MANIFEST, "manifest.json does not hash to the directory's name"),
        "55" * 32: (b"", "manifest.json is empty"),
        blake3.blake3(not_a_manifest).hexdigest(): (
            not_a_manifest,
            "manifest.json is not an engine manifest (schema None, not 'specpilot.manifest/1')",
        ),
        blake3.blake3(bad_entry).hexdigest(): (bad_entry, "manifest.json is not an engine manifest (files[0].size"),
    }
    for name, (manifest, _) in cases.items():
        (store / name).mkdir()
        (store / name / "config.json").write_text("{}")
        if manifest is not None:
            (store / name / MANIFEST_NAME).write_bytes(manifest)
    (store / ("66" * 32) / MANIFEST_NAME).mkdir(parents=True)
    cases["66" * 32] = (None, "manifest.json is a directory, not a file")
    os.symlink(store / GOLDEN_ID, store / ("77" * 32))
    cases["77" * 32] = (None, "a symbolic link, not a directory")

    listing = cli("engine", "ls", store=store)
    assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stderr
    rows = {line.split()[1]: line for line in listing.stdout.splitlines() if line.startswith("│")}
    assert "golden" in rows[GOLDEN_ID] and "damaged" not in rows[GOLDEN_ID]
    for name, (_, reason) in cases.items():
        assert "damaged" in rows[name] and reason in rows[name], (name, rows.get(name))
    assert f"{len(cases)} damaged engine directories" in listing.stdout
    for name in ("22" * 32, blake3.blake3(not_a_manifest).hexdigest()):
        out = cli("engine", "check", name[:8], store=store)
        assert out.returncode == 3 and f"engine rm {name[:12]}" in out.stderr and "Traceback" not in out.stderr
        assert cli("engine", "rm", name, store=store).returncode == 0
        assert not (store / name).exists()


def test_the_spec_s_worked_example_is_the_golden_vector():
    spec = (REPO / "docs" / "store.md").read_text(encoding="utf-8")
    example = spec.split("## 10. Example", 1)[1]
    block = example.split("```\n", 2)[1]
    assert "".join(block.splitlines()).encode("utf-8") == GOLDEN_MANIFEST
    assert f"{len(GOLDEN_MANIFEST)} bytes" in example
    assert GOLDEN_ID in example and GOLDEN_DIR_DIGEST in example
    assert f".objects/4b/{DIGESTS['bin/run']}.x" in example and f".objects/8e/{DIGESTS['a.txt']}`" in example

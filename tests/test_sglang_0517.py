"""A second pinned SGLang base: 0.5.17 (the last release pinned to torch 2.11.0, what the H200 host serves) beside
0.5.23, chosen per setting with the runtime option conf/runtime/sglang-0.5.17.yaml (`runtime=sglang-0.5.17`).

Its pin, its pruning rules, its own cut of the engine-id patch, the clear refusals of the 0.5.23 patches on 0.5.17's
files (W12's 0.5.17 cut: tests/test_w12_0517.py), and the build-time flag check, read from 0.5.17's own parser in the
flag-check environment its runtime file declares (pinned packages, torchvision as an import-only stand-in)."""

from __future__ import annotations

import hashlib
import re
import zipfile
from pathlib import Path

import pytest

from specpilot_build.assemble.inputs import resolve_inputs
from specpilot_build.assemble.overlays import apply_overlays, overlay_inputs
from specpilot_build.config.compose import compose_setting
from specpilot_build.config.effective import effective_config
from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import REPO_ROOT
from specpilot_build.pins.lockfile import WheelPin, load_lock

PADDED = "h200_c1_stories260k-padded_ngram"  # on sglang-0.5.17 (its preset's runtime choice)
OLD = ["runtime=sglang-0.5.17"]
NEW = ["runtime=sglang"]
HTTP_SERVER = "python/sglang/srt/entrypoints/http_server.py"
ENGINE_ID_LINE = '"engine_id": os.environ.get("SPECPILOT_ENGINE_ID")'


@pytest.fixture(scope="module")
def pin() -> WheelPin:
    return load_lock(REPO_ROOT / "lockfiles").runtimes["sglang-0.5.17"]


@pytest.fixture(scope="module")
def wheel(pin, session_data) -> Path:
    """The pinned 0.5.17 wheel as the builder obtains it (conftest's copy of the outer data dir's wheels, the
    mirror, else pip download), hash-checked."""
    from specpilot_build.pins.wheels import wheel_file

    path = wheel_file(pin)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == pin.sha256
    return path


def test_0517_is_pinned_beside_0523(pin):
    runtimes = load_lock(REPO_ROOT / "lockfiles").runtimes
    assert runtimes["sglang"].version == "0.5.23"
    assert (pin.version, pin.filename, pin.size) == (
        "0.5.17",
        "sglang-0.5.17-cp311-cp311-manylinux_2_34_x86_64.whl",
        22301836,
    )
    assert re.fullmatch(r"[0-9a-f]{64}", pin.sha256)


@pytest.mark.parametrize("arm", ["ar", "stock", "final"])
def test_the_runtime_option_selects_the_0517_pin_and_its_overlay(arm):
    composed = compose_setting(PADDED, arm, OLD)
    assert composed.choices["runtime"] == "sglang-0.5.17"
    inputs = resolve_inputs(composed, load_lock(REPO_ROOT / "lockfiles"))
    assert inputs.runtime_record["version"] == "0.5.17" and inputs.runtime_record["name"] == "sglang-0.5.17"
    assert [o["name"] for o in inputs.overlays] == ["engine-id-0.5.17"]
    assert inputs.config["runtime"]["launch_args"]["attention-backend"] == "triton"  # the setting's, kept
    assert resolve_inputs(compose_setting(PADDED, arm), load_lock(REPO_ROOT / "lockfiles")).record() == inputs.record()
    new = resolve_inputs(compose_setting(PADDED, arm, NEW), load_lock(REPO_ROOT / "lockfiles"))
    assert new.runtime_record["version"] == "0.5.23" and "flag_check" not in new.config["runtime"]


def _tree_with_http_server(wheel: Path, root: Path, dist_info: bool) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        data = zf.read("sglang/srt/entrypoints/http_server.py")
    (root / HTTP_SERVER).parent.mkdir(parents=True)
    (root / HTTP_SERVER).write_bytes(data)
    if dist_info:
        (root / "python" / "sglang-0.5.17.dist-info").mkdir()
    return root


@pytest.mark.sglang
def test_the_0517_engine_id_patch_applies_and_the_0523_one_is_refused(wheel, tmp_path):
    cfg = effective_config(compose_setting(PADDED, "stock", OLD).config)
    tree = _tree_with_http_server(wheel, tmp_path / "a", dist_info=True)
    [record] = apply_overlays(tree, overlay_inputs(["engine-id-0.5.17"], cfg), cfg)
    text = (tree / HTTP_SERVER).read_text()
    assert text.count(ENGINE_ID_LINE) == 2
    compile(text, HTTP_SERVER, "exec")
    assert [f["path"] for f in record["files"]] == [HTTP_SERVER]
    # 0.5.23's patch on 0.5.17's file: refused by its version range ...
    new_cfg = effective_config(compose_setting(PADDED, "stock", NEW).config)
    tree = _tree_with_http_server(wheel, tmp_path / "b", dist_info=True)
    with pytest.raises(
        SpecPilotError,
        match=r"overlays/engine-id/overlay.toml: applies to sglang >=0.5.23,<0.5.24, "
        r"but the pinned sglang is 0.5.17",
    ):
        apply_overlays(tree, overlay_inputs(["engine-id"], new_cfg), new_cfg)
    # ... and, without a dist-info to read the version from, by the strict patcher (its /server_info hunk)
    tree = _tree_with_http_server(wheel, tmp_path / "c", dist_info=False)
    with pytest.raises(SpecPilotError, match="engine-id"):
        apply_overlays(tree, overlay_inputs(["engine-id"], new_cfg), new_cfg)


@pytest.mark.sglang
@pytest.mark.slow
def test_the_0517_pruning_rules_keep_what_the_padded_ngram_engine_loads(wheel):
    from specpilot_build.assemble.prune import select_members

    for arm in ("ar", "final"):
        cfg = effective_config(compose_setting(PADDED, arm, OLD).config)
        with zipfile.ZipFile(wheel) as zf:
            members = [i for i in zf.infolist() if not i.is_dir()]
            kept, record = select_members(zf, members, cfg)
        names = {m.filename for m in kept}
        assert {
            "sglang/srt/models/llama.py",
            "sglang/srt/entrypoints/http_server.py",
            "sglang/launch_server.py",
            "sglang/srt/layers/attention/triton_backend.py",
            "sglang-0.5.17.dist-info/licenses/LICENSE",
        } <= names
        assert "sglang/srt/speculative/ngram_worker.py" in names or arm == "ar"
        assert not any(n.startswith("sglang/multimodal_gen/") for n in names)
        assert any("device_name=NVIDIA_H200" in n for n in names)
        # 67 %, not 0.5.23's <= 60 %: two compiled cores imported inside functions (the Rust server mode's
        # sglang/srt/server/_core, 13 MB; the gRPC mode's sglang/srt/grpc/_core, 6.5 MB) are in the static closure
        assert record["kept_bytes"] <= 0.70 * record["total_bytes"]
        assert "LlamaForCausalLM model" in record["rules"]


@pytest.mark.sglang
@pytest.mark.slow
def test_the_padded_setting_builds_on_0517_its_flags_read_with_the_torchvision_stand_in(wheel):
    from specpilot_build.assemble.builder import build_engine

    engine = build_engine(PADDED, "final").engine
    assert engine.manifest["inputs"]["runtime"]["version"] == "0.5.17"
    assert engine.manifest["base"]["overlays"][0]["name"] == "engine-id-0.5.17"
    assert (engine.path / HTTP_SERVER).read_text().count(ENGINE_ID_LINE) == 2
    # this Python has no torchvision: the placeholder stood in for it, and the manifest says so
    [used] = engine.manifest["base"]["flag_check"]["stand_ins_used"]
    assert used["module"] == "torchvision" and used["because"].startswith("ModuleNotFoundError")
    assert engine.manifest["config"]["runtime"]["flag_check"]["stand_ins"] == ["torchvision"]


@pytest.mark.sglang
@pytest.mark.slow
def test_a_stand_in_is_used_only_where_the_real_module_fails_to_import(wheel):
    from specpilot_build.assemble.builder import build_engine

    # dill is among the pinned packages, so it imports for real; torchvision still does not
    engine = build_engine(PADDED, "ar", ["runtime.flag_check.stand_ins=[torchvision,dill]"]).engine
    assert [u["module"] for u in engine.manifest["base"]["flag_check"]["stand_ins_used"]] == ["torchvision"]


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize(
    "override,named",
    [
        (
            "+runtime.launch_args.sampling-backnd=pytorch",
            [
                "--sampling-backnd",
                "runtime.launch_args",
                "is not a flag of SGLang 0.5.17",
                "did you mean --sampling-backend?",
            ],
        ),
        ("runtime.launch_args.attention-backend=tritn", ["--attention-backend", "'tritn'", "triton"]),
    ],
)
def test_a_flag_0517_would_refuse_fails_the_build_naming_it(wheel, override, named):
    from specpilot_build.assemble.builder import build_engine
    from specpilot_build.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        build_engine(PADDED, "stock", [override])
    assert all(part in str(error.value) for part in named), str(error.value)


@pytest.mark.parametrize(
    "override,named",
    [
        (
            "runtime.flag_check.packages=['transformers>=5']",
            ["runtime.flag_check.packages", "'transformers>=5'", "exact pin", "override runtime.flag_check.packages="],
        ),
        ("runtime.flag_check.stand_ins=[torchvision.io]", ["runtime.flag_check.stand_ins", "'torchvision.io'"]),
        ("+runtime.flag_check.extra=1", ["runtime.flag_check.extra"]),
    ],
)
def test_a_flag_check_that_is_not_exact_pins_and_module_names_is_refused_at_compose(override, named):
    from specpilot_build.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        compose_setting(PADDED, "ar", [override])
    assert all(part in str(error.value) for part in named), str(error.value)

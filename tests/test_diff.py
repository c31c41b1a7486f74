"""`specpilot diff A B`: the auditor's answer to "why did the hash change", from two real SGLang engines."""

from __future__ import annotations

import json

import pytest

from specpilot_build.cli.main import main
from specpilot_build.config.compose import compose_setting


@pytest.fixture
def store(builds, monkeypatch):
    monkeypatch.setenv("SPECPILOT_ENGINES", str(builds.store))
    return builds


def run(capsys, *argv):
    code = main(["diff", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def mechanisms_of(setting: str) -> list[dict]:
    """The setting's `final` mechanisms as its preset lists them from conf/mechanism/ (the diff's expected answer)."""
    declared = compose_setting(setting, "final").config["final"]["mechanisms"]
    return [dict(body, name=name) for name, body in declared.items()]


@pytest.mark.parametrize("setting", ["h100_c16_qwen38-27b-fp8_dflash2", "h100_c1_qwen3-8b_eagle3"])
def test_stock_vs_final_names_exactly_the_overlays_and_arguments_that_differ(store, capsys, setting):
    stock, final = store.engines[setting, "stock"], store.engines[setting, "final"]
    code, out, _ = run(capsys, stock.id, final.id, "--json")
    report = json.loads(out)
    assert code == 1 and not report["identical"]
    mechanisms = mechanisms_of(setting)
    kernels = sorted({f"kernel.{k}" for m in mechanisms for k in m.get("kernels", [])})
    assert [(p["key"], p["old"]) for p in report["pins"]] == [(k, "(absent)") for k in kernels]
    overlays = sorted(m["overlay"] for m in mechanisms if m.get("overlay"))
    assert sorted(o["name"] for o in report["overlays"]) == overlays
    assert {o["change"] for o in report["overlays"]} <= {"added"}
    for engine in (stock, final):  # the engine-id overlay is the SGLang base's: in both arms, no difference
        assert engine.manifest["inputs"]["overlays"][0]["name"] == "engine-id"
    for added in report["overlays"]:
        assert added["hunks"] and all(h.startswith("patches/") for h in added["hunks"])
    stock_args = json.loads((stock.path / "launch.json").read_bytes())["argv"]
    tuned = {f"--{k}": str(v) for m in mechanisms for k, v in m.get("launch_args", {}).items()}
    for m in mechanisms:  # a later mechanism's quantization wins, as the arm applies them in order
        if m.get("model", {}).get("quantization"):
            tuned["--quantization"] = m["model"]["quantization"]
    expected = {
        flag: (stock_args[stock_args.index(flag) + 1] if flag in stock_args else "(absent)", value)
        for flag, value in tuned.items()
    }
    args = {c["key"]: (c["old"], c["new"]) for c in report["launch"] if c["key"].startswith("--")}
    assert args == {flag: change for flag, change in expected.items() if change[0] != change[1]} and args
    modified = {f["path"] for f in report["files"]["modified"]}
    touched = {f for o in report["overlays"] for f in o["files"]}
    assert {"config.json", "launch.json"} <= modified
    changed_python = {
        f["path"]
        for k in ("added", "modified", "removed")
        for f in report["files"][k]
        if f["path"].startswith("python/")
    }
    assert changed_python == touched

    code, text, _ = run(capsys, stock.id[:10], final.id[:10])
    lines = text.splitlines()
    assert code == 1 and lines[2] == "why the id differs:"
    why = "\n".join(lines[3 : lines.index("")])
    assert all(f"overlay added: {name}" in why for name in overlays)
    assert all(f"{flag} {old} → {new}" in why for flag, (old, new) in args.items())


def test_two_settings_show_pin_and_config_differences_first(store, capsys):
    a = store.engines["h100_c1_qwen38-27b_dflash2", "final"]
    b = store.engines["h100_c1_qwen38-27b_dspark", "final"]
    code, text, _ = run(capsys, a.id, b.id)
    lines = text.splitlines()
    assert code == 1
    why = [ln.strip() for ln in lines[3:6]]
    assert why[0].startswith("pin checkpoint.drafter: z-lab/Qwen3.8-27B-DFlash2@")
    assert "→ z-lab/Qwen3.8-27B-DSpark@" in why[0]
    assert why[1].startswith("config: ") and "drafter" in why[1]
    sections = [ln for ln in lines if ln and not ln.startswith(" ") and ln.endswith(":")]
    assert sections[:4] == ["why the id differs:", "pins:", "config:", "launch:"]
    assert any(ln.startswith("  + python/sglang/srt/models/dspark.py (") for ln in lines)


def test_identical_engines_exit_0_and_unknown_ids_exit_2(store, capsys):
    engine = store.engines["h100_c1_qwen3-8b_dflash", "final"]
    code, text, _ = run(capsys, engine.id, engine.id[:8])
    assert code == 0 and text.splitlines()[-1] == "identical"
    code, _, err = run(capsys, engine.id, "0000dead")
    assert code == 2 and "no engine 0000dead" in err


def test_files_shows_unified_diffs_of_changed_text_files(store, capsys):
    stock = store.engines["h100_c1_qwen3-8b_dflash", "stock"]
    final = store.engines["h100_c1_qwen3-8b_dflash", "final"]
    code, text, _ = run(capsys, stock.id, final.id, "--files")
    assert code == 1
    assert "--- a/python/sglang/srt/layers/quantization/__init__.py" in text  # the w12 mechanism's patch
    assert "+from sglang.srt.layers.quantization.w12 import W12Config" in text
    assert '-  "name": "stock",' in text and '+  "name": "final",' in text  # config.json, indented


def test_the_output_is_deterministic(store, capsys):
    a = store.engines["h100_c1_qwen38-27b_dflash2", "stock"]
    b = store.engines["rtx-pro-6000_c16_qwen38-27b-fp8_dflash2", "final"]
    first = run(capsys, a.id, b.id, "--json")[1]
    assert run(capsys, a.id, b.id, "--json")[1] == first
    report = json.loads(first)
    paths = [f["path"] for f in report["files"]["added"]]
    assert paths == sorted(paths, key=str.encode) and paths

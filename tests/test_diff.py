"""`specpilot diff A B`: the auditor's answer to "why did the hash change", from two real SGLang engines."""
from __future__ import annotations

import json

import pytest

from sglang_builds import all_builds
from specpilot_build.diff import main


@pytest.fixture(scope="session")
def builds(tmp_path_factory):
    return all_builds(tmp_path_factory.getbasetemp() / "sglang-builds")


@pytest.fixture
def store(builds, monkeypatch):
    monkeypatch.setenv("SPECPILOT_ENGINES", str(builds.store))
    return builds


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_stock_vs_final_names_exactly_the_overlays_and_arguments_that_differ(store, capsys):
    stock = store.engines["h100_c16_qwen38-27b-fp8_dflash2", "stock"]
    final = store.engines["h100_c16_qwen38-27b-fp8_dflash2", "final"]
    code, out, _ = run(capsys, stock.id, final.id, "--json")
    report = json.loads(out)
    assert code == 1 and not report["identical"]
    assert report["pins"] == []
    assert [(o["name"], o["change"]) for o in report["overlays"]] == [("engine-id", "added")]
    assert any("@@ -839,6 +839,8 @@" in hunk for hunk in report["overlays"][0]["hunks"])
    args = {c["key"]: (c["old"], c["new"]) for c in report["launch"]}
    assert args == {"--speculative-dflash-block-size": ("(absent)", "8"),
                    "--cuda-graph-max-bs-decode": ("(absent)", "16"),
                    "--max-running-requests": ("(absent)", "16")}
    modified = [f["path"] for f in report["files"]["modified"]]
    assert modified == ["config.json", "launch.json", "python/sglang/srt/entrypoints/http_server.py"]
    assert report["files"]["added"] == report["files"]["removed"] == []

    code, text, _ = run(capsys, stock.id[:10], final.id[:10])
    lines = text.splitlines()
    assert code == 1 and lines[2] == "why the id differs:"
    why = "\n".join(lines[3:8])
    assert "overlay added: engine-id" in why and "--speculative-dflash-block-size (absent) → 8" in why


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
    assert "--- a/python/sglang/srt/entrypoints/http_server.py" in text
    assert '+        "engine_id": os.environ.get("SPECPILOT_ENGINE_ID"),' in text
    assert '-  "name": "stock",' in text and '+  "name": "final",' in text  # config.json, indented


def test_the_output_is_deterministic(store, capsys):
    a = store.engines["h100_c1_qwen38-27b_dflash2", "stock"]
    b = store.engines["rtx-pro-6000_c16_qwen38-27b-fp8_dflash2", "final"]
    first = run(capsys, a.id, b.id, "--json")[1]
    assert run(capsys, a.id, b.id, "--json")[1] == first
    report = json.loads(first)
    paths = [f["path"] for f in report["files"]["added"]]
    assert paths == sorted(paths, key=str.encode) and paths

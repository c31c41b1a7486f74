"""Pruning a wheel: the launcher's static import closure plus what the setting's rules keep, on a small wheel
written by the test (the real SGLang wheel is covered by test_sglang_engines.py)."""

from __future__ import annotations

import zipfile

import pytest

from specpilot_build.assemble.prune import select_members
from specpilot_build.errors import SpecPilotError

SOURCES = {
    "app/__init__.py": "",
    "app/launch.py": "import os\nfrom app.core import run\nfrom . import util\n"
    "def main():\n    from app.lazy import later\n",
    "app/core/__init__.py": "from .engine import Engine\n",
    "app/core/engine.py": "from ..plugins import (\n    alpha,  # used\n    beta,\n)\n",
    "app/util.py": "import app.deep.leaf as leaf\n",
    "app/deep/__init__.py": "",
    "app/deep/leaf.py": "X = 1\n",
    "app/lazy.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.typing_only import T\n",
    "app/typing_only.py": "T = int\n",
    "app/plugins/__init__.py": "",
    "app/plugins/alpha.py": "",
    "app/plugins/beta.py": "",
    "app/plugins/gamma.py": "",
    "app/models/__init__.py": "",
    "app/models/llama.py": "",
    "app/models/qwen.py": "",
    "app/tables/h100.json": "{}",
    "app/tables/b200.json": "{}",
    "app/tables/h100_old.json": "{}",
    "app-1.0.dist-info/METADATA": "Name: app\n",
    "app-1.0.dist-info/licenses/LICENSE": "Apache-2.0\n",
}


@pytest.fixture
def wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    path = tmp_path / "app-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in SOURCES.items():
            zf.writestr(name, text)
    return path


def select(wheel, rules, cfg=None):
    cfg = {"runtime": {"prune": {"launcher": "app.launch", "rules": rules}}, **(cfg or {})}
    with zipfile.ZipFile(wheel) as zf:
        kept, record = select_members(zf, zf.infolist(), cfg)
    return {m.filename for m in kept}, record


def test_the_closure_follows_function_relative_and_submodule_imports_but_not_type_checking(wheel):
    kept, record = select(wheel, [])
    assert kept == {
        "app/__init__.py",
        "app/launch.py",
        "app/core/__init__.py",
        "app/core/engine.py",
        "app/util.py",
        "app/deep/__init__.py",
        "app/deep/leaf.py",
        "app/lazy.py",
        "app/plugins/__init__.py",
        "app/plugins/alpha.py",
        "app/plugins/beta.py",
    }
    assert record["kept_files"] == len(kept) and record["total_files"] == len(SOURCES)
    assert record["dropped_files"] == len(SOURCES) - len(kept)
    assert record["kept_bytes"] + record["dropped_bytes"] == sum(len(t) for t in SOURCES.values())


def test_rules_keep_modules_and_globs_only_when_the_setting_matches(wheel):
    rules = [
        {"why": "metadata", "files": ["*.dist-info/*"]},
        {"why": "qwen", "when": {"model.architecture": "Qwen"}, "modules": ["app.models.qwen"]},
        {"why": "llama", "when": {"model.architecture": "Llama"}, "modules": ["app.models.llama"]},
        {"why": "all plugins", "modules": ["app.plugins.*"]},
        {"why": "h100", "when": {"hardware.name": "h100"}, "files": ["app/tables/h100*"], "drop": ["*_old.json"]},
    ]
    kept, record = select(wheel, rules, {"model": {"architecture": "Qwen"}, "hardware": {"name": "h100"}})
    assert {
        "app/models/qwen.py",
        "app/models/__init__.py",
        "app/plugins/gamma.py",
        "app/tables/h100.json",
        "app-1.0.dist-info/METADATA",
        "app-1.0.dist-info/licenses/LICENSE",
    } <= kept
    assert not kept & {"app/models/llama.py", "app/tables/b200.json", "app/tables/h100_old.json"}
    assert record["rules"] == ["metadata", "qwen", "all plugins", "h100"]


def test_a_rule_naming_a_module_the_wheel_lacks_fails_naming_it(wheel):
    with pytest.raises(SpecPilotError, match="module app.models.mistral is not in the wheel"):
        select(wheel, [{"why": "mistral", "modules": ["app.models.mistral"]}])


def test_the_import_graph_is_cached_per_wheel_and_gives_the_same_answer(wheel, tmp_path):
    first = select(wheel, [])
    cached = list((tmp_path / "data" / "cache" / "import-graph").glob("*.json"))
    assert len(cached) == 1
    assert select(wheel, []) == first

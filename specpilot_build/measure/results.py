"""Bench results on disk: <data>/results/<name>.json, found by path or by run name."""
from __future__ import annotations

import json
import os
from pathlib import Path

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import data_dir

SCHEMA = "specpilot.results/1"


def results_dir() -> Path:
    return data_dir() / "results"


def results_path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise SpecPilotError(f"run name {name!r} must be a plain file name (no '/', not starting with '.')")
    return results_dir() / f"{name}.json"


def load_results(ref: str | Path) -> tuple[Path, dict]:
    """A results file given as a path or as a run name; refuses anything that is not a bench results file."""
    path = Path(ref)
    if not path.is_file():
        candidate = results_path(str(ref)) if "/" not in str(ref) else path
        if not candidate.is_file():
            raise SpecPilotError(f"{ref}: no such results file (looked for {path} and {candidate})")
        path = candidate
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecPilotError(f"{path}: not a JSON results file ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise SpecPilotError(f"{path}: not a bench results file (schema is not {SCHEMA})")
    return path, data


def write_json(path: Path, data: dict) -> Path:
    """Write atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    partial.replace(path)
    return path

"""Bench results on disk: <data>/results/<name>.json, found by path or by run name.

Schema 2 records, besides the requests, what binds a run to its inputs: the engine's manifest (blake3 of its
canonical bytes is the engine id, `store.manifest.engine_id`), the server's /server_info as served, and the oracle's
engine id and manifest. Schema 1 files still load (score reads them); verify and compare refuse them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import data_dir
from specpilot_build.store.engines import checked_manifest

SCHEMA = "specpilot.results/2"
LEGACY_SCHEMAS = ("specpilot.results/1",)


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
    if not isinstance(data, dict) or data.get("schema") not in (SCHEMA, *LEGACY_SCHEMAS):
        raise SpecPilotError(f"{path}: not a bench results file (schema is not {SCHEMA})")
    return path, data


def require_current(path: Path, data: dict) -> None:
    """Refuse a results file of an older schema: it lacks what verify and compare check."""
    if data.get("schema") != SCHEMA:
        raise SpecPilotError(
            f"{path}: results schema {data.get('schema')} records no engine manifest, server "
            f"info or oracle id ({SCHEMA} does); bench the run again"
        )


def manifest_record(engine) -> dict:
    """An engine's manifest as it is on disk, and its digest (blake3 of manifest.json's bytes, the engine id)."""
    return {"digest": f"blake3:{engine.id}", "manifest": checked_manifest(engine)}


def write_json(path: Path, data: dict) -> Path:
    """Write atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    partial.replace(path)
    return path

"""Pruned vs unpruned: the files a served engine's processes imported, against what the pruned engine kept.

    SPECPILOT_IMPORT_AUDIT=/tmp/imports.log specpilot serve --engine <id> ...   # any run: pruned or unpruned
    python benchmarks/import_audit.py <engine id> /tmp/imports.log [--package sglang] [--wheel <sglang wheel>]

Prints: processes logged, package files imported, imported and kept, imported and pruned (must be 0; each named),
kept but never imported, and with --wheel the imported files the full wheel lacks. Exit 1 when anything imported
was pruned. --json writes the whole comparison."""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from pathlib import Path

from specpilot_build.serve.audit import compare_imports
from specpilot_build.store.engines import resolve_engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("log", type=Path)
    parser.add_argument("--package", default=None, help="sglang (default for SGLang engines) or specpilot_runtime")
    parser.add_argument("--wheel", type=Path, help="the full wheel: its members are the unpruned file list")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    args = parser.parse_args()
    engine = resolve_engine(args.engine)
    package = args.package or (
        "specpilot_runtime" if engine.manifest["config"]["runtime"]["name"] == "reference" else "sglang"
    )
    universe = None
    if args.wheel:
        with zipfile.ZipFile(args.wheel) as zf:
            universe = [name for name in zf.namelist() if not name.endswith("/")]
    audit = compare_imports(args.log, [f["path"] for f in engine.manifest["files"]], package, universe)
    print(f"engine {engine.id[:12]}  log {args.log}")
    print(audit.table())
    if args.json:
        args.json.write_text(json.dumps({"engine": engine.id, **audit.__dict__}, indent=1) + "\n")
    return 1 if audit.imported_pruned else 0


if __name__ == "__main__":
    sys.exit(main())

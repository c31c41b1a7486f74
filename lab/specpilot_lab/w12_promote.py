"""Promote a measured W12 table into the kernel package: the one deliberate step by which a benchmark's result
becomes something engines load (and so moves every W12 engine id).

    python -m specpilot_lab.w12_promote benchmarks/results/tuned_h200.json      # make w12-promote TABLE=...

The table's kind comes from its name (tuned_<gpu>.json, fallback_<gpu>.json, layouts_<gpu>.json); every key and
entry is parsed exactly as the package parses it when it loads the table, so a table that would fail at import
is refused here, naming the file and the key, and nothing is written. The file is written to kernels/w12/ under
the same name through a temporary file and a rename."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import w12
from w12.format import LAYOUTS
from w12.gemm import Config, tuned_key

KINDS = ("tuned", "fallback", "layouts")
NAME = re.compile(r"^(tuned|fallback|layouts)_[a-z0-9]+\.json$")


def check_table(path: Path) -> dict:
    """The table at `path`, every entry checked as the package will read it; ValueError naming file and key."""
    match = NAME.match(path.name)
    if not match:
        raise ValueError(f"{path}: a W12 table is named <kind>_<gpu>.json with kind one of {', '.join(KINDS)}")
    try:
        table = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON table ({exc})") from None
    if not isinstance(table, dict) or not any(not k.startswith("_") for k in table):
        raise ValueError(f"{path}: an object with at least one entry is expected")
    for key, entry in table.items():
        if not key.startswith("_"):
            _check_entry(match.group(1), key, entry, path)
    return table


def _check_entry(kind: str, key: str, entry, path: Path) -> None:
    where = f"{path}: {key!r}"
    try:
        if kind == "layouts":
            rows, _, cols = key.partition(",")
            if not (rows.isdigit() and cols.isdigit()) or entry not in LAYOUTS:
                raise ValueError(f"a layouts entry is 'rows,cols': one of {', '.join(LAYOUTS)}")
            return
        tuned_key(key)
        if kind == "tuned":
            Config(**entry)
        elif not (isinstance(entry, dict) and float(entry["speedup"]) > 0):
            raise ValueError("a fallback entry holds a positive 'speedup'")
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def promote(path: Path, package: Path = Path(w12.__file__).resolve().parent) -> Path:
    table = check_table(path)
    target = package / path.name
    fd, tmp = tempfile.mkstemp(dir=package, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, target)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("table", type=Path, help="a measured table, e.g. benchmarks/results/tuned_h100.json")
    args = ap.parse_args(argv)
    try:
        target = promote(args.table)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    entries = sum(not k.startswith("_") for k in json.loads(target.read_text()))
    print(f"promoted {args.table} -> {target} ({entries} entries); every W12 engine built from now on has a new id")
    return 0


if __name__ == "__main__":
    sys.exit(main())

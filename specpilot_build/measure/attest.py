"""Attestations: every verdict (verify) and every set of speedups (compare) is bound to the files it came from.

A statement follows the in-toto Statement v1 layout (https://github.com/in-toto/attestation, spec/v1):

    {"_type": "https://in-toto.io/Statement/v1",
     "subject": [{"name": "<path relative to the statement>", "digest": {"sha256": "...", "blake3": "..."}}],
     "predicateType": "https://specpilot.dev/attestation/verify/v1",   (or .../compare/v1)
     "predicate": {engine ids, oracle id, hardware, versions, verdict or speedups}}

Its subjects are the results files the verdict read and the report it wrote, each by digest. It is written
next to the report as <report>.intoto.json. `specpilot attest check <statement>` re-hashes every subject and
fails on any change. Statements are not signed here; wrap one in a DSSE envelope to sign it (README).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import blake3

from specpilot_build.errors import SpecPilotError

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_VERIFY = "https://specpilot.dev/attestation/verify/v1"
PREDICATE_COMPARE = "https://specpilot.dev/attestation/compare/v1"
SUFFIX = ".intoto.json"


def file_digests(path: Path) -> dict:
    sha, b3 = hashlib.sha256(), blake3.blake3()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            sha.update(chunk)
            b3.update(chunk)
    return {"sha256": sha.hexdigest(), "blake3": b3.hexdigest()}


def statement_path(report: Path) -> Path:
    return report.with_name(report.name.removesuffix(".json") + SUFFIX)


def write_statement(report: Path, subjects: list[Path], predicate_type: str, predicate: dict) -> Path:
    """Write <report>.intoto.json naming `subjects` (paths) by digest; returns its path."""
    out = statement_path(report)
    entries, seen = [], set()
    for subject in subjects:
        subject = Path(subject).resolve()
        if subject in seen:
            continue
        seen.add(subject)
        entries.append({"name": _name(subject, out.parent), "digest": file_digests(subject)})
    statement = {"_type": STATEMENT_TYPE, "subject": entries, "predicateType": predicate_type, "predicate": predicate}
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(statement, indent=1, ensure_ascii=False) + "\n")
    partial.replace(out)
    return out


def check_statement(path: str | Path) -> tuple[dict, list[str]]:
    """Re-hash every subject of a statement; returns (statement, one line per problem: empty when intact)."""
    path = Path(path)
    try:
        statement = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecPilotError(f"{path}: not a readable statement ({exc})") from None
    problems = []
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        return statement, [f"{path}: _type is not {STATEMENT_TYPE}"]
    subjects = statement.get("subject")
    if not isinstance(subjects, list) or not subjects:
        return statement, [f"{path}: no subjects"]
    if not isinstance(statement.get("predicateType"), str) or not isinstance(statement.get("predicate"), dict):
        problems.append(f"{path}: predicateType or predicate missing")
    for subject in subjects:
        name, want = subject.get("name"), subject.get("digest") or {}
        if not isinstance(name, str) or not want:
            problems.append(f"subject {subject!r}: no name or digest")
            continue
        file = Path(name) if Path(name).is_absolute() else path.parent / name
        if not file.is_file():
            problems.append(f"{name}: missing")
            continue
        have = file_digests(file)
        known = [alg for alg in want if alg in have]
        if not known:
            problems.append(f"{name}: no digest this tool can check ({', '.join(want)})")
        for alg in known:
            if have[alg] != want[alg]:
                problems.append(f"{name}: {alg} {have[alg][:16]}… differs from the attested {want[alg][:16]}…")
    return statement, problems


def _name(subject: Path, base: Path) -> str:
    try:
        return os.path.relpath(subject, base.resolve())
    except ValueError:  # another drive
        return str(subject)

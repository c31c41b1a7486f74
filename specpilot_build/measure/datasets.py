"""Benchmark data: pinned files (lockfiles/datasets.toml), hash-verified, and deterministic disjoint splits.

A file is taken from the first of: the data-dir cache (<data>/datasets/<file>), the offline mirror
(<mirror>/datasets/<file>), a download of the pinned URL into the cache. Whatever the source, its sha256
must equal the pin, or the loader refuses naming the file.

Splits (identical for every arm, every run): the benchmark's evaluation rows (gsm8k test, all 164
HumanEval problems, MATH-500, MBPP test task ids 11-510, MT-Bench's 80 questions, first turn only) ordered by
sha256("<dataset>:<item id>") — a fixed pseudo-random order that does not depend on Python's RNG — then cut
into three disjoint parts (SPLIT_SIZES): `dev`, the first items, is what bench, compare, score and verify
report on; `tune`, the next ones, is where a search tries candidates (held out from every reported number);
`train`, the rest, is the only part a drafter may be trained on. A split is cut to its first `limit` items
(None: all); growing `limit` only appends items, so small runs nest in large ones.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import data_dir, lockfiles_dir, mirror_dir

BENCHMARKS = ("gsm8k", "humaneval", "math500", "mbpp", "mt-bench")
SPLITS = ("dev", "tune", "train")
SPLIT_SIZES = {  # (dev, tune) items; train is the rest
    "gsm8k": (500, 200),
    "humaneval": (100, 24),
    "math500": (300, 100),
    "mbpp": (300, 100),
    "mt-bench": (50, 10),
}

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Item:
    dataset: str
    id: str
    prompt: str  # the first user turn, as text
    record: dict = field(repr=False)  # the raw upstream row (answers, tests) for scoring


def load_split(dataset: str, limit: int | None = None, split: str = "dev") -> list[Item]:
    """One split of one benchmark: its first `limit` items in the documented fixed order."""
    if dataset not in BENCHMARKS:
        raise SpecPilotError(f"unknown dataset {dataset!r}; known: {', '.join(BENCHMARKS)}")
    if split not in SPLITS:
        raise SpecPilotError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    if limit is not None and limit < 0:
        raise SpecPilotError(f"dataset limit must be >= 0, got {limit}")
    dev, tune = SPLIT_SIZES[dataset]
    items = all_items(dataset)
    if len(items) <= dev + tune:
        raise SpecPilotError(
            f"{dataset}: {len(items)} items, too few for its dev and tune splits ({dev} + {tune}) and a train split"
        )
    part = {"dev": items[:dev], "tune": items[dev : dev + tune], "train": items[dev + tune :]}[split]
    return part if limit is None else part[:limit]


def all_items(dataset: str) -> list[Item]:
    """Every item of one benchmark in the fixed order the splits cut (for looking records up by id)."""
    if dataset not in BENCHMARKS:
        raise SpecPilotError(f"unknown dataset {dataset!r}; known: {', '.join(BENCHMARKS)}")
    rows = _read_rows(dataset_file(dataset))
    built = (_ITEM_BUILDERS[dataset](index, row) for index, row in enumerate(rows))
    items = [item for item in built if item is not None]
    items.sort(key=lambda item: hashlib.sha256(f"{dataset}:{item.id}".encode()).digest())
    return items


def dataset_pin(dataset: str) -> dict:
    """The lock entry of one benchmark: file, url, sha256, size, license."""
    lock = _load_lock()
    if dataset not in lock:
        raise SpecPilotError(f"{_lock_path()}: no entry [{dataset}]; add its file, url, sha256")
    pin = lock[dataset]
    missing = [key for key in ("file", "url", "sha256") if key not in pin]
    if missing:
        raise SpecPilotError(f"{_lock_path()}: [{dataset}] lacks {', '.join(missing)}")
    return pin


def dataset_file(dataset: str) -> Path:
    """A local, hash-verified copy of the benchmark's pinned file."""
    pin = dataset_pin(dataset)
    cached = data_dir() / "datasets" / pin["file"]
    candidates = [cached]
    mirror = mirror_dir()
    if mirror is not None:
        candidates.append(mirror / "datasets" / pin["file"])
    for path in candidates:
        if path.is_file():
            _check_hash(path, pin)
            return path
    _download(pin, cached)
    return cached


def _check_hash(path: Path, pin: dict) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != pin["sha256"]:
        raise SpecPilotError(
            f"{path}: sha256 {digest} does not match the pin {pin['sha256']} in {_lock_path()}; "
            "remove the file or fix the mirror"
        )


def _download(pin: dict, target: Path) -> None:
    import httpx

    try:
        response = httpx.get(pin["url"], follow_redirects=True, timeout=60)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise SpecPilotError(
            f"{pin['file']}: not in the cache or mirror, and downloading {pin['url']} failed ({exc}); "
            "set SPECPILOT_MIRROR to a directory holding datasets/" + pin["file"]
        ) from None
    digest = hashlib.sha256(response.content).hexdigest()
    if digest != pin["sha256"]:
        raise SpecPilotError(
            f"{pin['file']}: downloaded {pin['url']} has sha256 {digest}, the pin is {pin['sha256']}; refused"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_bytes(response.content)
    partial.replace(target)


def _read_rows(path: Path) -> list[dict]:
    raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    text = raw.decode("utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _load_lock() -> dict:
    path = _lock_path()
    if not path.is_file():
        raise SpecPilotError(f"{path}: datasets lock not found")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SpecPilotError(f"{path}: not valid TOML ({exc})") from None


def _lock_path() -> Path:
    return lockfiles_dir() / "datasets.toml"


def _gsm8k(index: int, row: dict) -> Item:
    return Item("gsm8k", str(index), f"{row['question']}\n{MATH_INSTRUCTION}", row)


def _math500(index: int, row: dict) -> Item:
    return Item("math500", row["unique_id"], f"{row['problem']}\n{MATH_INSTRUCTION}", row)


def _humaneval(index: int, row: dict) -> Item:
    prompt = (
        "Complete the following Python function. Answer with the complete function in one "
        f"```python code block.\n\n```python\n{row['prompt']}```"
    )
    return Item("humaneval", row["task_id"], prompt, row)


def _mbpp(index: int, row: dict) -> Item | None:
    if not 11 <= row["task_id"] <= 510:  # the upstream test split
        return None
    tests = "\n".join(row["test_list"])
    prompt = (
        f"You are an expert Python programmer, and here is your task: {row['text']} "
        f"Your code should pass these tests:\n\n{tests}\n"
    )
    return Item("mbpp", str(row["task_id"]), prompt, row)


def _mt_bench(index: int, row: dict) -> Item:
    return Item("mt-bench", str(row["question_id"]), row["turns"][0], row)


_ITEM_BUILDERS = {"gsm8k": _gsm8k, "humaneval": _humaneval, "math500": _math500, "mbpp": _mbpp, "mt-bench": _mt_bench}

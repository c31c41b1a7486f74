"""Pinned benchmark files: mirror, cache, download from a loopback server, hash refusal, the dev split."""

import functools
import hashlib
import http.server
import json
import threading

import pytest

from specpilot_build.errors import SpecPilotError
from specpilot_build.measure import datasets


@pytest.fixture
def mirror(monkeypatch, tmp_path, shared):
    monkeypatch.setenv("SPECPILOT_MIRROR", str(shared))
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    monkeypatch.delenv("SPECPILOT_LOCKFILES", raising=False)


@pytest.mark.parametrize("name", datasets.BENCHMARKS)
def test_dev_tune_and_train_are_disjoint_and_cover_every_item(mirror, name):
    every = [item.id for item in datasets.all_items(name)]
    parts = {split: [item.id for item in datasets.load_split(name, split=split)] for split in datasets.SPLITS}
    dev, tune = datasets.SPLIT_SIZES[name]
    assert (len(parts["dev"]), len(parts["tune"])) == (dev, tune)
    assert parts["train"], "every benchmark keeps items to train drafters on"
    assert parts["dev"] + parts["tune"] + parts["train"] == every
    assert not set(parts["dev"]) & set(parts["tune"]) and not set(parts["train"]) & (
        set(parts["dev"]) | set(parts["tune"])
    )
    assert datasets.load_split(name, 3, split="tune") == datasets.load_split(name, split="tune")[:3]


def test_an_unknown_split_is_refused_by_name(mirror):
    with pytest.raises(SpecPilotError, match="unknown split 'test'; known: dev, tune, train"):
        datasets.load_split("gsm8k", split="test")


@pytest.mark.parametrize(
    "name,rows", [("gsm8k", 1319), ("humaneval", 164), ("math500", 500), ("mbpp", 500), ("mt-bench", 80)]
)
def test_full_split_sizes_match_the_upstream_row_counts(mirror, name, rows):
    items = datasets.all_items(name)
    assert len(items) == rows
    assert len({item.id for item in items}) == rows


def test_records_carry_what_scoring_needs(mirror):
    gsm = datasets.load_split("gsm8k", 3)
    assert all("####" in item.record["answer"] and item.record["question"] in item.prompt for item in gsm)
    he = datasets.load_split("humaneval", 3)
    assert all({"prompt", "test", "entry_point"} <= item.record.keys() for item in he)
    mbpp = datasets.load_split("mbpp", 3)
    assert all(11 <= item.record["task_id"] <= 510 and item.record["test_list"][0] in item.prompt for item in mbpp)
    assert all("answer" in item.record for item in datasets.load_split("math500", 3))


def test_mt_bench_uses_first_turns_only(mirror):
    for item in datasets.load_split("mt-bench", 10):
        assert item.prompt == item.record["turns"][0]
        assert item.record["turns"][1] not in item.prompt


def test_split_is_deterministic_and_nested(mirror):
    small = [item.id for item in datasets.load_split("gsm8k", 5)]
    large = [item.id for item in datasets.load_split("gsm8k", 50)]
    assert small == large[:5]
    assert small == [item.id for item in datasets.load_split("gsm8k", 5)]
    assert small != ["0", "1", "2", "3", "4"]  # a shuffled order, not file order


def test_mismatching_mirror_file_is_refused_by_name(monkeypatch, tmp_path, shared):
    bad = tmp_path / "mirror" / "datasets" / "mt-bench"
    bad.mkdir(parents=True)
    original = (shared / "datasets/mt-bench/question.jsonl").read_bytes()
    (bad / "question.jsonl").write_bytes(original.replace(b"Hawaii", b"Hawai'i"))
    monkeypatch.setenv("SPECPILOT_MIRROR", str(tmp_path / "mirror"))
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    with pytest.raises(SpecPilotError, match=r"mt-bench/question.jsonl: sha256 .* does not match"):
        datasets.load_split("mt-bench", 1)


def test_unknown_dataset_is_a_user_error(mirror):
    with pytest.raises(SpecPilotError, match="unknown dataset 'gsm9k'"):
        datasets.load_split("gsm9k")


@pytest.fixture
def loopback_server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _test_lock(tmp_path, url, sha256):
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / "datasets.toml").write_text(
        f'[mt-bench]\nfile = "mt-bench/question.jsonl"\nurl = "{url}"\nsha256 = "{sha256}"\n'
    )
    return locks


def test_download_from_the_pinned_url_fills_the_cache(monkeypatch, tmp_path, loopback_server, shared):
    root, base = loopback_server
    content = (shared / "datasets/mt-bench/question.jsonl").read_bytes()
    (root / "q.jsonl").write_bytes(content)
    monkeypatch.setenv(
        "SPECPILOT_LOCKFILES", str(_test_lock(tmp_path, f"{base}/q.jsonl", hashlib.sha256(content).hexdigest()))
    )
    monkeypatch.setenv("SPECPILOT_MIRROR", "")
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    items = datasets.all_items("mt-bench")
    assert len(items) == 80
    assert (tmp_path / "data/datasets/mt-bench/question.jsonl").read_bytes() == content
    (root / "q.jsonl").unlink()  # the second load is served by the cache
    assert [i.id for i in datasets.all_items("mt-bench")] == [i.id for i in items]


def test_download_with_wrong_bytes_is_refused_and_not_cached(monkeypatch, tmp_path, loopback_server):
    root, base = loopback_server
    (root / "q.jsonl").write_text(json.dumps({"question_id": 1, "turns": ["x", "y"]}) + "\n")
    monkeypatch.setenv("SPECPILOT_LOCKFILES", str(_test_lock(tmp_path, f"{base}/q.jsonl", "0" * 64)))
    monkeypatch.setenv("SPECPILOT_MIRROR", "")
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    with pytest.raises(SpecPilotError, match="mt-bench/question.jsonl: downloaded .* refused"):
        datasets.load_split("mt-bench")
    assert not (tmp_path / "data/datasets/mt-bench/question.jsonl").exists()


def test_unreachable_url_says_how_to_use_a_mirror(monkeypatch, tmp_path, loopback_server):
    _, base = loopback_server
    monkeypatch.setenv("SPECPILOT_LOCKFILES", str(_test_lock(tmp_path, f"{base}/missing.jsonl", "0" * 64)))
    monkeypatch.setenv("SPECPILOT_MIRROR", "")
    monkeypatch.setenv("SPECPILOT_DATA", str(tmp_path / "data"))
    with pytest.raises(SpecPilotError, match="SPECPILOT_MIRROR"):
        datasets.load_split("mt-bench")

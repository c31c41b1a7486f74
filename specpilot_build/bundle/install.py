#!/usr/bin/env python3
"""Install a SpecPilot bundle on a host without a registry: python3 install.py [BUNDLE_DIR] PREFIX

Standard library only (Python >= 3.8; the host has no blake3 and no pip). BUNDLE_DIR (default: this file's
folder) holds index.json and the parts. Every part's size and sha256 are checked (a missing or damaged part
is refused by name), the parts are joined and the whole archive's sha256 is checked (and its BLAKE3 id when
the blake3 module happens to be importable), every member is checked to be a plain file or directory that
stays inside the prefix, and only then is anything unpacked: into a temporary folder beside PREFIX, renamed
to PREFIX in one step, so a failed install leaves nothing behind. PREFIX must not exist yet.
Prints the `specpilot serve` command line for each engine in the bundle."""

import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

FORMAT = "specpilot.bundle/1"
INDEX_NAME = "index.json"
CHUNK = 1 << 20


class InstallError(Exception):
    """A refusal: printed as one line, exit status 1."""


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (1, 2) or args[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    bundle_dir = Path(args[0]) if len(args) == 2 else Path(__file__).resolve().parent
    try:
        prefix, index = install(bundle_dir, Path(args[-1]))
    except InstallError as exc:
        print(f"install: error: {exc}", file=sys.stderr)
        return 1
    print(f"installed bundle {index['archive']['id']} into {prefix}")
    for engine in index["engines"]:
        print(f"engine {engine['id']} ({engine['setting']}, {engine['arm']}); serve it with:")
        print(f"  {prefix}/bin/specpilot serve --engine {engine['id']} --port 30000")
    print(
        f"(bin/specpilot runs `python3 -m specpilot_build.cli` with PYTHONPATH, SPECPILOT_ENGINES, "
        f"SPECPILOT_DATA and HF_HUB_CACHE pointed into {prefix}; PYTHON=... picks another interpreter)"
    )
    return 0


def install(bundle_dir: Path, prefix: Path):
    """Check, join, check, unpack into a temp folder beside `prefix`, rename. Returns (prefix, index)."""
    prefix = prefix.expanduser().absolute()
    if os.path.lexists(prefix):
        raise InstallError(f"{prefix} already exists; install into a new prefix (or remove it first)")
    index = read_index(bundle_dir)
    check_parts(bundle_dir, index)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{prefix.name}.install-", dir=prefix.parent))
    try:
        archive = scratch / "archive.tar.xz"
        join_parts(bundle_dir, index, archive)
        tree = scratch / "tree"
        unpack(archive, tree)
        os.rename(tree, prefix)  # one step: the prefix is either absent or complete
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return prefix, index


def read_index(bundle_dir: Path) -> dict:
    path = bundle_dir / INDEX_NAME
    try:
        index = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise InstallError(f"{path}: no bundle index here") from None
    except (OSError, ValueError) as exc:
        raise InstallError(f"{path}: unreadable bundle index ({exc})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise InstallError(f"{path}: not a {FORMAT} index")
    try:
        archive, parts = index["archive"], index["parts"]
        sizes = [p["size"] for p in parts]
        names = [p["name"] for p in parts]
        ok = (
            isinstance(archive["sha256"], str)
            and isinstance(archive["size"], int)
            and parts
            and all(isinstance(s, int) and s >= 0 for s in sizes)
            and sum(sizes) == archive["size"]
            and all(isinstance(p["sha256"], str) for p in parts)
            and len(set(names)) == len(names)
            and all(isinstance(n, str) and n and "/" not in n and n not in (".", "..") for n in names)
        )
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise InstallError(
            f"{path}: malformed index (parts must be plain names whose sizes add up to the "
            f"archive size, each with a sha256)"
        )
    return index


def check_parts(bundle_dir: Path, index: dict) -> None:
    """Every part present with its recorded size, before anything is read (all missing ones are named)."""
    missing = [p["name"] for p in index["parts"] if not (bundle_dir / p["name"]).is_file()]
    if missing:
        raise InstallError(
            f"missing part{'s' if len(missing) > 1 else ''} {', '.join(missing)} in {bundle_dir} "
            f"(the bundle has {len(index['parts'])} parts)"
        )
    for part in index["parts"]:
        size = (bundle_dir / part["name"]).stat().st_size
        if size != part["size"]:
            raise InstallError(f"part {part['name']}: {size} bytes, the index says {part['size']}; copy it again")


def join_parts(bundle_dir: Path, index: dict, archive: Path) -> None:
    """Join the parts into `archive`, hashing the bytes as they are written (what is checked is what is used)."""
    whole = hashlib.sha256()
    whole_b3 = _blake3()
    with open(archive, "wb") as out:
        for part in index["parts"]:
            digest, size = hashlib.sha256(), 0
            with open(bundle_dir / part["name"], "rb") as src:
                while chunk := src.read(CHUNK):
                    for hasher in (digest, whole, whole_b3):
                        if hasher is not None:
                            hasher.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
            if size != part["size"] or digest.hexdigest() != part["sha256"]:
                raise InstallError(
                    f"part {part['name']}: sha256 {digest.hexdigest()[:16]}… differs from the "
                    f"index ({part['sha256'][:16]}…); it is damaged: copy it again"
                )
    if whole.hexdigest() != index["archive"]["sha256"]:
        raise InstallError(
            f"the joined archive's sha256 {whole.hexdigest()[:16]}… differs from the index "
            f"({index['archive']['sha256'][:16]}…)"
        )
    if whole_b3 is not None and "blake3:" + whole_b3.hexdigest() != index["archive"].get("id"):
        raise InstallError(f"the joined archive's BLAKE3 differs from the bundle id {index['archive'].get('id')}")


def _blake3():
    try:
        import blake3
    except ImportError:  # the usual case on the host: the sha256 checks stand alone
        return None
    return blake3.blake3()


def unpack(archive: Path, tree: Path) -> None:
    """Unpack into `tree` after checking every member: regular files and directories only, relative paths
    without `..`, no duplicates; modes 0644/0755 (never setuid), links refused."""
    try:
        with tarfile.open(archive, "r:xz") as tar:
            members = tar.getmembers()
            names = [checked_name(m) for m in members]
            tree.mkdir()
            for member, name in zip(members, names):
                target = tree.joinpath(*name.parts)
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                _check_inside(tree, target.parent, member.name)
                src = tar.extractfile(member)
                if src is None:
                    raise InstallError(f"{archive}: {member.name} is not a regular file")
                fd = os.open(
                    target,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                    0o755 if member.mode & 0o111 else 0o644,
                )
                with os.fdopen(fd, "wb") as out, src:
                    shutil.copyfileobj(src, out, CHUNK)
    except FileExistsError as exc:
        raise InstallError(f"archive member {exc.filename} appears twice; refused") from None
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise InstallError(f"the archive does not unpack ({type(exc).__name__}: {exc})") from None


def checked_name(member: tarfile.TarInfo) -> PurePosixPath:
    kind = (
        "symbolic link"
        if member.issym()
        else "hard link"
        if member.islnk()
        else None
        if member.isfile() or member.isdir()
        else "device or FIFO"
    )
    if kind:
        raise InstallError(f"archive member {member.name!r} is a {kind}; refused (a bundle holds files only)")
    name = PurePosixPath(member.name)
    if (
        name.is_absolute()
        or not name.parts
        or any(p in ("..", "") for p in name.parts)
        or "\\" in member.name
        or "\0" in member.name
    ):
        raise InstallError(f"archive member {member.name!r} would land outside the prefix; refused")
    return name


def _check_inside(tree: Path, directory: Path, name: str) -> None:
    if os.path.commonpath([os.path.realpath(tree), os.path.realpath(directory)]) != os.path.realpath(tree):
        raise InstallError(f"archive member {name!r} would land outside the prefix; refused")


if __name__ == "__main__":
    sys.exit(main())

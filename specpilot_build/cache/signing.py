"""ed25519 key pairs and signed cache entries.

A public key is written `name:hex` (the name is the signer's key id); a secret key file holds `name:hex` of the
32-byte private seed and is created readable by its owner only. An entry's signature covers the canonical JSON of
everything in it but the signature itself."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from specpilot_build.errors import IntegrityError, SpecPilotError
from specpilot_build.store.manifest import canonical_json
from specpilot_build.store.names import plain_name

ENTRY_SCHEMA = "specpilot.cache-entry/1"
ENTRY_FIELDS = ("schema", "build_key", "engine", "setting", "arm", "signer", "signature")


@dataclass(frozen=True)
class SigningKey:
    name: str
    private: Ed25519PrivateKey

    def public_line(self) -> str:
        raw = self.private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return f"{self.name}:{raw.hex()}"


def keygen(name: str, secret_file: Path) -> SigningKey:
    """A new key pair; the secret is written to `secret_file` (a new file, mode 0600). Returns the key."""
    plain_name(name, "cache key name")
    if ":" in name:
        raise SpecPilotError(f"cache key name {name!r}: no ':' (it separates the name from the key)")
    key = SigningKey(name, Ed25519PrivateKey.generate())
    seed = key.private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    secret_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise SpecPilotError(f"{secret_file} exists; refusing to overwrite a secret key") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(f"{name}:{seed.hex()}\n")
    return key


def load_signing_key(secret_file: Path) -> SigningKey:
    try:
        text = secret_file.read_text().strip()
    except OSError as exc:
        raise SpecPilotError(f"cache signing key {secret_file}: cannot read it ({exc.strerror})") from None
    name, _, hexseed = text.partition(":")
    try:
        private = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(hexseed))
    except ValueError:
        raise SpecPilotError(f"cache signing key {secret_file}: not `name:<64 hex digits>`") from None
    if not name:
        raise SpecPilotError(f"cache signing key {secret_file}: no key name before ':'")
    return SigningKey(name, private)


def parse_public_keys(lines: list[str], where: str) -> dict[str, Ed25519PublicKey]:
    """`name:hex` public keys by name; a malformed one is an error naming it and `where` it came from."""
    keys: dict[str, Ed25519PublicKey] = {}
    for line in lines:
        name, _, hexkey = str(line).strip().partition(":")
        try:
            public = Ed25519PublicKey.from_public_bytes(bytes.fromhex(hexkey))
        except ValueError:
            raise SpecPilotError(f"{where}: trusted key {line!r} is not `name:<64 hex digits>`") from None
        if not name:
            raise SpecPilotError(f"{where}: trusted key {line!r} has no name before ':'")
        keys[name] = public
    return keys


def signed_entry(key: SigningKey, build_key: str, engine: str, setting: str, arm: str) -> dict[str, str]:
    body = {"schema": ENTRY_SCHEMA, "build_key": build_key, "engine": engine, "setting": setting, "arm": arm}
    body["signer"] = key.name
    return dict(body, signature=key.private.sign(canonical_json(body)).hex())


def check_entry(entry: Any, trusted: dict[str, Ed25519PublicKey], where: str) -> dict[str, str]:
    """The entry, if it has exactly the entry fields and a valid signature by a trusted key; else an
    IntegrityError naming `where` (the entry's URL) and what is wrong."""
    if not isinstance(entry, dict) or set(entry) != set(ENTRY_FIELDS):
        raise IntegrityError(f"{where}: not a signed cache entry (fields {', '.join(ENTRY_FIELDS)}); refused")
    if not all(isinstance(entry[f], str) for f in ENTRY_FIELDS) or entry["schema"] != ENTRY_SCHEMA:
        raise IntegrityError(f"{where}: not a {ENTRY_SCHEMA} entry; refused")
    signer = entry["signer"]
    if signer not in trusted:
        known = ", ".join(sorted(trusted)) or "none (cache.trusted_public_keys is empty)"
        raise IntegrityError(f"{where}: signed by key '{signer}', which is not trusted (trusted: {known}); refused")
    body = {k: v for k, v in entry.items() if k != "signature"}
    try:
        trusted[signer].verify(bytes.fromhex(entry["signature"]), canonical_json(body))
    except (InvalidSignature, ValueError):
        raise IntegrityError(
            f"{where}: signature {entry['signature'][:16]}… does not verify with trusted key '{signer}'; refused"
        ) from None
    return entry

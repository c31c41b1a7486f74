"""The `cache` config group: the substituters a build asks first and the public keys whose entries it trusts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from specpilot_build.cache.signing import parse_public_keys
from specpilot_build.errors import ConfigError

WHERE = "cache.trusted_public_keys"


@dataclass(frozen=True)
class CacheSettings:
    substituters: tuple[str, ...]
    trusted: dict[str, Ed25519PublicKey]


def cache_settings(config: dict[str, Any], extra_keys: Sequence[str] = ()) -> CacheSettings:
    """From a composed config (its `cache` node; none: no substituters, no trusted keys) and keys given on the
    command line."""
    node = config.get("cache") or {}
    urls = tuple(str(u) for u in node.get("substituters") or ())
    for url in urls:
        if "://" not in url:
            raise ConfigError(f"cache.substituters: {url!r} is not a URL (file:///path, s3://bucket/prefix, hf://...)")
    keys = [*(node.get("trusted_public_keys") or ()), *extra_keys]
    if urls and not keys:
        raise ConfigError(
            "cache.substituters is set but cache.trusted_public_keys is empty: no entry could be used; add the "
            "public key of whoever pushes (`specpilot cache keygen` prints it)"
        )
    return CacheSettings(urls, parse_public_keys(keys, WHERE))

"""The one confinement helper: every name that becomes a path (kernel, overlay, mechanism, setting, a wheel's
filename in a lockfile, each part of a path inside an engine tree) is checked here before it is used."""

from __future__ import annotations

import re

from specpilot_build.errors import ConfigError, SpecPilotError

_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_BAD_CHARS = re.compile(r"[\x00-\x1f\x7f/\\]")
_MAX = 255


def plain_name(value: object, what: str, *, strict: bool = True, error: type[Exception] = ConfigError) -> str:
    """`value` if it is one plain path component; else a one-line `error` naming `what`.

    Always refused: a non-string, the empty name, `.`, `..`, `/`, `\\`, NUL or other control characters, a
    leading `~`, names over 255 bytes. `strict` (names from configs and lockfiles) also requires letters, digits
    and `._+-`, starting with a letter or digit."""
    if not isinstance(value, str) or not value:
        raise error(f"{what} {value!r} is not a plain name; refused (nothing was written)")
    bad = (
        value in (".", "..")
        or value.startswith("~")
        or _BAD_CHARS.search(value) is not None
        or len(value.encode("utf-8", "replace")) > _MAX
    )
    if bad or (strict and not _PLAIN.fullmatch(value)):
        raise error(
            f"{what} {value!r} is not a plain name (letters, digits, '._+-'; no '/', '..' or absolute "
            f"path); refused (nothing was written)"
            if strict
            else f"{what} {value!r} is not a plain path component; refused (nothing was written)"
        )
    return value


def plain_relpath(value: object, what: str, *, error: type[Exception] = ConfigError) -> str:
    """A relative POSIX path whose every part is a plain component (no absolute path, `..`, `\\`, empty part)."""
    if not isinstance(value, str) or not value or value.startswith("/"):
        raise error(f"{what} {value!r} leaves its directory (absolute or empty path); refused (nothing was written)")
    if (
        "\\" in value
        or "/." in value
        or value.startswith((".", "~"))
        or "/~" in value
        or "//" in value
        or value.endswith("/")
        or _BAD_CHARS.search(value.replace("/", "")) is not None
    ):
        for part in value.split("/"):  # the slow path names the offending part
            plain_name(part, f"{what} {value!r}: part", strict=False, error=error)
    if len(value) > _MAX:
        for part in value.split("/"):
            plain_name(part, f"{what} {value!r}: part", strict=False, error=error)
    return value


ID_PREFIX = "blake3:"
_HEX = re.compile(r"[0-9a-f]+")
MIN_ID_PREFIX = 4


def engine_prefix(ref: object) -> str:
    """The lowercase hex an engine reference names: a whole id or a unique prefix of one (at least 4 hex
    digits), bare or in its typed form `blake3:<hex>`, in any case, surrounding blanks ignored."""
    text = ref.strip().lower() if isinstance(ref, str) else ""
    digits = text[len(ID_PREFIX) :] if text.startswith(ID_PREFIX) else text
    if len(digits) < MIN_ID_PREFIX or len(digits) > 64 or not _HEX.fullmatch(digits):
        raise SpecPilotError(
            f"{ref!r} is not an engine id (give at least {MIN_ID_PREFIX} hex digits of one, bare or as "
            f"{ID_PREFIX}<hex>; `specpilot engine ls`)"
        )
    return digits

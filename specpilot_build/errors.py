"""Typed user errors: one or two lines naming the file, key, hash or hunk, and what to do.

Stages raise them; only the command line (cli/) prints them and turns them into exit codes."""

from __future__ import annotations

import os


class SpecPilotError(Exception):
    """A user error. Its message is printed as is, without a traceback."""

    exit_code = 2


class ConfigError(SpecPilotError):
    """A setting, group option, key or value that does not compose or validate."""


class PinError(SpecPilotError):
    """Something unpinned, or bytes that do not match their pin (checkpoint, wheel, dataset)."""


class IntegrityError(SpecPilotError):
    """A stored engine, object or results file that differs from the hash it claims."""

    exit_code = 3


class ServerError(SpecPilotError):
    """A server that did not start, is not the engine asked for, or answered wrongly."""


def debug_enabled() -> bool:
    return os.environ.get("SPECPILOT_DEBUG", "") not in ("", "0")

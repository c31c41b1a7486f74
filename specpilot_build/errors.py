"""User-facing errors: one or two lines naming the file, key, hash or hunk, and what to do."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager


class SpecPilotError(Exception):
    """A user error. Its message is printed as is, without a traceback."""


def debug_enabled() -> bool:
    return os.environ.get("SPECPILOT_DEBUG", "") not in ("", "0")


@contextmanager
def user_errors():
    """Turn SpecPilotError into 'error: ...' on stderr and exit status 2 (traceback with SPECPILOT_DEBUG=1)."""
    try:
        yield
    except SpecPilotError as exc:
        if debug_enabled():
            raise
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None

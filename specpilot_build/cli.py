"""`specpilot`: the command line behind the Makefile's verbs."""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import user_errors

# Sub-commands implemented by a stage module's own `main(argv) -> int`.
DELEGATED = {
    "sweep": "specpilot_build.sweep",
    "lock": "specpilot_build.lock",
    "models": "specpilot_build.checkpoints",
    "serve": "specpilot_build.serve",
    "stop": "specpilot_build.serve",
    "bench": "specpilot_build.bench",
    "compare": "specpilot_build.compare",
    "score": "specpilot_build.score",
    "verify": "specpilot_build.verify",
    "diff": "specpilot_build.diff",
    "demo": "specpilot_build.demo",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with user_errors():
        if argv and argv[0] in DELEGATED:
            module = importlib.import_module(DELEGATED[argv[0]])
            entry = getattr(module, f"{argv[0]}_main", None) or module.main
            return int(entry(argv[1:]) or 0)
        if argv and argv[0] == "engine":
            from .engine_cli import main as engine_main
            return engine_main(argv[1:])
        parser = argparse.ArgumentParser(prog="specpilot", description=__doc__)
        parser.add_argument("command", choices=["engine", *DELEGATED])
        parser.parse_args(argv or ["--help"])
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

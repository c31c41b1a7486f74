"""The defaults every stage and the command line share, written once."""

from __future__ import annotations

DEFAULT_SETTING = "cpu_c1_stories260k_ngram"
ARMS = ("ar", "stock", "final")
DEFAULT_PORT = 30000  # where serve, bench and stop look unless told otherwise
ORACLE_PORT = 30001  # where verify serves its oracle, beside an engine on DEFAULT_PORT

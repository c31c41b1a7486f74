"""SpecPilot: a declarative build system for speculative-decoding LLM engines."""

__version__ = "0.1.0"

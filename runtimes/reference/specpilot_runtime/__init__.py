"""SpecPilot's embedded reference runtime: greedy speculative decoding behind SGLang's HTTP API.

Self-contained: copied into each engine tree as `<engine>/runtime/` and started from there with
`python -m specpilot_runtime.server --engine <engine_dir> ...`. It depends on torch, transformers,
safetensors, fastapi and uvicorn only (and, for W12 weights, on a `w12` package found on sys.path).
"""

__version__ = "0.1.0"

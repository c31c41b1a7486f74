"""Measure what a served engine does: the pinned dev splits (datasets.py), prompts rendered on the client
(prompts.py), bench runs (bench.py) and their files (results.py), speedups (compare.py), grading (score.py,
sandbox.py) and token forcing against an oracle (verify.py). Engines are read only through the store."""

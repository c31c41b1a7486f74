"""Checkpoints: `make lock` pins a setting's repos to commits and files to sha256 (lock.py); `make models`
fetches exactly the pinned files and proves them (checkpoints.py); converters SpecPilot owns turn pinned
bytes into model directories deterministically (llama2c.py), or write configs without weights (synthetic.py)."""

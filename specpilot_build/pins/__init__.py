"""Pins: the lockfiles every stage reads (lockfile.py: checkpoints, runtime bases, datasets), the Hugging Face
hub client that resolves and lists what a pin names (hub.py), and pinned wheels fetched and checked by their
sha256 (wheels.py)."""

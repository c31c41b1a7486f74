"""Pins and the bytes they name: the lockfiles (lockfile.py), `make lock` (lock.py), the hub client
(remote.py), fetching and proving checkpoints (checkpoints.py), and the llama2.c converter (llama2c.py)."""

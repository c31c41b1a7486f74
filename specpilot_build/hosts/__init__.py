"""GPU hosts an SGLang engine is served on: host profiles and environment locks as reviewed files
(profiles.py), `make env-lock` resolving a runtime's wheels for a host with pip (resolve.py), and installing a
locked environment into a prefix, pruned by the runtime's native rules (install.py)."""

"""`make bundle`: engines, their models and environment and SpecPilot itself as one deterministic,
content-addressed archive in parts (`pack.py`, members from `contents.py`), and the standard-library
installer that checks and unpacks it on an air-gapped host (`install.py`, with the `bin/specpilot` launcher
`specpilot.sh`)."""

"""Serve exactly one engine tree: the hardware gate, the re-hash, the launch spec and the run record, and stop
exactly the recorded process (process.py); talk to a served engine over HTTP (client.py); the opt-in import
audit of its processes (audit.py). Engines are read only through the store."""

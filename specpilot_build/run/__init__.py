"""Run exactly one engine tree: serve it (hardware gate, re-hash, launch spec, run record) and stop exactly
the recorded process (serve.py); talk to a served engine over HTTP (client.py). Engines are read only through
the store."""

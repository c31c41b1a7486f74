"""Binary caches: engines travel by hash between stores through an fsspec URL (file://, s3://, hf://).

A cache holds content-addressed objects (compressed, by the blake3 of their content), the canonical manifest of
each engine id, and one ed25519-signed entry per build key naming the engine that key builds. Nothing pulled is
trusted: entries must be signed by a trusted key, manifests must hash to their id, objects to their digest."""

"""The content-addressed store: canonical bytes and digests (manifest.py), engines/<id>/ trees whose files
are hardlinks into engines/.objects/ (engines.py, the only reader of engines for later stages), and the
manifest-diff audit (diff.py)."""

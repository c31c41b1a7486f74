"""Compose: a named setting and arm through Hydra into a validated config (compose.py, schema.py), and the
effective config of one arm — what it executes, and so what its engine id covers (effective.py)."""

"""Drafters as build products: a recipe (conf/recipe/) and a setting's target become a content-addressed drafter
checkpoint in <data>/drafters/<id>/, pinned in lockfiles/drafters.toml (docs/drafters.md)."""

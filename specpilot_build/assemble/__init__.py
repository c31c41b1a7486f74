"""Assemble an engine: resolve a composed setting's inputs once (inputs.py), take the runtime base (the pinned
wheel, pruned: prune.py; or the in-repo runtime: base.py), apply overlays (overlays.py), add kernels, the config
and the launch spec (tree.py, launch.py), and commit the tree to the store (builder.py). SGLang launch flags are
checked against the base's own parser (sglang_flags.py, launch_check.py); repair.py re-makes damaged files."""

"""Build: resolve a composed setting's inputs once (inputs.py), obtain the runtime base (runtime_base.py),
prune it (prune.py), apply overlays (overlay.py), add kernels and the launch spec (assemble.py, launch.py),
and commit the tree to the store (builder.py); launch_check.py checks an SGLang engine's argv on CPU."""

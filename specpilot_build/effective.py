"""What one arm of a setting runs: the composed config reduced to the parts that arm executes.

The engine id depends only on this, so changing a setting's `final` tuning never changes its `ar` or `stock`
engines, and an `ar` engine does not depend on the drafter it does not run."""
from __future__ import annotations

import copy

NO_DRAFTER = {"name": "none", "algorithm": "none"}


def effective_config(config: dict) -> dict:
    cfg = copy.deepcopy(config)
    arm = cfg["arm"]
    mechanisms = cfg.pop("final", {}).get("mechanisms", []) if arm["applies_mechanisms"] else []
    cfg.pop("final", None)
    if not arm["uses_drafter"]:
        cfg["drafter"] = dict(NO_DRAFTER)
    runtime_options: dict = {}
    launch_args: dict = dict(cfg["runtime"].get("launch_args", {}))
    kernels: list[str] = []
    for mech in mechanisms:
        cfg["model"].update(mech.get("model", {}))
        cfg["drafter"].update(mech.get("drafter", {}))
        kernels += [k for k in mech.get("kernels", []) if k not in kernels]
        runtime_options.update(mech.get("runtime_options", {}))
        launch_args.update(mech.get("launch_args", {}))
    cfg["mechanisms"] = [{"name": m["name"], "overlay": m.get("overlay")} for m in mechanisms]
    cfg["runtime_options"] = runtime_options
    cfg["kernels"] = kernels
    cfg["runtime"]["launch_args"] = launch_args
    return cfg


def overlays_of(cfg: dict) -> list[str]:
    """Overlay names in application order (the order rule lives in overlay.py)."""
    from .overlay import overlays_in_order
    return overlays_in_order(cfg)

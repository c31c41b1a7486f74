"""The Hydra launchers a sweep or a tune may name: a config in conf/hydra/launcher/ or one a plugin registers,
with the plugin installed, and for Slurm ones a cluster to submit to. One line naming what to do otherwise."""

from __future__ import annotations

import importlib.util
import shutil

from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import conf_dir

# Launcher configs registered by plugins (no file of ours), and the module each needs (None: Hydra's own)
PLUGIN_LAUNCHERS = {
    "basic": None,
    "joblib": "hydra_plugins.hydra_joblib_launcher",
    "submitit_local": "hydra_plugins.hydra_submitit_launcher",
    "submitit_slurm": "hydra_plugins.hydra_submitit_launcher",
}
# Our own launcher configs that need an extra: config name -> (module, extra)
LAUNCHER_EXTRAS = {"slurm": ("hydra_plugins.hydra_submitit_launcher", "slurm")}
SLURM_LAUNCHERS = ("slurm", "submitit_slurm")


def check_launcher(name: str, plugins: bool = True) -> None:
    """`name` is a launcher config of conf/hydra/launcher/ (or, with `plugins`, one a plugin registers) whose plugin
    is installed, and a Slurm one only where srun is."""
    files = sorted(p.stem for p in (conf_dir() / "hydra" / "launcher").glob("*.yaml"))
    known = sorted({*files, *PLUGIN_LAUNCHERS}) if plugins else files
    if name not in known:
        raise SpecPilotError(f"LAUNCHER={name}: no such Hydra launcher config; choose one of {', '.join(known)}")
    module = PLUGIN_LAUNCHERS.get(name) or LAUNCHER_EXTRAS.get(name, (None, None))[0]
    if module is not None:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise SpecPilotError(
                f"LAUNCHER={name} needs the 'slurm' extra (submitit): .venv/bin/pip install -e '.[slurm]'"
            )
    check_slurm(name)


def check_slurm(name: str) -> None:
    """A Slurm launcher submits with srun/sbatch: off a cluster, say so in one line (submitit's own error is a
    traceback from inside the multirun)."""
    if name in SLURM_LAUNCHERS and shutil.which("srun") is None:
        raise SpecPilotError(
            f"LAUNCHER={name} submits jobs to a Slurm cluster, but srun is not on PATH here; run it on the "
            "cluster (its login node), or choose LAUNCHER=submitit_local or local to run the jobs on this machine"
        )

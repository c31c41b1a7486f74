"""`make sweep`: build many setting × arm engines as one Hydra multirun and print a summary table.

Each job composes through Hydra (the joblib or Slurm launcher may run it elsewhere), builds its engine and writes
build.json into its job directory; the summary callback reads those files when the multirun ends."""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from specpilot_build.config.compose import compose_setting
from specpilot_build.config.launchers import check_launcher
from specpilot_build.config.schema import register
from specpilot_build.errors import SpecPilotError, debug_enabled
from specpilot_build.locations import conf_dir, data_dir

RESULT = "build.json"


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
def build_job(cfg: DictConfig) -> dict:
    from specpilot_build.assemble.builder import build_composed
    from specpilot_build.config.compose import from_hydra_config

    out = Path(HydraConfig.get().runtime.output_dir)
    composed = from_hydra_config(cfg, dict(HydraConfig.get().runtime.choices))
    row: dict[str, object] = {"setting": composed.setting, "arm": composed.arm}
    try:
        result = build_composed(composed)
        row.update(
            id=result.engine.id,
            files=result.files,
            bytes=result.bytes,
            seconds=round(result.seconds, 3),
            created=result.created,
        )
    except SpecPilotError as exc:
        if debug_enabled():
            raise
        row.update(error=str(exc))
    (out / RESULT).write_text(json.dumps(row, indent=1) + "\n")
    return row


class SummaryCallback(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from rich.console import Console
        from rich.table import Table

        rows = [
            json.loads(p.read_text())
            for p in sorted(Path(config.hydra.sweep.dir).glob(f"*/{RESULT}"), key=lambda p: int(p.parent.name))
        ]
        table = Table("setting", "arm", "engine", "files", "bytes", "seconds", title="sweep")
        for r in rows:
            if "error" in r:
                table.add_row(r["setting"], r["arm"], f"[red]{r['error']}[/]", "", "", "")
            else:
                table.add_row(
                    r["setting"],
                    r["arm"],
                    r["id"][:12],
                    str(r["files"]),
                    f"{r['bytes']:,}",
                    f"{r['seconds']:.2f}{'' if r['created'] else ' (existed)'}",
                )
        Console(width=160).print(table)
        summary = Path(config.hydra.sweep.dir) / "summary.json"
        summary.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"summary: {summary}")


def run_sweep(settings: str, arms: str, launcher: str | None = None, overrides: Sequence[str] = ()) -> list[dict]:
    """A Hydra multirun of `settings` x `arms` (comma-separated); the summary callback prints the table."""
    sweep_dir = data_dir() / "hydra" / "multirun" / time.strftime("%Y-%m-%d_%H-%M-%S")
    hydra_args = [
        "--multirun",
        f"setting@_global_={settings}",
        f"arm={arms}",
        f"hydra.sweep.dir={sweep_dir}",
        f"hydra.run.dir={data_dir() / 'hydra' / 'run'}",
        "+hydra.callbacks.summary._target_=specpilot_build.cli.sweep.SummaryCallback",
        "hydra.job.chdir=false",
        *overrides,
    ]
    if launcher:
        check_launcher(launcher, plugins=False)
        hydra_args.append(f"hydra/launcher={launcher}")
    for job in _jobs(settings, arms, overrides):  # compose every job first: a typo is one line, before any job
        compose_setting(*job)
    register()
    saved = sys.argv
    sys.argv = ["specpilot-sweep", *hydra_args]
    try:
        build_job()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise SpecPilotError(f"the sweep stopped (Hydra exit status {exc.code}); its output is above") from None
    finally:
        sys.argv = saved
    rows = json.loads((sweep_dir / "summary.json").read_text())
    failed = [f"{r['setting']}/{r['arm']}: {r['error']}" for r in rows if "error" in r]
    if failed:
        raise SpecPilotError(f"{len(failed)} of {len(rows)} sweep jobs failed: " + "; ".join(failed))
    return rows


def _jobs(settings: str, arms: str, overrides: Sequence[str]) -> list[tuple[str, str, list[str]]]:
    """Every (setting, arm, overrides) the multirun will launch, sweep overrides (`key=a,b`) expanded."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    axes = []
    for override in OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("hydra")]):
        key = override.get_key_element()
        values = (
            list(override.sweep_string_iterator())
            if override.is_sweep_override()
            else [override.get_value_element_as_str()]
        )
        axes.append([f"{key}={value}" for value in values])
    return [
        (s, a, list(combo)) for s in settings.split(",") for a in arms.split(",") for combo in itertools.product(*axes)
    ]

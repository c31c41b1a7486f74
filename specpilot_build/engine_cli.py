"""`specpilot engine build|verify|show|ls`: build a setting's engine and inspect the store."""
from __future__ import annotations

import argparse

from .build import build_engine, describe
from .compose import ARMS
from .store import check_engine, list_engines, resolve_engine

DEFAULT_SETTING = "cpu_c1_stories260k_ngram"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specpilot engine")
    sub = parser.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="build (or find) the engine of a setting and arm; prints id and path")
    b.add_argument("--setting", default=DEFAULT_SETTING)
    b.add_argument("--arm", default="final", choices=ARMS)
    b.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. drafter.num_draft_tokens=6")
    v = sub.add_parser("verify", help="re-hash an engine against its manifest; non-zero exit on any difference")
    v.add_argument("engine")
    s = sub.add_parser("show", help="setting, arm, pins, mechanisms and size of an engine")
    s.add_argument("engine")
    sub.add_parser("ls", help="list the engines in the store")
    args = parser.parse_args(argv)
    return {"build": _build, "verify": _verify, "show": _show, "ls": _ls}[args.verb](args)


def _build(args) -> int:
    result = build_engine(args.setting, args.arm, args.overrides)
    print(describe(result))
    return 0


def _verify(args) -> int:
    engine = resolve_engine(args.engine)
    problems = check_engine(engine)
    for line in problems:
        print(f"{engine.id[:12]}: {line}")
    if problems:
        print(f"engine {engine.id[:12]}: {len(problems)} file(s) differ from its manifest")
        return 1
    print(f"engine {engine.id[:12]}: {len(engine.manifest['files'])} files match the manifest")
    return 0


def _show(args) -> int:
    from rich.console import Console
    from rich.table import Table

    engine = resolve_engine(args.engine)
    m = engine.manifest
    files = m["files"]
    console = Console()
    table = Table(show_header=False, box=None)
    rows = [("engine", engine.id), ("path", str(engine.path)), ("setting", m["setting"]), ("arm", m["arm"]),
            ("choices", ", ".join(f"{k}={v}" for k, v in sorted(m["choices"].items()))),
            ("runtime", _runtime_line(m["inputs"]["runtime"]))]
    for role, pin in m["inputs"]["checkpoints"].items():
        if pin:
            locked = f", {len(pin.get('files', []))} files locked" if pin.get("files") else ""
            rows.append((role, f"{pin['repo']}@{pin['revision']}{locked}"))
    rows.append(("mechanisms", ", ".join(x["name"] for x in m["config"]["mechanisms"]) or "-"))
    rows.append(("overlays", ", ".join(o["name"] for o in m["inputs"]["overlays"]) or "-"))
    rows.append(("size", f"{len(files)} files, {sum(f['size'] for f in files):,} bytes"))
    base = m.get("base", {})
    if "dropped_files" in base:
        rows.append(("pruned", f"kept {base['kept_files']} files / {base['kept_bytes']:,} bytes, dropped "
                               f"{base['dropped_files']} files / {base['dropped_bytes']:,} bytes"))
    for key, value in rows:
        table.add_row(f"[bold]{key}[/]", value)
    console.print(table)
    return 0


def _runtime_line(rt: dict) -> str:
    if rt["kind"] == "wheel":
        return f"{rt['name']} {rt['version']} ({rt['filename']}, sha256 {rt['sha256'][:16]}…)"
    return f"{rt['name']} (in-repo {rt['dir']}, {rt['digest'][:23]}…)"


def _ls(args) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table("engine", "setting", "arm", "files", "bytes")
    for engine in list_engines():
        m = engine.manifest
        table.add_row(engine.id[:12], m["setting"], m["arm"], str(len(m["files"])),
                      f"{sum(f['size'] for f in m['files']):,}")
    Console().print(table)
    return 0

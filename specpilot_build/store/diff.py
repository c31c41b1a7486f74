"""The manifest-diff audit: why do two engines have different ids?

`specpilot diff A B [--json] [--files]` compares two engines' manifests section by section — pins, config,
launch arguments, runtime base, overlays (with their patch hunks), files, size — in a fixed, deterministic
order, and opens with one line per cause. Exit status like diff(1): 0 identical, 1 different, 2 error."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from specpilot_build.errors import SpecPilotError
from specpilot_build.store.engines import Engine
from specpilot_build.store.manifest import JsonObject

ABSENT = "(absent)"


def diff_engines(a: Engine, b: Engine, with_file_diffs: bool = False) -> JsonObject:
    ma, mb = a.manifest, b.manifest
    files = _file_changes(ma["files"], mb["files"])
    report: JsonObject = {
        "a": _describe(a),
        "b": _describe(b),
        "identical": a.id == b.id,
        "pins": _pin_changes(ma["inputs"], mb["inputs"]),
        "config": _changes(_flatten(_head_config(ma)), _flatten(_head_config(mb))),
        "launch": _launch_changes(a, b),
        "runtime_base": _changes(_flatten(_base_summary(ma)), _flatten(_base_summary(mb))),
        "overlays": _overlay_changes(ma, mb),
        "files": files,
        "size": _size(ma["files"], mb["files"]),
    }
    if with_file_diffs:
        report["file_diffs"] = _text_diffs(a, b, files["modified"])
    report["why"] = _why(report)
    return report


# --- sections ------------------------------------------------------------------------------------------------


def _describe(engine: Engine) -> JsonObject:
    m = engine.manifest
    return {"id": engine.id, "setting": m.get("setting"), "arm": m.get("arm")}


def _pin_changes(ia: JsonObject, ib: JsonObject) -> list[JsonObject]:
    """Checkpoints (role: repo@rev → repo@rev), the runtime base and kernels, by their pinned identity."""
    out: list[JsonObject] = []
    for role in sorted(set(ia.get("checkpoints", {})) | set(ib.get("checkpoints", {}))):
        pa, pb = ia.get("checkpoints", {}).get(role), ib.get("checkpoints", {}).get(role)
        if pa != pb:
            out.append({"key": f"checkpoint.{role}", "old": _pin_text(pa), "new": _pin_text(pb)})
    ra, rb = ia.get("runtime", {}), ib.get("runtime", {})
    if ra != rb:
        out.append({"key": "runtime", "old": _runtime_text(ra), "new": _runtime_text(rb)})
    ka = {k["name"]: k["digest"] for k in ia.get("kernels", [])}
    kb = {k["name"]: k["digest"] for k in ib.get("kernels", [])}
    for name in sorted(set(ka) | set(kb)):
        if ka.get(name) != kb.get(name):
            out.append({"key": f"kernel.{name}", "old": ka.get(name, ABSENT), "new": kb.get(name, ABSENT)})
    return out


def _pin_text(pin: JsonObject | None) -> str:
    if not pin:
        return ABSENT
    text = f"{pin['repo']}@{pin['revision']}"
    files = pin.get("files", []) + pin.get("converted", [])
    return text + (f" ({len(files)} pinned files)" if files else "")


def _runtime_text(rt: JsonObject) -> str:
    if not rt:
        return ABSENT
    if rt.get("kind") == "wheel":
        return f"{rt['name']} {rt['version']} wheel sha256:{rt['sha256'][:16]}"
    return f"{rt.get('name')} dir {rt.get('dir')} {rt.get('digest', '')[:23]}"


def _head_config(m: JsonObject) -> JsonObject:
    return {
        "setting": m.get("setting"),
        "arm": m.get("arm"),
        "choices": m.get("choices", {}),
        "builder": m.get("builder", {}),
        "schema": m.get("schema"),
        **{"config": m.get("config", {})},
    }


def _base_summary(m: JsonObject) -> JsonObject:
    return {k: v for k, v in (m.get("base") or {}).items() if k != "overlays"}


def _launch_changes(a: Engine, b: Engine) -> list[JsonObject]:
    """Server arguments (flag: old → new) and environment of the two launch specs."""
    sa, sb = (_read_json(e.path / "launch.json") for e in (a, b))
    fa, fb = _flags(sa.get("argv", [])), _flags(sb.get("argv", []))
    out = _changes(fa, fb)
    out += _changes(
        {f"env {k}": v for k, v in sa.get("env", {}).items()}, {f"env {k}": v for k, v in sb.get("env", {}).items()}
    )
    return out


def _flags(argv: list[str]) -> dict[str, str]:
    """`--flag value...` pairs (a bare flag maps to "true"); what precedes the first flag is `command`."""
    out: dict[str, str] = {}
    first = next((i for i, arg in enumerate(argv) if arg.startswith("--")), len(argv))
    out["command"] = " ".join(argv[:first])
    key = None
    for arg in argv[first:]:
        if arg.startswith("--"):
            key = arg
            out[key] = "true"
        elif key is not None:
            out[key] = arg if out[key] == "true" else f"{out[key]} {arg}"
    return out


def _overlay_changes(ma: JsonObject, mb: JsonObject) -> list[JsonObject]:
    oa: dict[str, JsonObject] = {o["name"]: o for o in (ma.get("base") or {}).get("overlays", [])}
    ob: dict[str, JsonObject] = {o["name"]: o for o in (mb.get("base") or {}).get("overlays", [])}
    out: list[JsonObject] = []
    for name in sorted(set(oa) | set(ob)):
        a, b = oa.get(name), ob.get(name)
        if a == b:
            continue
        change = "added" if a is None else "removed" if b is None else "changed"
        present = b if b is not None else oa[name]
        out.append(
            {
                "name": name,
                "change": change,
                "old_digest": a["digest"] if a is not None else None,
                "new_digest": b["digest"] if b is not None else None,
                "files": [f["path"] for f in present["files"]],
                "hunks": _overlay_hunks(name, present["digest"]),
            }
        )
    return out


def _overlay_hunks(name: str, digest: str) -> list[str] | str:
    """The overlay's patch hunks, read from overlays/<name>/ when its digest is the one the engine recorded."""
    from specpilot_build.locations import OVERLAYS_DIR
    from specpilot_build.store.manifest import overlay_digest
    from specpilot_build.store.names import plain_name

    try:
        directory = OVERLAYS_DIR / plain_name(name, "overlay name")
        if overlay_digest(directory) != digest:
            return f"overlays/{name} in this checkout is not the recorded {digest[:19]}…; hunks not shown"
    except (OSError, SpecPilotError):
        return f"overlays/{name} is not in this checkout; hunks not shown"
    hunks = []
    for patch in sorted((directory / "patches").glob("*.patch")):
        hunks.append(f"patches/{patch.name}\n{patch.read_text(encoding='utf-8').rstrip()}")
    return hunks


def _file_changes(fa: list[JsonObject], fb: list[JsonObject]) -> JsonObject:
    ea, eb = {f["path"]: f for f in fa}, {f["path"]: f for f in fb}
    order = sorted(set(ea) | set(eb), key=lambda p: p.encode())
    added = [{"path": p, "size": eb[p]["size"]} for p in order if p not in ea]
    removed = [{"path": p, "size": ea[p]["size"]} for p in order if p not in eb]
    changed = [
        p for p in order if p in ea and p in eb and (ea[p]["blake3"], ea[p]["exec"]) != (eb[p]["blake3"], eb[p]["exec"])
    ]
    modified = [
        {
            "path": p,
            "old_size": ea[p]["size"],
            "new_size": eb[p]["size"],
            "exec": [ea[p]["exec"], eb[p]["exec"]] if ea[p]["exec"] != eb[p]["exec"] else None,
        }
        for p in changed
    ]
    return {"added": added, "removed": removed, "modified": modified}


def _size(fa: list[JsonObject], fb: list[JsonObject]) -> JsonObject:
    sa, sb = sum(f["size"] for f in fa), sum(f["size"] for f in fb)
    return {"old_bytes": sa, "new_bytes": sb, "delta_bytes": sb - sa, "old_files": len(fa), "new_files": len(fb)}


def _text_diffs(a: Engine, b: Engine, modified: list[JsonObject]) -> list[JsonObject]:
    out: list[JsonObject] = []
    for entry in modified:
        path = entry["path"]
        try:
            old, new = (_text_lines(e.path / path) for e in (a, b))
        except UnicodeDecodeError:
            out.append({"path": path, "diff": None})
            continue
        out.append({"path": path, "diff": "".join(difflib.unified_diff(old, new, f"a/{path}", f"b/{path}"))})
    return out


def _text_lines(path: Path) -> list[str]:
    """A text file's lines; JSON (config.json, launch.json: one canonical line) is shown indented."""
    text = path.read_bytes().decode("utf-8")
    if path.suffix == ".json":
        try:
            text = json.dumps(json.loads(text), indent=1, sort_keys=True, ensure_ascii=False) + "\n"
        except ValueError:
            pass
    return text.splitlines(keepends=True)


# --- helpers ------------------------------------------------------------------------------------------------


def _flatten(node: Any, prefix: str = "") -> dict[str, object]:
    """Dotted keys → leaf values. A list of named dicts (mechanisms) is keyed by name, `key[name].field`;
    other lists are leaves (compared whole); empty dicts and lists carry nothing."""
    if isinstance(node, dict):
        out: dict[str, object] = {}
        for key in node:
            out.update(_flatten(node[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(node, list) and not node:
        return {}
    if (
        isinstance(node, list)
        and all(isinstance(x, dict) and "name" in x for x in node)
        and len({x["name"] for x in node}) == len(node)
    ):
        out = {}
        for item in node:
            rest = {k: v for k, v in item.items() if k != "name"}
            out.update(_flatten(rest, f"{prefix}[{item['name']}]") or {f"{prefix}[{item['name']}]": "present"})
        return out
    return {prefix: node}


def _changes(old: dict[str, Any], new: dict[str, Any]) -> list[JsonObject]:
    out: list[JsonObject] = []
    for key in sorted(set(old) | set(new)):
        if key not in new:
            out.append({"key": key, "old": old[key], "new": ABSENT})
        elif key not in old:
            out.append({"key": key, "old": ABSENT, "new": new[key]})
        elif old[key] != new[key]:
            out.append({"key": key, "old": old[key], "new": new[key]})
    return out


def _read_json(path: Path) -> JsonObject:
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise SpecPilotError(f"{path}: not valid JSON ({str(exc).splitlines()[0][:80]})") from None
    if not isinstance(data, dict):
        raise SpecPilotError(f"{path}: a JSON {type(data).__name__}, not an object")
    return data


def _why(report: JsonObject) -> list[str]:
    """One line per cause of the id change, most fundamental first."""
    if report["identical"]:
        return []
    lines = [f"pin {c['key']}: {c['old']} → {c['new']}" for c in report["pins"]]
    config = [c for c in report["config"] if not c["key"].startswith("config.runtime.launch_args.")]
    if config:
        shown = ", ".join(f"{c['key']} {_change(c['old'], c['new'])}" for c in config[:6])
        lines.append("config: " + shown + (f" (+{len(config) - 6} more)" if len(config) > 6 else ""))
    args = [c for c in report["launch"] if c["key"] != "command"]
    if args:
        lines.append("launch args: " + ", ".join(f"{c['key']} {_change(c['old'], c['new'])}" for c in args))
    for o in report["overlays"]:
        lines.append(f"overlay {o['change']}: {o['name']} ({', '.join(o['files'])})")
    f = report["files"]
    counts = [f"{len(f[k])} {k}" for k in ("added", "removed", "modified") if f[k]]
    if counts:
        lines.append("files: " + ", ".join(counts))
    return lines or ["manifest fields outside the tracked sections differ"]


def _text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)


def _short(value: object) -> str:
    text = _text(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _change(old: object, new: object) -> str:
    """`old → new` for the summary: shortened, unless shortening would make the two look the same."""
    short_old, short_new = _short(old), _short(new)
    if short_old == short_new:
        short_old, short_new = _text(old), _text(new)
    return f"{short_old} → {short_new}"


def render(report: JsonObject) -> str:
    a, b = report["a"], report["b"]
    out = [f"A {a['id'][:12]}  {a['setting']} / {a['arm']}", f"B {b['id'][:12]}  {b['setting']} / {b['arm']}"]
    if report["identical"]:
        out.append("identical")
        return "\n".join(out)
    out.append("why the id differs:")
    out += [f"  {line}" for line in report["why"]]

    def section(title: str, rows: list[str]) -> None:
        if rows:
            out.append("")
            out.append(f"{title}:")
            out.extend(f"  {row}" for row in rows)

    section("pins", [f"{c['key']}: {c['old']} → {c['new']}" for c in report["pins"]])
    section("config", [f"{c['key']}: {_text(c['old'])} → {_text(c['new'])}" for c in report["config"]])
    section("launch", [f"{c['key']}: {c['old']} → {c['new']}" for c in report["launch"]])
    section("runtime base", [f"{c['key']}: {_text(c['old'])} → {_text(c['new'])}" for c in report["runtime_base"]])
    rows: list[str] = []
    for o in report["overlays"]:
        digests = f"{(o['old_digest'] or ABSENT)[:19]} → {(o['new_digest'] or ABSENT)[:19]}"
        rows.append(f"{o['change']} {o['name']}: {digests}; touches {', '.join(o['files'])}")
        hunks = o["hunks"]
        rows += [f"  {hunks}"] if isinstance(hunks, str) else [f"    {line}" for h in hunks for line in h.splitlines()]
    section("overlays", rows)
    f = report["files"]
    section(
        "files",
        [f"+ {e['path']} ({e['size']} B)" for e in f["added"]]
        + [f"- {e['path']} ({e['size']} B)" for e in f["removed"]]
        + [f"M {e['path']} ({e['old_size']} → {e['new_size']} B)" for e in f["modified"]],
    )
    s = report["size"]
    section(
        "size",
        [
            f"{s['old_bytes']} → {s['new_bytes']} bytes ({s['delta_bytes']:+d}), "
            f"{s['old_files']} → {s['new_files']} files"
        ],
    )
    for d in report.get("file_diffs", []):
        out.append("")
        out.append(d["diff"].rstrip("\n") if d["diff"] is not None else f"Binary file {d['path']} differs")
    return "\n".join(out)

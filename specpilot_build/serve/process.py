"""`make serve` / `make stop`: run exactly one engine tree, and stop exactly the process that was recorded.

serve: resolve (or build) the engine → re-hash it against its manifest → hardware gate → pinned checkpoints
present and verified → the launch spec from the tree → run record → wait for health and for /server_info to
report this engine's id. stop: the recorded process group only, idempotently."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from specpilot_build.defaults import DEFAULT_PORT
from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import data_dir, environment_dir
from specpilot_build.models.checkpoints import model_dirs
from specpilot_build.serve.audit import audit_env
from specpilot_build.store.engines import Engine, check_engine, resolve_engine

HOST = "127.0.0.1"
SGLANG_RUNTIME_MODULES = ("torch", "transformers", "uvicorn", "fastapi", "sgl_kernel", "flashinfer")


def runs_dir() -> Path:
    return data_dir() / "runs"


def record_path(port: int) -> Path:
    return runs_dir() / f"{port}.json"


# --- serve --------------------------------------------------------------------------------------------------


def serve(
    engine: Engine | str,
    port: int = DEFAULT_PORT,
    gpu: int = 0,
    *,
    ignore_hardware: bool = False,
    dry_run: bool = False,
    timeout: float = 300.0,
    quiet: bool = False,
) -> dict:
    """Serve `engine` (an Engine or an id / unique prefix) on 127.0.0.1:port; returns the run record."""
    if isinstance(engine, str):
        engine = resolve_engine(engine)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))
    problems = check_engine(engine)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; … {len(problems) - 5} more" if len(problems) > 5 else "")
        raise SpecPilotError(
            f"engine {engine.id[:12]} differs from its manifest, refusing to serve it: {shown}; "
            f"`specpilot engine check --repair {engine.id[:12]}` mends it"
        )
    cfg = engine.config
    if dry_run:  # printing the command needs neither the GPU, nor SGLang's dependencies, nor the weights
        models = model_dirs(engine.manifest["inputs"]["checkpoints"], cfg, fetch=False)
        argv, env = launch_command(engine, models, port)
        env["CUDA_VISIBLE_DEVICES"] = str(gpu) if cfg["hardware"]["device"] == "cuda" else ""
        for key in sorted(env):
            print(f"{key}={shlex.quote(env[key])}")
        print(shlex.join(argv))
        return {}
    check_hardware(cfg, gpu, ignore_hardware)
    if cfg["runtime"]["name"].split("-", 1)[0] == "sglang":
        _check_sglang_dependencies()
    models = model_dirs(engine.manifest["inputs"]["checkpoints"], cfg)
    argv, env = launch_command(engine, models, port)
    env["CUDA_VISIBLE_DEVICES"] = str(gpu) if cfg["hardware"]["device"] == "cuda" else ""
    env = audit_env(env)  # SPECPILOT_IMPORT_AUDIT=<log>: every engine process logs its imports (serve/audit.py)
    _claim_port(port, say)
    log = runs_dir() / f"{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=engine.path,
            start_new_session=True,
        )
    record = {
        "port": port,
        "host": HOST,
        "pid": proc.pid,
        "engine_id": engine.id,
        "setting": cfg["setting"],
        "arm": cfg["arm"]["name"],
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "log": str(log),
        "argv": argv,
    }
    _write_record(record)
    say(f"serving {engine.id[:12]} ({cfg['setting']}, {cfg['arm']['name']}) on {HOST}:{port}, pid {proc.pid}")
    try:
        _wait_healthy(proc, port, engine.id, timeout, log)
    except BaseException:
        _terminate(proc.pid)
        record_path(port).unlink(missing_ok=True)
        raise
    say(f"ready: http://{HOST}:{port}  (log {log})")
    return record


def launch_command(engine: Engine, models: dict[str, Path], port: int) -> tuple[list[str], dict[str, str]]:
    spec = json.loads((engine.path / "launch.json").read_bytes())
    values = {
        "python": sys.executable,
        "engine": str(engine.path),
        "engine_id": engine.id,
        "host": HOST,
        "port": str(port),
        "model": str(models.get("model", "")),
        "draft_model": str(models.get("drafter", "")),
    }
    argv = [arg.format(**values) for arg in spec["argv"]]
    env = {key: value.format(**values) for key, value in spec["env"].items()}
    extra = environment_dir()
    if extra is not None:  # an installed bundle's environment: after the tree, so the hashed engine files win
        if not extra.is_dir():
            raise SpecPilotError(f"SPECPILOT_ENV={extra}: not a directory (the environment of an installed bundle)")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(extra)) if p)
    return argv, env


def check_hardware(cfg: dict, gpu: int, ignore: bool) -> None:
    """CPU settings run anywhere; a GPU setting needs the configured GPU (name and compute capability)."""
    hw = cfg["hardware"]
    if hw["device"] != "cuda" or ignore:
        return
    visible = _gpu(gpu)
    want = f"{hw['gpu']} (compute capability {hw['compute_capability']}, {hw['arch']})"
    if visible is None:
        raise SpecPilotError(
            f"setting {cfg['setting']} needs {want}, but no CUDA GPU {gpu} is visible "
            f"(nvidia-smi); pass --ignore-hardware to try anyway"
        )
    name, capability = visible
    if capability != hw["compute_capability"] or not name.startswith(hw["gpu"].split(" 80GB")[0]):
        raise SpecPilotError(
            f"setting {cfg['setting']} needs {want}, GPU {gpu} is {name} (compute capability "
            f"{capability}); pass --ignore-hardware to serve it anyway"
        )


def _gpu(index: int) -> tuple[str, str] | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "-i", str(index), "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    name, capability = (part.strip() for part in out.stdout.strip().splitlines()[0].rsplit(",", 1))
    return name, capability


def _check_sglang_dependencies() -> None:
    missing = [m for m in SGLANG_RUNTIME_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecPilotError(
            f"SGLang's runtime dependencies are missing here: {', '.join(missing)} "
            f"(install sglang's requirements on the GPU machine)"
        )


def _claim_port(port: int, say) -> None:
    existing = read_record(port)
    if existing is not None:
        if _is_our_process(existing):
            raise SpecPilotError(
                f"port {port}: engine {existing['engine_id'][:12]} is already served there "
                f"(pid {existing['pid']}); `make stop PORT={port}` first"
            )
        say(f"port {port}: removing a stale run record (pid {existing['pid']} is not running)")
        record_path(port).unlink(missing_ok=True)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise SpecPilotError(f"port {port!r} is not a TCP port number (1..65535); choose PORT=...")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As uvicorn binds: SO_REUSEADDR lets a port whose old connections linger in TIME-WAIT (`make stop`
        # then `make serve` at once) be claimed, while a port someone listens on still fails.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            raise SpecPilotError(f"port {port} on {HOST} is in use by another program; choose PORT=...") from None


def _wait_healthy(proc: subprocess.Popen, port: int, engine_id: str, timeout: float, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    base = f"http://{HOST}:{port}"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SpecPilotError(
                f"the server exited with status {proc.returncode} before it was healthy; log tail:\n{_tail(log)}"
            )
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                reported = httpx.get(f"{base}/server_info", timeout=5).json().get("engine_id")
                if reported != engine_id:
                    raise SpecPilotError(f"the server on port {port} reports engine {reported!r}, not {engine_id}")
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SpecPilotError(f"the server did not become healthy within {timeout:.0f} s; log tail:\n{_tail(log)}")


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


# --- run records and stop -----------------------------------------------------------------------------------


def read_record(port: int) -> dict | None:
    try:
        return json.loads(record_path(port).read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        raise SpecPilotError(f"{record_path(port)}: unreadable run record; remove it") from None


def _write_record(record: dict) -> None:
    path = record_path(record["port"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def _is_our_process(record: dict) -> bool:
    """The recorded pid still runs the recorded engine (a reused pid running something else does not count)."""
    try:
        cmdline = Path(f"/proc/{record['pid']}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return record["engine_id"].encode() in cmdline or str(record["port"]).encode() in cmdline.split(b"\0")


def stop(port: int) -> str:
    record = read_record(port)
    if record is None:
        return f"port {port}: nothing recorded, nothing to stop"
    if _is_our_process(record):
        _terminate(record["pid"])
        message = f"stopped engine {record['engine_id'][:12]} on port {port} (pid {record['pid']})"
    else:
        message = f"port {port}: recorded pid {record['pid']} was not running; removed the stale record"
    record_path(port).unlink(missing_ok=True)
    return message


def _terminate(pid: int, grace: float = 10.0) -> None:
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            if not Path(f"/proc/{pid}").exists() or _zombie(pid):
                return
            time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True

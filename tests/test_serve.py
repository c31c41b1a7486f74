"""make serve / make stop: exactly the engine given, exactly the process recorded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from reference_runtime_helpers import free_port

from specpilot_build.assemble.builder import build_engine
from specpilot_build.errors import SpecPilotError
from specpilot_build.locations import REPO_ROOT

EMBEDDED = "cpu_c1_stories260k_ngram"


def cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "specpilot_build.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=timeout,
    )


def record(session_data: Path, port: int) -> dict | None:
    path = session_data / "runs" / f"{port}.json"
    return json.loads(path.read_text()) if path.exists() else None


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.split(")")[-1].split()[0] != "Z"


@pytest.mark.slow
def test_serve_runs_exactly_the_engine_and_stop_is_idempotent(session_data, golden):
    engine = build_engine(EMBEDDED, "ar").engine
    port = free_port()
    out = cli("serve", "--engine", engine.id[:10], "--port", str(port))
    assert out.returncode == 0, out.stderr
    rec = record(session_data, port)
    try:
        assert rec["engine_id"] == engine.id and rec["port"] == port and alive(rec["pid"])
        info = httpx.get(f"http://127.0.0.1:{port}/server_info").json()
        assert info["engine_id"] == engine.id and info["arm"] == "ar"
        prompt = golden["prompt_ids"]
        n = len(golden["sequence_ids"]) - len(prompt)
        got = httpx.post(
            f"http://127.0.0.1:{port}/generate",
            timeout=60,
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0}},
        ).json()
        assert prompt + got["output_ids"] == golden["sequence_ids"][: len(prompt) + len(got["output_ids"])]
        assert len(got["output_ids"]) > 0
    finally:
        first = cli("stop", "--port", str(port))
    assert first.returncode == 0 and "stopped engine" in first.stdout
    assert not alive(rec["pid"]) and record(session_data, port) is None
    second = cli("stop", "--port", str(port))
    assert second.returncode == 0 and "nothing to stop" in second.stdout


def test_a_tampered_engine_is_refused_before_anything_starts(tmp_path, monkeypatch, session_data):
    monkeypatch.setenv("SPECPILOT_ENGINES", str(tmp_path / "engines"))
    engine = build_engine(EMBEDDED, "final").engine
    target = engine.path / "runtime" / "specpilot_runtime" / "server.py"
    os.chmod(target, 0o644)
    target.write_text(target.read_text() + "\n# tampered\n")
    port = free_port()
    out = cli("serve", "--engine", engine.id, "--port", str(port))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "runtime/specpilot_runtime/server.py" in out.stderr and "refusing" in out.stderr
    assert record(session_data, port) is None and not (session_data / "runs" / f"{port}.log").exists()


@pytest.mark.slow
def test_a_killed_server_leaves_a_stale_record_the_next_serve_detects(session_data, shared):
    engine = build_engine(EMBEDDED, "ar").engine
    port = free_port()
    assert cli("serve", "--engine", engine.id, "--port", str(port)).returncode == 0
    pid = record(session_data, port)["pid"]
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    deadline = time.time() + 10
    while alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    again = cli("serve", "--engine", engine.id, "--port", str(port))
    try:
        assert again.returncode == 0, again.stderr
        assert "stale run record" in again.stderr
        assert record(session_data, port)["pid"] != pid
    finally:
        cli("stop", "--port", str(port))


def test_a_port_in_use_is_a_clear_error(session_data, shared):
    engine = build_engine(EMBEDDED, "ar").engine
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = cli("serve", "--engine", engine.id, "--port", str(port))
    assert out.returncode == 2 and f"port {port}" in out.stderr and "in use" in out.stderr
    assert record(session_data, port) is None


def test_dry_run_prints_the_exact_command_from_the_tree():
    engine = build_engine(EMBEDDED, "final").engine
    out = cli("serve", "--engine", engine.id, "--port", "30999", "--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert f"PYTHONPATH={engine.path}/runtime:{engine.path}/kernels" in lines
    assert "-m specpilot_runtime.server" in lines[-1] and f"--engine-id {engine.id}" in lines[-1]
    assert "--port 30999" in lines[-1]


def test_the_hardware_gate_refuses_a_gpu_setting_without_its_gpu():
    out = cli("serve", "--setting", "h200_c1_stories260k_ngram", "--arm", "ar", "--port", str(free_port()))
    assert out.returncode == 2 and "NVIDIA H200" in out.stderr and "--ignore-hardware" in out.stderr


@pytest.mark.slow
def test_dry_run_prints_a_gpu_engines_command_on_a_machine_without_gpu_or_sglang():
    """Printing the command needs neither the GPU (hardware gate) nor SGLang's dependencies nor the weights."""
    for setting in ("h200_c1_stories260k_ngram", "h200_c1_qwen3-8b_dflash"):
        out = cli("serve", "--setting", setting, "--arm", "final", "--dry-run")
        assert out.returncode == 0, out.stderr
        assert "CUDA_VISIBLE_DEVICES=0" in out.stdout and "--port 30000" in out.stdout.splitlines()[-1]
    assert "-m sglang.launch_server" in out.stdout.splitlines()[-1]


def _time_wait_port() -> int:
    """A loopback port whose only trace is a connection in TIME-WAIT (as `make stop` leaves behind)."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()  # the server side closes first: its socket ends in TIME-WAIT
        client.recv(1)
        client.close()
    time.sleep(0.1)
    return port


def test_a_port_left_in_time_wait_is_claimed(session_data):
    from specpilot_build.serve.process import _claim_port

    port = _time_wait_port()
    with socket.socket() as plain:  # what the claim did before: a bind without SO_REUSEADDR fails here
        try:
            plain.bind(("127.0.0.1", port))
            pytest.skip("the kernel let a plain bind through; no TIME-WAIT to test against")
        except OSError:
            pass
    said = []
    _claim_port(port, said.append)  # no error: uvicorn binds with SO_REUSEADDR, so the claim does too
    with socket.socket() as busy:  # while a real listener still refuses
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(SpecPilotError, match="in use"):
            _claim_port(busy.getsockname()[1], said.append)


@pytest.mark.parametrize("port", [0, 65536, 99999, -1])
def test_a_port_outside_the_range_is_one_line(session_data, port):
    from specpilot_build.serve.process import _claim_port

    with pytest.raises(SpecPilotError, match="1..65535"):
        _claim_port(port, lambda *a: None)


@pytest.mark.parametrize("verb", ["serve", "stop"])
def test_the_cli_refuses_a_bad_port_without_a_traceback(verb):
    args = ["--engine", "0123456789ab"] if verb == "serve" else []
    for bad in ("99999", "http"):
        out = cli(verb, *args, "--port", bad)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        last = out.stderr.strip().splitlines()[-1]  # argparse: the usage, then one error line
        assert last.startswith(f"specpilot {verb}: error: argument --port") and "1..65535" in last

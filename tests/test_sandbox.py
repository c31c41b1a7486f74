"""The sandbox contains hostile programs, scores them as failures, and leaves the machine healthy."""
from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from specpilot_build.measure import sandbox

ROOMY = sandbox.Limits(wall_s=15.0, cpu_s=5)  # a loaded 2-core machine must not fail the well-behaved


def _processes_left(outcome: sandbox.Outcome) -> list[str]:
    """Processes (zombies included) still in the run's process group or owned by its uid."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            owner = entry.stat().st_uid
        except OSError:
            continue
        if int(fields[3]) == outcome.pgid or (outcome.uid is not None and owner == outcome.uid):
            left.append(f"pid {entry.name} state {fields[0]}")
    return left


def _machine_healthy(outcome: sandbox.Outcome) -> None:
    assert _processes_left(outcome) == []
    assert subprocess.run(["true"], timeout=10).returncode == 0  # we can still fork and exec
    assert bytearray(64 * 2**20)  # and allocate


def test_exit_status_decides():
    assert sandbox.run_python("assert sum([1, 2]) == 3\nprint('ok')").passed
    failed = sandbox.run_python("assert sum([1, 2]) == 4")
    assert not failed.passed and failed.returncode == 1 and "AssertionError" in failed.stderr
    assert not sandbox.run_python("def broken(:\n").passed


def test_runs_in_a_fresh_directory_with_a_minimal_environment(monkeypatch):
    monkeypatch.setenv("SPECPILOT_TEST_SECRET", "do-not-leak")
    outcome = sandbox.run_python(
        "import os\n"
        "assert 'SPECPILOT_TEST_SECRET' not in os.environ, os.environ\n"
        "assert os.environ['HOME'] == os.environ['TMPDIR'] == os.getcwd()\n"
        "assert sorted(os.listdir('.')) == ['program.py'], os.listdir('.')\n"
        "open('scratch.txt', 'w').write('allowed')\n")
    assert outcome.passed, outcome.stderr


def test_busy_loop_is_stopped_by_the_cpu_limit():
    started = time.monotonic()
    outcome = sandbox.run_python("while True:\n    pass\n", sandbox.Limits(wall_s=30.0, cpu_s=1))
    assert not outcome.passed and not outcome.timed_out
    assert time.monotonic() - started < 25
    _machine_healthy(outcome)


def test_sleeping_program_is_killed_at_the_wall_timeout():
    started = time.monotonic()
    outcome = sandbox.run_python("import time\ntime.sleep(60)\n", sandbox.Limits(wall_s=1.0, cpu_s=5))
    assert not outcome.passed and outcome.timed_out
    assert time.monotonic() - started < 5
    _machine_healthy(outcome)


def test_fork_bomb_is_contained_and_leaves_no_process():
    bomb = (
        "import os, time\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()  # try to leave the process group\n"
        "    except OSError:\n"
        "        time.sleep(0.01)\n")
    limits = sandbox.Limits(wall_s=3.0, cpu_s=2)
    started = time.monotonic()
    outcome = sandbox.run_python(bomb, limits)
    assert not outcome.passed
    assert time.monotonic() - started < limits.wall_s + 5
    _machine_healthy(outcome)


def test_escaped_child_does_not_outlive_the_run():
    marker = f"{300 + (time.monotonic_ns() % 10**6) / 10**7:.7f}"  # a sleep length no other process has
    program = ("import subprocess\n"
               f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n")
    outcome = sandbox.run_python(program, ROOMY)
    assert outcome.passed, outcome.stderr  # it exited 0, but the child it left in a new session must be gone
    time.sleep(0.1)
    assert [p for p in _command_lines() if marker in p] == []
    _machine_healthy(outcome)


def _command_lines() -> list[str]:
    lines = []
    for entry in Path("/proc").iterdir():
        try:
            lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return lines


def test_memory_hog_fails():
    # first touches of fresh memory can be slow on a loaded VM: a roomy wall clock, so that what stops the
    # hog is the address-space limit (MemoryError), not the timeout
    limits = sandbox.Limits(wall_s=30.0, cpu_s=20, memory_bytes=256 * 2**20)
    outcome = sandbox.run_python("hog = []\nwhile True:\n    hog.append(bytearray(32 * 2**20))\n", limits)
    assert not outcome.passed and not outcome.timed_out and "MemoryError" in outcome.stderr
    _machine_healthy(outcome)


def test_large_file_is_refused():
    outcome = sandbox.run_python("open('big', 'wb').write(b'x' * (64 * 2**20))\n", ROOMY)
    assert not outcome.passed and "File too large" in outcome.stderr


def test_writing_outside_the_work_directory_fails(tmp_path):
    target = tmp_path / "escaped.txt"
    outcome = sandbox.run_python(f"open({str(target)!r}, 'w').write('escaped')\n", ROOMY)
    assert not outcome.passed
    assert not target.exists()


@pytest.mark.skipif(not sandbox.isolation().private_tmp, reason="needs a private mount namespace")
def test_shared_temp_directories_are_private(tmp_path):
    name = f"specpilot-escape-{os.getpid()}-{time.monotonic_ns()}"
    program = "".join(f"open('{root}/{name}', 'w').write('x')\n" for root in ("/tmp", "/var/tmp", "/dev/shm"))
    outcome = sandbox.run_python(program, ROOMY)
    assert outcome.passed, outcome.stderr  # allowed inside, but on fresh tmpfs that vanish with the run
    for root in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not Path(root, name).exists()


def test_socket_to_a_loopback_server_gets_no_connection():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except socket.timeout:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        program = ("import socket\n"
                   f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                   "s.sendall(b'exfiltrate')\n")
        outcome = sandbox.run_python(program, ROOMY)
        time.sleep(0.3)
        refused = list(accepted)
        with socket.create_connection(("127.0.0.1", port), timeout=2):  # the server does accept
            deadline = time.monotonic() + 5
            while not accepted and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()
    assert not outcome.passed
    assert refused == []
    assert len(accepted) == 1
    for connection, _ in accepted:
        connection.close()
    _machine_healthy(outcome)


def test_run_many_keeps_order_and_isolates_failures():
    programs = [f"assert {i} % 3 != 0" for i in range(12)]
    outcomes = sandbox.run_many(programs, ROOMY, workers=2)
    assert [o.passed for o in outcomes] == [i % 3 != 0 for i in range(12)]


def test_isolation_is_reported():
    description = sandbox.isolation().describe()
    assert "network:" in description

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
        "open('scratch.txt', 'w').write('allowed')\n"
    )
    assert outcome.passed, outcome.stderr


@pytest.mark.slow
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


@pytest.mark.slow
def test_fork_bomb_is_contained_and_leaves_no_process():
    bomb = (
        "import os, time\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()  # try to leave the process group\n"
        "    except OSError:\n"
        "        time.sleep(0.01)\n"
    )
    limits = sandbox.Limits(wall_s=3.0, cpu_s=2)
    started = time.monotonic()
    outcome = sandbox.run_python(bomb, limits)
    assert not outcome.passed
    assert time.monotonic() - started < limits.wall_s + 5
    _machine_healthy(outcome)


def test_escaped_child_does_not_outlive_the_run():
    marker = f"{300 + (time.monotonic_ns() % 10**6) / 10**7:.7f}"  # a sleep length no other process has
    program = f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
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
            except TimeoutError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        program = (
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'exfiltrate')\n"
        )
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


# --- the fresh root: nothing of the host but the runtime ----------------------------------------------

needs_fresh_root = pytest.mark.skipif(
    not sandbox.isolation().fresh_root, reason=f"no fresh root here: {sandbox.isolation().describe()}"
)


@needs_fresh_root
def test_proc_shows_only_the_sandbox_processes():
    program = (
        "import os, subprocess, sys\n"
        "child = subprocess.Popen(['sleep', '30'])\n"
        "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "assert os.getpid() == 1 and pids == [1, child.pid], pids\n"
        f"assert not os.path.exists('/proc/{os.getpid()}')\n"  # the host's pid of this test
        "for pid in pids:\n"
        "    line = open('/proc/%d/cmdline' % pid, 'rb').read()\n"
        "    assert b'pytest' not in line, line\n"
        "child.kill()\n"
    )
    outcome = sandbox.run_python(program, ROOMY)
    assert outcome.passed, outcome.stderr
    _machine_healthy(outcome)


@pytest.fixture
def world_readable_data_dir(monkeypatch):
    """$SPECPILOT_DATA in a world-readable host directory that no sandbox tmpfs covers (/run)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="specpilot-data-", dir="/run" if os.access("/run", os.W_OK) else None))
    try:
        folder.chmod(0o755)
        (folder / "secret.txt").write_text("specpilot data")
        (folder / "secret.txt").chmod(0o644)
        monkeypatch.setenv("SPECPILOT_DATA", str(folder))
        yield folder
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


@needs_fresh_root
def test_host_files_are_not_reachable(world_readable_data_dir):
    from specpilot_build.locations import REPO_ROOT, data_dir, mirror_dir

    assert data_dir() == world_readable_data_dir.resolve()
    private = [REPO_ROOT / "README.md", REPO_ROOT, data_dir() / "secret.txt", data_dir()]
    if mirror_dir() is not None:
        private += [mirror_dir()]
    assert (REPO_ROOT / "README.md").is_file() and (data_dir() / "secret.txt").is_file()  # there for us
    program = (
        "import os\n"
        f"for path in {[str(p) for p in private]!r}:\n"
        "    assert not os.path.exists(path), path\n"
        "    try:\n"
        "        open(path).read()\n"
        "    except OSError:\n"
        "        continue\n"
        "    raise AssertionError('read ' + path)\n"
        "assert 'sandbox:x:' in open('/etc/passwd').read()  # the sandbox's own passwd, not the host's\n"
        "assert not os.path.exists('/root') and not os.path.exists('/home') and not os.path.exists('/work')\n"
    )
    outcome = sandbox.run_python(program, ROOMY)
    assert outcome.passed, outcome.stderr


@needs_fresh_root
def test_the_runtime_is_read_only_and_works():
    program = (
        "import os, subprocess, sys, json, decimal, sqlite3\n"
        "assert subprocess.run(['sleep', '0']).returncode == 0\n"
        "for path in (sys.prefix + '/lib/specpilot-escape', '/specpilot-escape', '/etc/specpilot-escape'):\n"
        "    try:\n"
        "        open(path, 'w')\n"
        "    except OSError:\n"
        "        continue\n"
        "    raise SystemExit('wrote ' + path)\n"
        "status = dict(line.split(':\\t', 1) for line in open('/proc/self/status').read().splitlines()"
        " if ':\\t' in line)\n"
        "assert int(status['CapEff'], 16) == int(status['CapBnd'], 16) == 0, status\n"
        "assert status['NoNewPrivs'].strip() == '1'\n"
    )
    outcome = sandbox.run_python(program, ROOMY)
    assert outcome.passed, outcome.stderr


def test_isolation_names_what_is_missing():
    iso = sandbox.isolation()
    description = iso.describe()
    if iso.fresh_root:
        assert "fresh root" in description and iso.runtime
    else:
        assert "host files visible" in description and iso.notes


# --- run_tested: the verdict comes from a process that never runs candidate code -----------------------


def _tested(
    candidate: str,
    call: str = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n",
    tests: str = "",
    remote: tuple[str, ...] = ("add",),
) -> sandbox.Outcome:
    return sandbox.run_tested(sandbox.Tested(candidate=candidate, tests=tests, call=call, remote=remote), ROOMY)


def test_tested_candidate_passes_only_on_right_answers():
    assert _tested("def add(a, b):\n    return a + b\n").passed
    wrong = _tested("def add(a, b):\n    return a - b\n")
    assert not wrong.passed and "AssertionError" in wrong.stderr
    missing = _tested("def plus(a, b):\n    return a + b\n")
    assert not missing.passed and "NameError" in missing.stderr
    broken = _tested("def add(a, b:\n")
    assert not broken.passed and "SyntaxError" in broken.stderr


@pytest.mark.parametrize(
    "candidate",
    [
        "import sys\nsys.exit(0)\n",
        "import os\nos._exit(0)\n",
        "exit()\n",
        "def add(a, b):\n    raise SystemExit(0)\n",
        "def add(a, b):\n    import os\n    os._exit(0)\n",
        "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    raise SystemExit(0)\n",
        "def add(a, b):\n    import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)\n",
        "import os\nprint('ok')\nos.close(1)\nos._exit(0)\n",
    ],
    ids=[
        "sys.exit",
        "os._exit",
        "exit()",
        "SystemExit-in-call",
        "os._exit-in-call",
        "atexit",
        "kill-self",
        "print-and-exit",
    ],
)
def test_exiting_early_with_status_zero_fails(candidate):
    outcome = _tested(candidate)
    assert not outcome.passed
    # (as its namespace's init, the candidate cannot even kill itself: add() then returns None)
    assert "the candidate" in outcome.stderr or "AssertionError" in outcome.stderr


def test_a_test_that_swallows_the_candidates_exit_still_fails():
    call = "for _ in range(3):\n    try:\n        add(1, 2)\n    except BaseException:\n        pass\n"
    assert _tested("def add(a, b):\n    return a + b\n", call=call).passed
    outcome = _tested("import sys\nsys.exit(0)\n", call=call)
    assert not outcome.passed and "exited before its tests finished" in outcome.stderr


def test_an_always_equal_answer_does_not_cross_the_boundary():
    candidate = (
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "    __ne__ = lambda self, other: False\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Anything()\n"
    )
    outcome = _tested(candidate)
    assert not outcome.passed and "AssertionError" in outcome.stderr


def test_values_exceptions_and_handles_cross_faithfully():
    candidate = (
        "import collections, decimal, fractions\n"
        "class Box:\n    def __init__(self, v):\n        self.v = v\n"
        "VALUES = [None, True, 2**5000 + 1, -7, 1.5, float('inf'), 1j, 'é\\ud800', b'\\x00', bytearray(b'x'),\n"
        "          [1, (2, 3)], {1: [2]}, {1, 2}, frozenset({3}), collections.Counter('aab'),\n"
        "          collections.OrderedDict(a=1), collections.deque([1], 3), fractions.Fraction(1, 3),\n"
        "          decimal.Decimal('1.10'), range(1, 9, 2)]\n"
        "def value(i):\n    return VALUES[i]\n"
        "def numbers():\n    return (n for n in range(3))\n"
        "def fail(kind):\n    raise {'value': ValueError, 'own': type('Own', (Exception,), {})}[kind]('no')\n"
        "def box(v):\n    return Box(v)\n"
        "def unbox(b):\n    return b.v\n"
    )
    call = (
        "import collections, decimal, fractions\n"
        "expected = [None, True, 2**5000 + 1, -7, 1.5, float('inf'), 1j, 'é\\ud800', b'\\x00', bytearray(b'x'),\n"
        "            [1, (2, 3)], {1: [2]}, {1, 2}, frozenset({3}), collections.Counter('aab'),\n"
        "            collections.OrderedDict(a=1), collections.deque([1], 3), fractions.Fraction(1, 3),\n"
        "            decimal.Decimal('1.10'), range(1, 9, 2)]\n"
        "for i, want in enumerate(expected):\n"
        "    got = value(i)\n"
        "    assert type(got) is type(want) and got == want, (i, got)\n"
        "assert list(numbers()) == [0, 1, 2]\n"
        "try:\n    fail('value')\nexcept ValueError as error:\n    assert str(error) == 'no'\nelse:\n    raise AssertionError\n"
        "try:\n    fail('own')\nexcept Exception as error:\n    assert 'Own: no' in str(error)\nelse:\n    raise AssertionError\n"
        "b = box([1, 2])\nassert b != box([1, 2]) and b == b and unbox(b) == [1, 2]\n"
    )
    outcome = _tested(candidate, call=call, remote=("value", "numbers", "fail", "box", "unbox"))
    assert outcome.passed, outcome.stderr + outcome.candidate.stderr


def test_malformed_replies_fail():
    junk = (
        "import os\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.write(fd, b'\\x00\\x00\\x00\\x05ready' + b'\\xff' * 64)\n"
        "    except OSError:\n"
        "        pass\n"
        "def add(a, b):\n    return a + b\n"
    )
    outcome = _tested(junk)
    assert not outcome.passed and "the candidate" in outcome.stderr


CANARY = "canary-" + "7f3a9c1e5b2d4086"  # assembled, so that this file's text alone does not carry it


def test_the_tests_never_enter_the_candidates_reach():
    """The candidate hunts for the expected answer everywhere it can look — its own file, code objects,
    frames, the gc, /proc (cmdlines, environments, fds, memory), the filesystem — and answers with it."""
    hunter = r"""
import gc, os, re, sys, types
OWN = "canary-0123456789abcdef"  # its own, which it must find: the hunt works
found = set()
def scan(blob):
    if isinstance(blob, str):
        blob = blob.encode("utf-8", "replace")
    found.update(m.decode() for m in re.findall(rb"canary-[0-9a-f]{16}", bytes(blob)))
def walk(obj, seen, depth=0):
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, (str, bytes, bytearray)):
        scan(obj)
    elif isinstance(obj, dict):
        for k, v in list(obj.items()):
            walk(k, seen, depth + 1); walk(v, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in list(obj):
            walk(v, seen, depth + 1)
    elif isinstance(obj, types.CodeType):
        walk(obj.co_consts, seen, depth + 1)
    elif isinstance(obj, types.FrameType):
        walk(obj.f_code, seen, depth + 1); walk(obj.f_locals, seen, depth + 1); walk(obj.f_globals, seen, depth + 1)
        walk(obj.f_back, seen, depth + 1)
    elif isinstance(obj, types.FunctionType):
        walk(obj.__code__, seen, depth + 1); walk(obj.__globals__, seen, depth + 1)
    elif isinstance(obj, types.ModuleType):
        walk(vars(obj), seen, depth + 1)
seen = set()
walk(sys._getframe(), seen)
for obj in gc.get_objects():
    walk(obj, seen)
walk(sys.modules, seen)
scan(open(__file__, "rb").read())
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    for name in ("cmdline", "environ"):
        try:
            scan(open("/proc/%s/%s" % (pid, name), "rb").read())
        except OSError:
            pass
    try:
        with open("/proc/%s/maps" % pid) as maps, open("/proc/%s/mem" % pid, "rb", 0) as mem:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if "r" in line.split()[1] and hi - lo < 1 << 26:
                    try:
                        mem.seek(lo); scan(mem.read(hi - lo))
                    except (OSError, ValueError, OverflowError):
                        pass
    except OSError:
        pass
for root in ("/tmp", "/var/tmp", "/dev/shm", "/run", "/etc", "/proc/self/fd"):
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                with open(os.path.join(folder, name), "rb") as handle:
                    scan(handle.read(1 << 20))
            except OSError:
                pass
sys.stderr.write("found: %r\n" % sorted(found))
def answer():
    return sorted(found)[0] if found else "nothing"
"""
    outcome = _tested(hunter, call=f"assert answer() == {CANARY!r}\n", remote=("answer",))
    assert "found: ['canary-0123456789abcdef']" in outcome.candidate.stderr, outcome.candidate.stderr
    assert not outcome.passed and "AssertionError" in outcome.stderr


@pytest.mark.slow
def test_tested_runs_leave_nothing_behind():
    program = (
        "import subprocess\n"
        "subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "def add(a, b):\n    while True:\n        pass\n"
    )
    outcome = sandbox.run_tested(
        sandbox.Tested(program, "", "assert add(1, 2) == 3\n", ("add",)), sandbox.Limits(wall_s=10.0, cpu_s=1)
    )
    assert not outcome.passed
    _machine_healthy(outcome)
    _machine_healthy(outcome.candidate)


def test_without_namespaces_it_degrades_and_says_so(monkeypatch):
    """Where unshare may create nothing: no fresh root, said in describe(); verdicts stay right."""
    monkeypatch.setattr(sandbox, "_unshare_works", lambda flags: False)
    sandbox.isolation.cache_clear()
    try:
        iso = sandbox.isolation()
        assert iso.namespace_flags == () and not iso.fresh_root and not iso.private_tmp
        description = iso.describe()
        assert "process group only" in description and "host files visible" in description
        assert "unshare may create no namespace here" in description
        assert _tested("def add(a, b):\n    return a + b\n").passed
        assert not _tested("def add(a, b):\n    return a - b\n").passed
        assert not _tested("import os\nos._exit(0)\n").passed
    finally:
        sandbox.isolation.cache_clear()

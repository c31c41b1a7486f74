"""Run untrusted Python (generated code and its tests) in a contained child process.

Containment, the strongest the OS allows (probed once per process by trying it; `isolation()` reports it):
- its own session / process group, and its own PID namespace when `unshare` may create one: the wall
  timeout kills the group, and ending the namespace's first process ends every process inside it, even
  one that called setsid();
- rlimits: CPU seconds, address space, file size, number of processes, open files, no core dumps;
- a minimal environment; cwd = HOME = TMPDIR = a fresh temporary directory;
- no network: a new network namespace (only a loopback that is down) when `unshare --net` is permitted (as
  root, or unprivileged inside a user namespace, `unshare -r`); otherwise only a Python-level socket
  guard, which a determined program can get around (ctypes, subprocesses);
- a private mount namespace (same conditions) whose /tmp, /var/tmp, /dev/shm and /run/lock are fresh,
  small tmpfs; the program's working directory is that /tmp;
- as root, with an interpreter that other users can reach: the program runs under a fresh unused uid/gid
  with no supplementary groups, so it can write nowhere but those tmpfs and cannot undo any of the above;
  the fresh uid also makes RLIMIT_NPROC count only this run's processes (the limit does not bind root),
  and after the run every process of that uid is killed, namespace or not.
  Unprivileged, the program keeps our uid: it could write where we can outside the tmpfs (e.g. $HOME).

One interpreter per run: the launcher sets all this up, then executes the program as __main__. The exit
status decides: 0 passes; anything else, a signal, or the wall timeout fails.
"""
from __future__ import annotations

import itertools
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 10  # what stops busy programs
    wall_s: float = 60.0  # what stops blocked ones; roomy, so that a loaded machine fails no slow, correct one
    memory_bytes: int = 512 * 2**20  # address space; a process per run limit keeps the total bounded
    file_bytes: int = 16 * 2**20
    processes: int = 16
    open_files: int = 64
    tmpfs_bytes: int = 64 * 2**20


@dataclass(frozen=True)
class Outcome:
    passed: bool
    returncode: int | None  # None when killed by the wall timeout
    timed_out: bool
    stdout: str  # tails, for diagnosis
    stderr: str
    uid: int | None  # the uid the program ran under when privileges were dropped (None: our own)
    pgid: int  # the process group it ran in (for checking nothing is left)


@dataclass(frozen=True)
class Isolation:
    namespace_flags: tuple[str, ...]  # passed to unshare; empty when no namespace could be created
    network: str  # "namespace" or "python-guard"
    private_tmp: bool  # a mount namespace with fresh tmpfs on /tmp, /var/tmp, /dev/shm, /run/lock
    drop_uid: bool
    python: str  # interpreter that runs the program

    def describe(self) -> str:
        parts = [f"network: {self.network}",
                 "pid namespace" if "--pid" in self.namespace_flags else "process group only",
                 "private tmpfs" if self.private_tmp else "temporary directory",
                 "unused uid" if self.drop_uid else "own uid"]
        return ", ".join(parts)


def run_python(program: str, limits: Limits = Limits()) -> Outcome:
    """Run one Python program under the sandbox; pass means exit status 0 within the limits."""
    iso = isolation()
    uid = _fresh_uid() if iso.drop_uid else None
    scratch = Path(tempfile.mkdtemp(prefix="specpilot-sandbox-"))
    workdir = scratch / "work"  # the program's; its captured output stays outside it
    workdir.mkdir()
    try:
        (workdir / "program.py").write_text(program)
        process_limit = limits.processes
        if uid is None:  # RLIMIT_NPROC counts every process of our uid, not only this run's
            process_limit += _processes_of(os.getuid())
        settings = [-1 if uid is None else uid, int(iso.private_tmp), int(iso.network != "namespace"),
                    limits.cpu_s, limits.memory_bytes, limits.file_bytes, process_limit, limits.open_files,
                    limits.tmpfs_bytes]
        argv = ["unshare", *iso.namespace_flags, "--"] if iso.namespace_flags else []
        # -S: no site import (it costs as much as the rest of the start-up); the standard library is there
        argv += [iso.python, "-I", "-S", "-c", _LAUNCHER, *map(str, settings)]
        with open(scratch / "stdout", "wb+") as out, open(scratch / "stderr", "wb+") as err:
            proc = subprocess.Popen(argv, cwd=workdir, env=_environment(workdir), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True, close_fds=True)
            try:
                returncode = proc.wait(timeout=limits.wall_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                returncode, timed_out = None, True
            _kill_group(proc, via_unshare=bool(iso.namespace_flags))
            if uid is not None:  # a backstop where no PID namespace holds the run's processes together
                _kill_uid(uid)
            stdout, stderr = _tail(out), _tail(err)
        return Outcome(passed=returncode == 0, returncode=returncode, timed_out=timed_out,
                       stdout=stdout, stderr=stderr, uid=uid, pgid=proc.pid)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_many(programs: list[str], limits: Limits = Limits(), workers: int | None = None) -> list[Outcome]:
    """Run programs in parallel, results in input order.

    Default: two per CPU core (at most 8): a run spends much of its time starting up and in the kernel."""
    workers = workers or max(1, min(8, 2 * (os.cpu_count() or 1)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda program: run_python(program, limits), programs))


@lru_cache(maxsize=1)
def isolation() -> Isolation:
    """What this machine lets the sandbox do, found by trying it."""
    root = os.geteuid() == 0
    python = _sandbox_python(world_readable=root)
    drop_uid = root and python is not None
    python = python or sys.executable
    candidates = ([["--net", "--pid", "--fork", "--kill-child", "--mount"]] if root else []) + [
        ["--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount"],
        ["--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"],
        ["--pid", "--fork", "--kill-child"],
    ]
    if shutil.which("unshare"):
        for flags in candidates:
            if _unshare_works(flags):
                network = "namespace" if "--net" in flags else "python-guard"
                private_tmp = "--mount" in flags
                return Isolation(tuple(flags), network, private_tmp, drop_uid, python)
    return Isolation((), "python-guard", False, drop_uid, python)


def _unshare_works(flags: list[str]) -> bool:
    try:
        done = subprocess.run(["unshare", *flags, "--", "true"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _sandbox_python(world_readable: bool) -> str | None:
    """An interpreter the program can run with; when dropping to an unused uid, one that uid can reach.

    (A virtualenv under a private home, e.g. /root/..., is unreachable for it; a system python is.)"""
    candidates = [sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]
    for candidate in candidates:
        if not os.path.isfile(candidate):
            continue
        if not world_readable or _reachable_by_others(candidate):
            return candidate
    return None


def _reachable_by_others(path: str) -> bool:
    real = Path(os.path.realpath(path))
    for parent in real.parents:
        if not parent.stat().st_mode & stat.S_IXOTH:
            return False
    mode = real.stat().st_mode
    return bool(mode & stat.S_IXOTH and mode & stat.S_IROTH)


_uid_counter = itertools.count()
_uid_lock = threading.Lock()
_UID_BASE = 1_500_000_000  # far above any account; a random offset per process, a counter per run


def _fresh_uid() -> int:
    with _uid_lock:
        offset = next(_uid_counter)
    return _UID_BASE + (_PROCESS_UID_OFFSET + offset) % 500_000_000


_PROCESS_UID_OFFSET = secrets.randbelow(500_000_000)


def _environment(workdir: Path) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir),
            "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


def _kill_group(proc: subprocess.Popen, via_unshare: bool) -> None:
    # Kill the namespace's first process before `unshare` itself, so that unshare lives to reap it (a
    # killed unshare would leave it a zombie for init); its death ends the whole PID namespace.
    if via_unshare and proc.poll() is None:
        for child in _children(proc.pid):
            _signal(child, signal.SIGKILL)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _children(pid: int) -> list[int]:
    children = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat_line = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            if int(stat_line.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return children


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of a run's private uid, until none is left (its NPROC limit bounds a race)."""
    for _ in range(100):
        pids = _pids_of(uid)
        if not pids:
            return
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        time.sleep(0.01)


def _processes_of(uid: int) -> int:
    return len(_pids_of(uid))


def _pids_of(uid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(handle, size: int = 4000) -> str:
    handle.seek(0, os.SEEK_END)
    handle.seek(max(0, handle.tell() - size))
    return handle.read().decode("utf-8", "replace")


# Runs inside the namespaces, as the first process there (still privileged when we are root): sets the
# limits, mounts the private tmpfs, drops to the run's uid, then runs the program.
_LAUNCHER = r"""
import os, resource, sys
uid, private_tmp, socket_guard, cpu_s, memory, file_size, processes, open_files, tmpfs_size = map(int, sys.argv[1:])
program = open("program.py").read()
for name, value in (("RLIMIT_CPU", cpu_s), ("RLIMIT_AS", memory), ("RLIMIT_FSIZE", file_size),
                    ("RLIMIT_NPROC", processes), ("RLIMIT_NOFILE", open_files), ("RLIMIT_CORE", 0)):
    resource.setrlimit(getattr(resource, name), (value, value))
if private_tmp:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 16384, 262144
    def mount(source, target, fstype, flags, data):
        if libc.mount(source, target, fstype, flags, data) != 0:
            raise OSError(ctypes.get_errno(), "mount " + target.decode())
    mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    for target in (b"/tmp", b"/var/tmp", b"/dev/shm", b"/run/lock"):
        if os.path.isdir(target):
            mount(b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=%d,mode=1777" % tmpfs_size)
    os.chdir("/tmp")
    with open("program.py", "w") as handle:
        handle.write(program)
    os.environ.update(HOME="/tmp", TMPDIR="/tmp")
if uid >= 0:
    os.chown(".", uid, uid)
    os.chown("program.py", uid, uid)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
if socket_guard:
    import socket
    def no_network(*args, **kwargs):
        raise OSError("network is disabled in the sandbox")
    for name in ("connect", "connect_ex", "bind", "sendto", "sendmsg"):
        setattr(socket.socket, name, no_network)
# The program runs in this interpreter (one start-up per run, not two), as __main__, as the run's uid;
# exit() and quit() are what it would miss from the skipped site import.
import builtins, _sitebuiltins
builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
sys.argv[:] = ["program.py"]
namespace = {"__name__": "__main__", "__file__": os.path.abspath("program.py"), "__builtins__": builtins}
code = compile(program, "program.py", "exec")
del program, resource, uid, private_tmp, socket_guard, cpu_s, memory, file_size, processes, open_files
exec(code, namespace)
"""

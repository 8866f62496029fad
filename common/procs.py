"""Starting and stopping the processes FedForge is made of (SuperLink, SuperNodes, agents).

Every child runs in its own session so that stopping it also stops whatever it spawned (a
SuperNode's ClientApp processes, a SuperLink's ServerApp). `ProcessSet` stops all of its children
on exit, on exceptions and on SIGINT/SIGTERM, so no process outlives the command that started it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

log = logging.getLogger(__name__)


SUPEREXEC_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"  # Flower's SuperExec: seconds between asks for a new task


def supernode_env() -> dict[str, str]:
    """Environment for a SuperNode: no telemetry, and its SuperExec asks for new messages every 0.1 s.

    Flower's default (1 s) adds half a second on average to every message a factory handles, and a
    secure round handles two; an operator's own FLWR_SUPEREXEC_TASK_POLL_INTERVAL is kept.
    """
    return {"FLWR_TELEMETRY_ENABLED": "0", SUPEREXEC_POLL_ENV: os.environ.get(SUPEREXEC_POLL_ENV, "0.1")}


def supernode_command() -> list[str]:
    """Flower's SuperNode as FedForge runs it: `client.supernode` (Flower's entry point with a shorter idle poll)."""
    return [sys.executable, "-m", "client.supernode"]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to SIGTERM this child when its parent dies, even by SIGKILL (no orphans)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port(host: str = "127.0.0.1") -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Block until something accepts TCP connections on host:port (or raise naming the address)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args[0] if isinstance(proc.args, list) else proc.args} exited with {proc.returncode} before listening on {host}:{port}")
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout:.0f}s")


def detached_descendants(pid: int) -> list[int]:
    """Processes Flower started for ``pid`` in sessions of their own, found by the ``--parent-pid`` they carry.

    A SuperLink starts its SuperExec detached (``start_new_session``), and the SuperExec starts each
    ServerApp the same way; they only watch their parent's pid and stop by themselves some time after it
    died. Killing the parent's process group misses them, so they are looked up here, recursively.
    """
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "--parent-pid" in argv[:-1]:
            with contextlib.suppress(ValueError):
                parents[int(entry.name)] = int(argv[argv.index("--parent-pid") + 1])
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [child for child, parent in parents.items() if parent == current and child not in found]
        found += children
        frontier += children
    return found


def _stop_detached(pids: list[int], timeout: float = 5.0) -> None:
    for pid in pids:
        _kill_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):  # never signal a pid that has exited (it may be reused)
            _kill_group(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def process_identity(pid: int | None = None) -> dict[str, object]:
    """This host, a pid and the kernel's start time of that pid: together they name one process, even after the pid is reused."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "start": _start_ticks(pid)}


def process_gone(identity: dict[str, object] | None) -> bool:
    """Whether the process ``identity`` names has ended; False when it ran on another host (nothing to tell here)."""
    if not identity or identity.get("host") != socket.gethostname() or not isinstance(identity.get("pid"), int):
        return False
    pid = int(identity["pid"])  # type: ignore[arg-type]
    return not _alive(pid) or _start_ticks(pid) != identity.get("start")


def _start_ticks(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
    except (OSError, IndexError, ValueError):
        return None


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the process's group, then SIGKILL it if it has not exited within ``timeout``; then whatever Flower
    detached from it (`detached_descendants`)."""
    detached = detached_descendants(proc.pid)
    try:
        _stop_group(proc, timeout)
    finally:
        _stop_detached(detached + [p for p in detached_descendants(proc.pid) if p not in detached])


def _stop_group(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is not None:
        _kill_group(proc.pid, signal.SIGKILL)  # reap grandchildren the child left behind
        return
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("pid %d did not stop within %.0fs; killing it", proc.pid, timeout)
    _kill_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class ProcessSet:
    """Children started through `start`, all stopped (in reverse order) by `stop_all`."""

    def __init__(self, log_dir: Path | None = None) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._old_handlers: dict[int, object] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen:
        stdout = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            stdout = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        log.debug("starting %s: %s", name, " ".join(cmd))
        proc = subprocess.Popen(
            cmd, stdout=stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True,
            # preexec_fn runs between fork and exec; it only calls prctl (no locks, no Python-level threads touched)
            preexec_fn=_die_with_parent if os.name == "posix" else None,  # noqa: PLW1509
        )
        if stdout is not subprocess.DEVNULL:
            stdout.close()
        self.procs.append((name, proc))
        return proc

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM every child's process group at once, give them ``timeout`` seconds together, then SIGKILL what is left
        (what Flower detached from them included)."""
        detached = [pid for _, proc in self.procs for pid in detached_descendants(proc.pid)]
        for name, proc in reversed(self.procs):
            log.debug("stopping %s (pid %d)", name, proc.pid)
            _kill_group(proc.pid, signal.SIGTERM if proc.poll() is None else signal.SIGKILL)
        deadline = time.monotonic() + timeout
        for _, proc in reversed(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for _, proc in reversed(self.procs):
            _stop_group(proc, timeout=0.0)  # reap, and SIGKILL the group of anything still running
        _stop_detached(detached)
        self.procs.clear()

    def dead(self) -> list[tuple[str, int]]:
        return [(name, proc.returncode) for name, proc in self.procs if proc.poll() is not None]

    def __enter__(self) -> Self:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop_all()
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]

    def _on_signal(self, signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"received signal {signum}")


def keep_running(procs: ProcessSet, name: str, cmd: list[str] | Callable[[], list[str]], what: str, env: dict[str, str] | None = None, cwd: Path | None = None,
                 on_start: Callable[[subprocess.Popen], None] | None = None, max_delay: float = 30.0, stable_seconds: float = 60.0,
                 stop: threading.Event | None = None) -> None:
    """Run ``cmd`` as child ``name`` of ``procs`` and restart it whenever it exits, until interrupted (KeyboardInterrupt).

    The delay before a restart doubles (2, 4, ... ``max_delay`` s) while the process keeps dying young and
    starts again at 2 s after a run of ``stable_seconds``. What the dead process left behind (a SuperLink's
    ServerApp, a SuperNode's ClientApps) is stopped with it. ``fedforge server`` keeps its SuperLink
    alive this way, ``fedforge client`` its SuperNode. With ``stop`` (run from a thread), it returns once
    ``stop`` is set and the process has exited. A callable ``cmd`` is called before every start (a SuperNode given
    ``--supernode-port 0`` gets a port that is free at that moment, each time).
    """
    restarts = failures = 0
    while stop is None or not stop.is_set():
        proc = procs.start(name, cmd() if callable(cmd) else cmd, env=env, cwd=cwd)
        started = time.monotonic()
        if on_start is not None:
            on_start(proc)
        while proc.poll() is None:
            time.sleep(0.5)
        if stop is not None and stop.is_set():
            return
        restarts += 1
        failures = 0 if time.monotonic() - started > stable_seconds else failures + 1
        delay = min(max_delay, 2.0**failures)
        log.warning("%s exited with %s; restart %d in %.0fs", what, proc.returncode, restarts, delay)
        procs.procs.remove((name, proc))
        stop_process(proc)
        time.sleep(delay)

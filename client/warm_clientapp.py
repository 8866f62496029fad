"""A warm fork server for the ``flwr-clientapp`` process Flower starts for every message.

Flower 1.42's SuperNode runs each message's ClientApp in a fresh ``flwr-clientapp`` process. Before
that process can even ask for its message it imports Flower (which pulls in FastAPI through its error
catalogue), gRPC, protobuf, numpy and ``cryptography``: 1.2-1.5 s of CPU per message per factory, more
than half of a plain round with the pretrained head, and paid twice in a secure round (train, unmask).

This module keeps one process per SuperNode with those modules imported and nothing else running (no
threads, no sockets but its listener), and forks it once per message: the child runs Flower's own
``flwr_clientapp`` function with the arguments, environment, working directory and standard streams of
the ``flwr-clientapp`` launcher that Flower's SuperExec started. The launcher (stdlib only, started
with ``python -IS``, a few tens of ms) forwards termination signals to the child and exits with the
child's status, so Flower sees the same process contract as before. FedForge's own code is not
kept loaded (the server drops the few small modules it starts with): the child imports the ClientApp
from the FAB Flower installs, exactly as a fresh process would, so an updated FAB takes effect on the
next message.

Why forking is safe here: the server is single-threaded and has created no gRPC channel, so the
child inherits no lock held by another thread; keys and masks come from ``os.urandom``/``secrets``/
OpenSSL, which are not affected by fork (Python's ``random`` reseeds itself in the child); the
listener lives in a 0700 directory owned by the SuperNode's user, who could start the ClientApp
anyway. If the server is gone, not yet listening, or refuses, the launcher starts a fresh process
as before (the direct launcher in ``client/supernode.py``); the server exits when the SuperNode does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("fedforge.warm-clientapp")

SOCKET_ENV = "FEDFORGE_CLIENTAPP_SOCKET"
OWN_PACKAGES = ("client", "common", "server")  # FedForge's top-level packages: what a FAB ships
MAX_REQUEST_BYTES = 4 << 20  # argv + environment; a real one is a few KiB
REQUEST_TIMEOUT_S = 5.0
STOP_GRACE_SECONDS = 30.0  # after a SIGTERM, how long the server waits for its SuperNode to exit before leaving without clean-up
# What every ClientApp process imports before FedForge's own modules (measured with -X importtime).
PRELOAD = (
    "flwr.supernode.runtime.run_clientapp",
    "flwr.app",
    "flwr.clientapp",
    "grpc",
    "numpy",
    "google.protobuf.struct_pb2",
    "cryptography.hazmat.primitives.asymmetric.x25519",
    "cryptography.hazmat.primitives.ciphers.aead",
    "cryptography.hazmat.primitives.kdf.hkdf",
)

LAUNCHER = """#!{python} -IS
# flwr-clientapp for a FedForge SuperNode (written by client/warm_clientapp.py): asks the warm fork
# server to run this message's ClientApp; starts a fresh process (the direct launcher) if it cannot.
import json, os, signal, socket, struct, sys

DIRECT = {direct!r}


def direct():
    os.execv(sys.executable, [sys.executable, DIRECT] + sys.argv[1:])


def read_int(sock):
    data = b""
    while len(data) < 4:
        chunk = sock.recv(4 - len(data))
        if not chunk:
            return None
        data += chunk
    return struct.unpack("!i", data)[0]


for fd in (0, 1, 2):
    try:
        os.fstat(fd)
    except OSError:
        os.dup2(os.open(os.devnull, os.O_RDWR), fd)
try:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ[{env!r}])
    request = json.dumps({{"argv": ["flwr-clientapp"] + sys.argv[1:], "env": dict(os.environ),
                          "cwd": os.getcwd()}}).encode()
    socket.send_fds(sock, [struct.pack("!I", len(request))], [0, 1, 2])
    sock.sendall(request)
    pid = read_int(sock)
except (OSError, KeyError):
    pid = None
if pid is None:  # nothing was started
    direct()
for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(signum, lambda signum, frame: os.kill(pid, signum))
status = read_int(sock)  # a forwarded signal interrupts the wait; Python resumes it (PEP 475)
sys.exit(1 if status is None else status)
"""


def write_launcher(directory: Path, direct_launcher: Path) -> Path:
    """Write the ``flwr-clientapp`` launcher that goes through the fork server (``direct_launcher`` if it cannot)."""
    launcher = directory / "flwr-clientapp"
    launcher.write_text(LAUNCHER.format(python=sys.executable, direct=str(direct_launcher), env=SOCKET_ENV))
    launcher.chmod(0o755)
    return launcher


def preload() -> Callable[[], object]:
    """Import what a ClientApp process needs before FedForge's code; returns Flower's ``flwr_clientapp``."""
    import importlib

    from client.fab_cache import verify_fabs_once
    from client.supernode import flwr_clientapp_entry
    from common.flower_waits import shorten_object_pull_backoff

    entry = flwr_clientapp_entry()
    shorten_object_pull_backoff()
    verify_fabs_once()
    for name in PRELOAD:
        importlib.import_module(name)
    return entry


def serve(path: Path, parent_pid: int, entry: Callable[[], object] | None = None, remove_on_exit: Path | None = None) -> None:
    """Fork one child per launcher connection until the SuperNode (``parent_pid``) is gone, then delete
    ``remove_on_exit`` (the SuperNode's launcher directory, which holds the socket).

    Each child calls ``entry`` (Flower's ``flwr_clientapp`` after `preload`) with the launcher's argv. Why the server
    deletes the SuperNode's directory: a SuperNode that is killed (SIGKILL, the OOM killer) runs no exit handler, and
    its launchers would be left in the temporary directory, one directory per start. A SIGTERM (stopping a SuperNode
    signals its whole process group) therefore does not end the server at once: it stops taking launches (launchers
    fall back to a fresh process) and waits up to ``STOP_GRACE_SECONDS`` for the SuperNode to go, which may be by a
    later SIGKILL or Flower's forced exit, neither of which runs the SuperNode's own clean-up."""
    entry = entry or preload()
    _forget_own_packages()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel; their launchers report
    stop_requested: list[float] = []
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop_requested.append(time.monotonic()))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener.bind(str(path))
    path.chmod(0o600)
    listener.listen(64)
    log.info("warm ClientApp server ready on %s", path)
    while os.getppid() == parent_pid:
        if stop_requested:
            if listener.fileno() != -1:
                listener.close()
                log.info("warm ClientApp server stopping: waiting for its SuperNode to exit")
            if time.monotonic() - stop_requested[0] > STOP_GRACE_SECONDS:
                return  # the SuperNode outlived its SIGTERM: it still uses the directory
            time.sleep(0.1)
            continue
        readable, _, _ = select.select([listener], [], [], 1.0)
        if not readable:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError) as exc:  # the launcher then starts a fresh process itself
            log.warning("refused a ClientApp launch request: %s", exc)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        child = os.fork()
        if child == 0:
            listener.close()
            _run_child(conn, request, fds, entry)
        log.info("ClientApp forked (pid %d)", child)
        conn.close()
        for fd in fds:
            os.close(fd)
    listener.close()
    if remove_on_exit is not None:
        shutil.rmtree(remove_on_exit, ignore_errors=True)


def _forget_own_packages() -> None:
    """Drop FedForge's packages (imported to start this server) from ``sys.modules``: each child then imports the
    ClientApp from the run's FAB, which Flower puts first on ``sys.path``, as a fresh process would, and not from
    the copy installed beside the SuperNode."""
    for name in [m for m in sys.modules if m.split(".")[0] in OWN_PACKAGES]:
        del sys.modules[name]


def _receive(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    """The launcher's request (argv, env, cwd) and its three standard streams; ValueError if malformed."""
    conn.settimeout(REQUEST_TIMEOUT_S)
    header, fds, _, _ = socket.recv_fds(conn, 4, 3)
    try:
        if len(header) != 4 or len(fds) != 3:
            raise ValueError(f"malformed request header ({len(header)} bytes, {len(fds)} descriptors)")
        size = struct.unpack("!I", header)[0]
        if size > MAX_REQUEST_BYTES:
            raise ValueError(f"request of {size} bytes is over the {MAX_REQUEST_BYTES}-byte limit")
        body = bytearray()
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise ValueError("launcher closed the connection mid-request")
            body += chunk
        request = json.loads(body)
        if not (isinstance(request, dict) and isinstance(request.get("argv"), list) and isinstance(request.get("env"), dict)
                and isinstance(request.get("cwd"), str)):
            raise ValueError("request lacks argv, env or cwd")  # noqa: TRY004 - the caller refuses any malformed request alike
    except (OSError, ValueError):
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return request, fds


def _run_child(conn: socket.socket, request: dict[str, object], fds: list[int], entry: Callable[[], object]) -> None:
    """Become the launcher's ClientApp process; never returns."""
    status = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(str(request["cwd"]))
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in dict(request["env"]).items()})  # type: ignore[call-overload]
        sys.argv = [str(a) for a in request["argv"]]  # type: ignore[attr-defined]
        conn.sendall(struct.pack("!i", os.getpid()))
        threading.Thread(target=_stop_with_launcher, args=(conn,), daemon=True).start()
        try:
            entry()
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - report whatever happened, then exit with a failure status
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        with contextlib.suppress(OSError):
            conn.sendall(struct.pack("!i", status))
        os._exit(status)


def _stop_with_launcher(conn: socket.socket) -> None:
    """The launcher closing its end (it was killed) stops the ClientApp as Flower would stop it: SIGTERM."""
    with contextlib.suppress(OSError):
        while conn.recv(1):
            pass
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    parser = argparse.ArgumentParser(description="FedForge's warm fork server for flwr-clientapp processes.")
    parser.add_argument("--socket", required=True, type=Path, help="Unix socket path to listen on.")
    parser.add_argument("--parent-pid", required=True, type=int, help="Exit when this process (the SuperNode) exits.")
    parser.add_argument("--remove-on-exit", type=Path, help="Directory to delete on exit (the SuperNode's launchers).")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(args.socket, args.parent_pid, remove_on_exit=args.remove_on_exit)


if __name__ == "__main__":
    main()

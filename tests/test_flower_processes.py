"""How FedForge runs Flower's processes: the warm fork server behind the SuperNode's ``flwr-clientapp``
launcher (client/warm_clientapp.py), Flower's shortened waits, and how the supervisor tells a dead
ServerApp from a live one.

Fork server tests use real processes throughout: the server runs in its own process, the launcher is the very script the
SuperNode puts on PATH, started the way Flower's SuperExec starts it. The server runs a small entry
function instead of Flower's (the end-to-end tests run Flower's through it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from client import warm_clientapp
from common.procs import _alive

ROOT = Path(__file__).resolve().parents[1]

# The ClientApp stand-in: reports what it was started with, optionally waits, exits with a chosen status.
SERVER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from client.warm_clientapp import serve

    def entry():
        args = sys.argv[1:]
        own = sorted(m for m in sys.modules if m.split(".")[0] in ("client", "common", "server"))
        print(json.dumps({{"argv": sys.argv, "cwd": os.getcwd(), "marker": os.environ.get("MARKER"), "pid": os.getpid(), "own": own}}),
              flush=True)
        if "--sleep" in args:
            time.sleep(60)
        if "--raise" in args:
            raise RuntimeError("the ClientApp failed")
        sys.exit(int(args[args.index("--exit") + 1]) if "--exit" in args else 0)

    serve(Path({socket!r}), int({parent}), entry=entry, remove_on_exit=Path({socket!r}).parent / "launchers")
""")


def _wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def warm(tmp_path):
    """A running fork server and the launcher that talks to it (plus the direct launcher it falls back to)."""
    socket_path = tmp_path / "warm.sock"
    direct = tmp_path / "flwr-clientapp-direct"
    direct.write_text(f"#!{sys.executable}\nimport sys\nprint('direct', sys.argv[1:])\nsys.exit(7)\n")
    direct.chmod(0o755)
    launcher = warm_clientapp.write_launcher(tmp_path, direct)
    server = subprocess.Popen([sys.executable, "-c", SERVER.format(root=str(ROOT), socket=str(socket_path), parent=os.getpid())])
    _wait_for(socket_path.exists, "the fork server's socket")
    env = {**os.environ, warm_clientapp.SOCKET_ENV: str(socket_path), "MARKER": "from-the-launcher"}
    yield launcher, env, server
    server.kill()
    server.wait()


def _launch(launcher: Path, env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(launcher), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def test_the_child_gets_the_launchers_arguments_environment_directory_streams_and_reports_its_status(warm, tmp_path):
    launcher, env, server = warm
    workdir = tmp_path / "work"
    workdir.mkdir()
    done = _launch(launcher, env, "--token", "abc", "--exit", "3", cwd=workdir)
    assert done.returncode == 3, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["argv"] == ["flwr-clientapp", "--token", "abc", "--exit", "3"]
    assert seen["cwd"] == str(workdir) and seen["marker"] == "from-the-launcher"
    assert seen["pid"] not in (server.pid, os.getpid())  # a forked child, not the server itself
    assert seen["own"] == []  # FedForge's code comes from the run's FAB, not from what started the server
    ok = _launch(launcher, env, "--token", "def", cwd=workdir)
    assert ok.returncode == 0 and json.loads(ok.stdout)["pid"] != seen["pid"]  # one fresh child per message
    failed = _launch(launcher, env, "--raise", cwd=workdir)
    assert failed.returncode == 1 and "the ClientApp failed" in failed.stderr


def test_terminating_the_launcher_terminates_its_clientapp(warm, tmp_path):
    launcher, env, _ = warm
    proc = subprocess.Popen([str(launcher), "--sleep"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    child = json.loads(proc.stdout.readline())["pid"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) != 0
    _wait_for(lambda: not _alive(child), "the ClientApp to stop")


def test_a_killed_launcher_takes_its_clientapp_with_it(warm, tmp_path):
    launcher, env, _ = warm
    proc = subprocess.Popen([str(launcher), "--sleep"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    child = json.loads(proc.stdout.readline())["pid"]
    proc.kill()
    proc.wait()
    _wait_for(lambda: not _alive(child), "the orphaned ClientApp to stop")


def test_without_a_server_the_launcher_starts_a_fresh_process(warm, tmp_path):
    launcher, env, server = warm
    server.kill()
    server.wait()
    done = _launch(launcher, {**env, warm_clientapp.SOCKET_ENV: str(tmp_path / "absent.sock")}, "--token", "x", cwd=tmp_path)
    assert done.returncode == 7 and "direct ['--token', 'x']" in done.stdout


def test_a_malformed_request_is_refused_and_the_server_keeps_serving(warm, tmp_path):

    launcher, env, server = warm
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(env[warm_clientapp.SOCKET_ENV])
        sock.sendall(b"not a request")  # no descriptors, no length-prefixed JSON
        try:
            answer = sock.recv(4)
        except ConnectionResetError:  # closed with our bytes unread
            answer = b""
        assert answer == b""  # no child pid: nothing was started
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # the right framing, a body that is not a request
        sock.connect(env[warm_clientapp.SOCKET_ENV])
        body = json.dumps(["flwr-clientapp"]).encode()
        socket.send_fds(sock, [len(body).to_bytes(4, "big")], [0, 1, 2])
        sock.sendall(body)
        assert sock.recv(4) == b""
    done = _launch(launcher, env, "--exit", "0", cwd=tmp_path)
    assert done.returncode == 0 and server.poll() is None


def test_the_server_exits_with_its_supernode_and_deletes_its_launchers_even_when_it_was_killed(tmp_path):
    socket_path = tmp_path / "warm.sock"
    (tmp_path / "launchers").mkdir()
    (tmp_path / "launchers" / "flwr-clientapp").write_text("#!/bin/sh\n")
    parent, server_pid = _supernode_with_server(socket_path)
    parent.kill()
    parent.wait()
    _wait_for(lambda: not _alive(server_pid), "the fork server to exit after its SuperNode")
    assert not (tmp_path / "launchers").exists()  # a SIGKILLed SuperNode runs no atexit handler; the server cleans up


def _supernode_with_server(socket_path: Path, ignore_sigterm: bool = False, **popen) -> tuple[subprocess.Popen, int]:
    """A stand-in SuperNode that starts the fork server (``SERVER``) as its child; returns it and the server's pid once
    the server listens. ``ignore_sigterm``: a SuperNode still busy with its exit handlers after a SIGTERM."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, subprocess, sys, time
        if {ignore_sigterm!r}:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        code = {SERVER!r}.format(root={str(ROOT)!r}, socket={str(socket_path)!r}, parent=os.getpid())
        server = subprocess.Popen([sys.executable, "-c", code])
        print(server.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, **popen)
    server_pid = int(parent.stdout.readline())
    _wait_for(socket_path.exists, "the fork server's socket")
    return parent, server_pid


def test_a_sigtermed_server_stops_taking_launches_and_still_deletes_the_launchers_of_a_supernode_killed_after_it(tmp_path):
    """Stopping a SuperNode SIGTERMs its process group, the fork server too; the SuperNode may then end by Flower's forced
    exit or a SIGKILL, which run no atexit handler. The server outlives its SIGTERM until then, taking no launches."""
    socket_path = tmp_path / "warm.sock"
    (tmp_path / "launchers").mkdir()
    parent, server_pid = _supernode_with_server(socket_path, ignore_sigterm=True, start_new_session=True)
    os.killpg(parent.pid, signal.SIGTERM)
    time.sleep(1.0)
    assert _alive(server_pid)  # still running, waiting for its SuperNode
    with pytest.raises(ConnectionRefusedError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(socket_path))  # no more launches: a launcher falls back to a fresh process
    assert (tmp_path / "launchers").exists()  # the SuperNode still runs and still needs them
    parent.kill()
    parent.wait()
    _wait_for(lambda: not _alive(server_pid), "the fork server to exit after its SuperNode")
    assert not (tmp_path / "launchers").exists()


def test_a_supernode_stopped_like_fedforge_client_stops_it_leaves_no_launcher_directory(tmp_path):
    """`common.procs.stop_process`, as `fedforge client` and the tests stop a SuperNode: SIGTERM its process group, and once
    it has exited SIGKILL the group. A SuperNode that ends by Flower's forced exit (os._exit, no atexit) leaves its launcher
    directory to the warm server, which must therefore not be in that group."""
    from common.procs import stop_process

    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from client.supernode import install_fast_clientapp
        install_fast_clientapp("warm")
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # Flower's forced exit: no atexit handler runs
        print(os.environ["PATH"].split(os.pathsep)[0], flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    directory = Path(parent.stdout.readline().strip())
    assert directory.name.startswith("fedforge-clientapp-")
    _wait_for((directory / "warm.sock").exists, "the warm server's socket", timeout=120)
    stop_process(parent)
    _wait_for(lambda: not directory.exists(), "the launcher directory to go")


def test_flower_object_pulls_start_backing_off_at_50_ms_and_still_succeed(monkeypatch):
    from flwr.supercore.inflatable import inflatable_utils
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

    from common.flower_waits import shorten_object_pull_backoff

    for fn in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        monkeypatch.setattr(fn, "__kwdefaults__", dict(fn.__kwdefaults__))  # Flower's defaults again after the test
    assert shorten_object_pull_backoff()
    for fn in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        assert fn.__kwdefaults__["initial_backoff"] == 0.05 and fn.__kwdefaults__["backoff_cap"] == 1.0
    tries = {"a": 0}

    def pull(object_id: str) -> bytes:  # unavailable twice, as when the sender is still pushing it
        tries[object_id] += 1
        if tries[object_id] < 3:
            raise ObjectUnavailableError(object_id)
        return b"content"

    assert inflatable_utils.pull_objects(["a"], pull) == {"a": b"content"} and tries["a"] == 3


def test_a_supernode_that_lost_its_superlink_retries_at_most_every_few_seconds(monkeypatch):
    from flwr.supercore.retry import http_retry, make_simple_http_retry_invoker

    from client.supernode import shorten_reconnect_backoff

    monkeypatch.setattr(http_retry, "MAX_RETRY_DELAY", http_retry.MAX_RETRY_DELAY)  # Flower's 20 s again after the test

    assert shorten_reconnect_backoff(4.0)
    waits = make_simple_http_retry_invoker().wait_gen_factory()  # the generator Flower's SuperNode backs off with
    delays = [next(waits) for _ in range(12)]
    assert max(delays) <= 4.0 and delays[-1] > 0  # Flower's own cap is 20 s


def test_a_supernode_declares_and_keeps_a_short_heartbeat_that_its_superlink_accepts(monkeypatch):
    """The SuperLink refuses to take a restarted node back until two declared intervals pass without a heartbeat."""
    from flwr.common.constant import HEARTBEAT_MIN_INTERVAL
    from flwr.supercore import heartbeat
    from flwr.superlink.servicer.fleet import fleet_handlers
    from flwr.supernode import fleet_http_connection as connection

    from client.supernode import DEFAULT_HEARTBEAT_SECONDS, shorten_heartbeat_interval

    for module in (heartbeat, connection):  # Flower's 30 s again after the test
        monkeypatch.setattr(module, "HEARTBEAT_DEFAULT_INTERVAL", module.HEARTBEAT_DEFAULT_INTERVAL)
    assert shorten_heartbeat_interval(DEFAULT_HEARTBEAT_SECONDS)
    assert heartbeat.HEARTBEAT_DEFAULT_INTERVAL == connection.HEARTBEAT_DEFAULT_INTERVAL == 10.0
    fleet_handlers._validate_heartbeat_interval(connection.HEARTBEAT_DEFAULT_INTERVAL)  # what the SuperLink checks on activation

    sent: list[float] = []
    sender = heartbeat.HeartbeatSender(lambda: sent.append(time.monotonic()) or True)
    waits: list[float] = []
    monkeypatch.setattr(sender._stop_event, "wait", lambda seconds: waits.append(seconds) or len(waits) >= 3 and sender._stop_event.set())
    sender._run()  # Flower's own loop: heartbeat, then wait (interval - call timeout) x 0.7-0.9
    assert len(sent) == 3 and all(3.5 <= w <= 4.5 for w in waits), waits  # Flower: 17.5-22.5 s, so a lapse took 60 s

    assert shorten_heartbeat_interval(1.0) and connection.HEARTBEAT_DEFAULT_INTERVAL == HEARTBEAT_MIN_INTERVAL  # never one it refuses


def test_the_supernode_starts_flowers_superexec_itself_so_no_shim_reorders_its_path(tmp_path):
    """A pyenv-style shim for flower-superexec puts its interpreter's bin directory first on PATH, in front of
    the SuperNode's flwr-clientapp launcher; the SuperNode therefore finds its own flower-superexec first."""
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "flower-superexec").write_text("#!/bin/sh\necho shim\n")
    (shims / "flower-superexec").chmod(0o755)
    script = textwrap.dedent("""
        import os, shutil, subprocess, sys
        from client.supernode import install_fast_clientapp
        launcher = install_fast_clientapp("direct")
        superexec = shutil.which("flower-superexec")
        assert os.path.dirname(superexec) == os.path.dirname(launcher), (superexec, launcher)
        assert open(superexec).readline().strip() == "#!" + sys.executable
        out = subprocess.run([superexec, "--help"], capture_output=True, text=True, timeout=60)
        print(out.returncode, "runtime-api-address" in out.stdout)
    """)
    env = {**os.environ, "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=Path(__file__).resolve().parents[1],
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "True"], out.stdout  # Flower's own SuperExec entry point, not the shim


def test_a_fab_is_verified_once_per_content_and_a_tampered_one_never(monkeypatch, tmp_path):
    import io
    import shutil
    import zipfile

    import click
    from flwr.cli.build import build_fab_from_disk
    from flwr.cli.install import install_from_fab

    from client.fab_cache import once
    from server.launch import app_dir

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    calls = []

    def flowers(*args):
        calls.append(args)
        return install_from_fab(*args)

    install = once(flowers)
    fab = build_fab_from_disk(app_dir())
    first = install(fab, None, True)
    assert first.is_dir() and (first / "pyproject.toml").is_file() and len(calls) == 1
    assert install(fab, None, True) == first and len(calls) == 1  # same bytes: Flower's verification is not repeated
    shutil.rmtree(first)
    assert install(fab, None, True) == first and first.is_dir() and len(calls) == 2  # gone: installed again
    with zipfile.ZipFile(io.BytesIO(fab)) as src, io.BytesIO() as out:  # one file changed, CONTENT list kept
        with zipfile.ZipFile(out, "w") as dst:
            for item in src.infolist():
                data = src.read(item.filename)
                dst.writestr(item, data + b"# tampered\n" if item.filename.endswith("client/app.py") else data)
        tampered = out.getvalue()
    for _ in range(2):  # refused every time: a failed verification is never recorded
        with pytest.raises(click.ClickException, match="hashes"):
            install(tampered, None, True)
    assert len(calls) == 4
    from flwr.supernode.runtime import run_clientapp

    from client.fab_cache import verify_fabs_once

    monkeypatch.setattr(run_clientapp, "install_from_fab", run_clientapp.install_from_fab)  # restored after the test
    assert verify_fabs_once() and verify_fabs_once()  # what the warm server and the direct launcher call: wraps Flower's once
    assert run_clientapp.install_from_fab.wrapped is install_from_fab


def test_a_process_identity_survives_pid_reuse_and_names_only_this_host():
    from common.procs import process_gone, process_identity

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    identity = process_identity(proc.pid)
    assert not process_gone(identity)
    assert process_gone({**identity, "start": int(identity["start"]) + 1})  # same pid, another process
    assert not process_gone({**identity, "host": "another-host"})  # nothing to tell from here
    proc.kill()
    proc.wait()
    assert process_gone(identity)


def test_the_leftover_process_check_counts_this_sessions_processes_and_no_one_elses():
    """`tests.conftest.federation_pids` (what `no_leftover_processes` kills) sees a process this session started, and its
    children, by the marker they inherit; a FedForge process of another session (another pytest-xdist worker) it leaves
    alone."""
    from tests.conftest import SESSION_MARKER, federation_pids

    sleeper = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(60)",
               sys.executable, "-c", "import time; time.sleep(60)", "fedforge"]  # both command lines name fedforge
    others_env = {k: v for k, v in os.environ.items() if k != SESSION_MARKER}
    ours = subprocess.Popen(sleeper, start_new_session=True)
    others = subprocess.Popen(sleeper, env=others_env, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while len(seen := federation_pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ours.pid in seen and len(seen) == 2, seen  # the sleeper and the child it started
        assert others.pid not in seen
    finally:
        for proc in (ours, others):
            os.killpg(proc.pid, signal.SIGKILL)  # the sleeper and its child
            proc.wait()

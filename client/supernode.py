"""Flower's SuperNode, unchanged except for how long it sleeps when the SuperLink has no message for it.

Flower 1.42's SuperNode loop (``flwr.supernode.start_client_internal``) sleeps a hard-coded 3 s after
every empty pull, so each message a factory handles waits 1.5 s on average before the SuperNode even
sees it, and a secure round has two such messages. There is no flag or environment variable for it.
``fedforge client`` therefore starts the SuperNode through this module: it replaces the ``time`` that
module sleeps with by one whose sleeps are capped at ``FEDFORGE_SUPERNODE_POLL_SECONDS`` (default
0.5 s), then runs Flower's own ``flower-supernode`` entry point with the same arguments. Nothing else
changes: same transport, same authentication, same process model.

The patch is applied only to the Flower version it was written against (1.42.0) and only if the
module still sleeps through a module-level ``time`` import; otherwise the SuperNode runs as Flower
ships it and a warning says so. Every pull is one small HTTP request to the SuperLink, so the load on
it grows with the number of factories divided by the interval (0.5 s: two requests per second per
idle factory).

Second, every message a factory handles starts a fresh ``flwr-clientapp`` process (Flower's SuperExec
finds it on PATH). Flower's entry point imports ``flwr.supernode.cli``, whose package ``__init__``
imports the whole SuperNode (FastAPI, the SQL object store...) that a ClientApp never uses: about
0.9 s of the ~2.4 s the process needs before it can ask for its message, paid twice per secure round
by every factory. The SuperNode therefore puts a ``flwr-clientapp`` first on its children's PATH. By
default it asks a warm fork server (``client/warm_clientapp.py``, started here with Flower, gRPC,
numpy and ``cryptography`` already imported) to fork the ClientApp process, which then runs the very
same function (``flwr/supernode/cli/flwr_clientapp.py``'s ``flwr_clientapp``, same arguments, same
code) within milliseconds; without that server it starts a fresh process running that function loaded
from its file without the package ``__init__`` (the *direct* launcher). For any other Flower version
it imports Flower's entry point as usual. ``FEDFORGE_FAST_CLIENTAPP`` chooses: ``warm`` (default),
``direct``, or ``0`` (Flower's own ``flwr-clientapp``). Flower's own ``flower-superexec`` goes into the
same directory, run by this interpreter: started through a wrapper that edits PATH (a pyenv shim puts
its interpreter's bin directory first), the SuperExec would otherwise find Flower's ``flwr-clientapp``
before the launcher.

Third, every FedForge process that pulls Flower message objects starts its back-off at 50 ms instead
of 1 s (``common/flower_waits.py``). Fourth, a SuperNode that lost its SuperLink (a central restart)
retries at most every ``FEDFORGE_SUPERNODE_RECONNECT_SECONDS`` (default 4 s, with Flower's jitter)
instead of every 20 s, so factories are back within seconds of the central site; 1,000 disconnected
factories then ask about 250 times a second between them. Fifth, a ClientApp verifies the run's FAB
once per FAB content instead of once per message (``client/fab_cache.py``). Sixth, the SuperNode
sends its heartbeat every few seconds, declaring a 10 s interval (``FEDFORGE_SUPERNODE_HEARTBEAT_SECONDS``;
Flower: 30 s), so that a restarted SuperNode is taken back within ~20 s instead of ~1 min.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

from common.flower_waits import CHECKED_VERSION, checked_flower, shorten_object_pull_backoff

log = logging.getLogger("fedforge.supernode")

DEFAULT_POLL_SECONDS = 0.5
DEFAULT_RECONNECT_SECONDS = 4.0
DEFAULT_HEARTBEAT_SECONDS = 10.0  # Flower's default is 30 and its SuperLink accepts 10 to 1,800
FLOWER_IDLE_SLEEP = 3.0  # the hard-coded sleep after an empty pull
REPLY_POLL_SECONDS = 0.1


class _CappedSleep(types.SimpleNamespace):
    """Stands in for the ``time`` module inside Flower's SuperNode loop: every attribute is the real one,
    except that its idle sleep is capped."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self._cap = cap

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        # the idle poll (3 s) is capped at the configured interval; the loop's other waits (0.5 s while the
        # ClientApp runs, before a reply can be pushed) at a tenth of a second
        time.sleep(min(seconds, self._cap) if seconds >= FLOWER_IDLE_SLEEP else min(seconds, REPLY_POLL_SECONDS))


def shorten_idle_poll(seconds: float) -> bool:
    """Cap the SuperNode's idle sleep at ``seconds``; returns whether the patch applied."""
    import flwr
    from flwr.supernode import start_client_internal as loop

    if not checked_flower() or getattr(loop, "time", None) is not time:
        log.warning("Flower %s: the SuperNode's idle poll is left at Flower's default (the patch targets %s)",
                    getattr(flwr, "__version__", "?"), CHECKED_VERSION)
        return False
    loop.time = _CappedSleep(max(0.05, seconds))  # type: ignore[assignment]
    return True


def shorten_reconnect_backoff(seconds: float) -> bool:
    """Cap the wait between the SuperNode's attempts to reach its SuperLink (Flower: 20 s); returns whether it applied."""
    import flwr
    from flwr.supercore.retry import http_retry

    if not checked_flower() or not isinstance(getattr(http_retry, "MAX_RETRY_DELAY", None), (int, float)):
        log.warning("Flower %s: the SuperNode's reconnect back-off is left at Flower's default", getattr(flwr, "__version__", "?"))
        return False
    http_retry.MAX_RETRY_DELAY = max(0.5, seconds)  # type: ignore[attr-defined]  # read when each back-off starts
    return True


def shorten_heartbeat_interval(seconds: float) -> bool:
    """Declare and send the SuperNode's heartbeat every ``seconds`` (Flower: 30 s); returns whether it applied.

    The SuperLink takes a node for gone once two intervals pass without a heartbeat, and until then refuses
    to activate the same node again: a factory whose SuperNode was killed and restarted waited about a
    minute to rejoin. The interval is what the SuperNode declares when it activates and with every
    heartbeat, and its sender waits (interval - 5 s) x 0.7-0.9 between heartbeats, so 10 s means a
    heartbeat every ~4 s and a restarted node back within ~20 s. A node whose heartbeats lapse (a
    SuperLink restart, say) is online again with its next one. Values below Flower's minimum are raised
    to it (the SuperLink refuses them)."""
    import flwr
    from flwr.common.constant import HEARTBEAT_MAX_INTERVAL, HEARTBEAT_MIN_INTERVAL
    from flwr.supercore import heartbeat
    from flwr.supernode import fleet_http_connection as connection

    modules = (heartbeat, connection)  # the sender's period, and the interval declared to the SuperLink
    if not checked_flower() or not all(isinstance(getattr(m, "HEARTBEAT_DEFAULT_INTERVAL", None), (int, float)) for m in modules):
        log.warning("Flower %s: the SuperNode's heartbeat interval is left at Flower's default", getattr(flwr, "__version__", "?"))
        return False
    for module in modules:
        module.HEARTBEAT_DEFAULT_INTERVAL = min(max(float(seconds), HEARTBEAT_MIN_INTERVAL), HEARTBEAT_MAX_INTERVAL)  # type: ignore[attr-defined]
    return True


DIRECT_LAUNCHER = """#!{python}
# flwr-clientapp for a FedForge SuperNode (written by client/supernode.py): Flower's own function, loaded
# without flwr.supernode.cli's package __init__, which imports the whole SuperNode.
import sys

from client.fab_cache import verify_fabs_once
from client.supernode import flwr_clientapp_entry
from common.flower_waits import shorten_object_pull_backoff

shorten_object_pull_backoff()
verify_fabs_once()
sys.argv[0] = "flwr-clientapp"
sys.exit(flwr_clientapp_entry()())
"""


def flwr_clientapp_entry() -> Callable[[], object]:
    """Flower's ``flwr_clientapp`` function, loaded from its file without the SuperNode package ``__init__``
    on the Flower version this was checked against (any other: Flower's entry point, imported as usual)."""
    import flwr.supernode

    if not checked_flower():
        from flwr.supernode.cli import flwr_clientapp

        return flwr_clientapp
    source = Path(flwr.supernode.__path__[0]) / "cli" / "flwr_clientapp.py"
    spec = importlib.util.spec_from_file_location("flwr_clientapp_cli", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.flwr_clientapp  # type: ignore[no-any-return]


SUPEREXEC_LAUNCHER = """#!{python}
# flower-superexec for a FedForge SuperNode (written by client/supernode.py): Flower's own entry point
# ({entry}), run by the SuperNode's interpreter. Started through a wrapper such as a pyenv shim, the
# SuperExec would get a PATH with the interpreter's bin directory in front, and would then start
# Flower's flwr-clientapp instead of the launcher this SuperNode put first on PATH.
import importlib
import sys

module, _, attr = {entry!r}.partition(":")
sys.argv[0] = "flower-superexec"
sys.exit(getattr(importlib.import_module(module), attr)())
"""


def _console_script(name: str) -> str | None:
    """``module:function`` of an installed console script (Flower's own entry points), or None."""
    from importlib.metadata import entry_points

    found = entry_points(group="console_scripts", name=name)
    return next(iter(found)).value if found else None


def _write_script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def install_fast_clientapp(mode: str = "warm") -> Path:
    """Put a ``flwr-clientapp`` launcher first on PATH (children inherit it); returns it.

    ``direct``: Flower's function in a fresh process without the SuperNode import; ``warm``: forked from
    a warm server (``client/warm_clientapp.py``) started here, the direct launcher as its fallback.
    Flower's ``flower-superexec``, which starts ``flwr-clientapp`` by name, is put beside it, run by
    this interpreter, so that the PATH the launcher is found on reaches the SuperExec unchanged."""
    directory = Path(tempfile.mkdtemp(prefix="fedforge-clientapp-"))
    atexit.register(shutil.rmtree, directory, True)
    entry = _console_script("flower-superexec")
    if entry is not None:
        _write_script(directory / "flower-superexec", SUPEREXEC_LAUNCHER.format(python=sys.executable, entry=entry))
    direct = _write_script(directory / ("flwr-clientapp" if mode == "direct" else "flwr-clientapp-direct"),
                           DIRECT_LAUNCHER.format(python=sys.executable))
    launcher = direct
    if mode == "warm":
        from client import warm_clientapp

        socket_path = directory / "warm.sock"
        # its own session: a SIGKILL to the SuperNode's process group (a supervisor reaping what its SuperNode left) does not
        # reach it, so it outlives the SuperNode by the moment it takes to delete the directory (`warm_clientapp.serve`)
        server = subprocess.Popen([sys.executable, "-m", "client.warm_clientapp", "--socket", str(socket_path),
                                   "--parent-pid", str(os.getpid()),
                                   "--remove-on-exit", str(directory)], start_new_session=True)
        atexit.register(server.terminate)
        os.environ[warm_clientapp.SOCKET_ENV] = str(socket_path)
        launcher = warm_clientapp.write_launcher(directory, direct)
    os.environ["PATH"] = os.pathsep.join([str(directory), os.environ.get("PATH", "")])
    return launcher


def main() -> None:
    shorten_object_pull_backoff()
    shorten_reconnect_backoff(float(os.environ.get("FEDFORGE_SUPERNODE_RECONNECT_SECONDS", DEFAULT_RECONNECT_SECONDS)))
    shorten_idle_poll(float(os.environ.get("FEDFORGE_SUPERNODE_POLL_SECONDS", DEFAULT_POLL_SECONDS)))
    shorten_heartbeat_interval(float(os.environ.get("FEDFORGE_SUPERNODE_HEARTBEAT_SECONDS", DEFAULT_HEARTBEAT_SECONDS)))
    mode = os.environ.get("FEDFORGE_FAST_CLIENTAPP", "warm")
    if mode != "0":
        install_fast_clientapp("direct" if mode == "direct" else "warm")
    from flwr.supernode.cli import flower_supernode

    sys.argv[0] = "flower-supernode"
    sys.exit(flower_supernode())


if __name__ == "__main__":
    main()

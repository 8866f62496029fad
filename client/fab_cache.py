"""Verify a FAB once per content, not once per message.

Flower 1.42's ClientApp process calls ``install_from_fab(fab_bytes, skip_prompt=True)`` for every
message: it unzips the whole FAB into a temporary directory, checks every file against the FAB's
CONTENT list, and then, because the app is already installed under its hash, returns the installed
directory without touching it. For FedForge's FAB (~0.7 MB, a few hundred files) that is ~0.28 s of
CPU per message per factory, twice per secure round, spent re-proving something already proven.

`install_from_fab_once` computes the sha256 of the FAB bytes it is given, every time. If a FAB with
that exact digest was verified and installed before on this SuperNode (a marker in the Flower home
records where), it returns that directory, as Flower would; otherwise it calls Flower's function and
records the result only when it succeeded. Equal sha256 means equal bytes, so the verification would
have given the same answer; the installed directory itself is trusted exactly as much as Flower trusts
it (Flower returns it unchecked when it exists). Anything but the plain call (a path, another install
directory, a prompt) goes straight to Flower.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from common.flower_waits import CHECKED_VERSION, checked_flower

log = logging.getLogger("fedforge.fab")


def _markers() -> Path:
    from flwr.supercore.utils import get_flwr_home  # where Flower's install_from_fab installs

    return Path(get_flwr_home()) / "fedforge" / "verified-fabs"


def once(install: Callable[..., Path]) -> Callable[..., Path]:
    """Wrap Flower's ``install_from_fab``: verify each distinct FAB once, then return its installed directory."""

    def install_from_fab_once(fab_file: Path | bytes, install_dir: Path | None = None, skip_prompt: bool = False) -> Path:
        if not (isinstance(fab_file, bytes) and install_dir is None and skip_prompt):
            return install(fab_file, install_dir, skip_prompt)
        digest = hashlib.sha256(fab_file).hexdigest()
        marker = _markers() / digest
        try:
            installed = Path(marker.read_text())
            if installed.is_dir():
                return installed
        except (OSError, ValueError):
            pass
        installed = install(fab_file, install_dir, skip_prompt)  # raises on a FAB that does not verify: nothing recorded
        marker.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=marker.parent)
        with os.fdopen(fd, "w") as f:
            f.write(str(installed))
        os.replace(tmp, marker)
        return installed

    install_from_fab_once.wrapped = install  # type: ignore[attr-defined]
    return install_from_fab_once


def verify_fabs_once() -> bool:
    """Make this process's ClientApp runtime verify each FAB once; returns whether it applied (Flower 1.42.0 only)."""
    import flwr
    from flwr.supernode.runtime import run_clientapp

    current = getattr(run_clientapp, "install_from_fab", None)
    if not checked_flower() or current is None:
        log.warning("Flower %s: every message re-verifies its FAB (the change targets %s)", flwr.__version__, CHECKED_VERSION)
        return False
    if not hasattr(current, "wrapped"):
        run_clientapp.install_from_fab = once(current)  # type: ignore[attr-defined]
    return True

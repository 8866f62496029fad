"""Shared fixtures. Process checks read /proc directly: every FedForge process is a Linux process."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path

import pytest

import common  # noqa: F401  # first: it turns gRPC's fork handlers off before any test module imports gRPC

WATCHED = ("flower-superlink", "flower-supernode", "client.supernode", "flwr-serverapp", "flwr-clientapp", "fedforge", "common.cli")

# Every process this test process starts inherits this variable (FedForge and Flower pass their environment on to
# the processes they spawn), so the process checks below see this session's processes only: pytest-xdist runs
# another worker's federations on the same machine at the same time, and its processes are neither leftovers of
# ours nor ours to kill.
SESSION_MARKER = "FEDFORGE_TEST_SESSION"
os.environ[SESSION_MARKER] = f"{os.getpid()}-{secrets.token_hex(4)}"
_MARKER_ENTRY = f"{SESSION_MARKER}={os.environ[SESSION_MARKER]}".encode()


def federation_pids() -> set[int]:
    """PIDs of every live Flower or FedForge process that this test session started, directly or not (zombies
    excluded): those whose environment carries this session's marker."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            cmdline = " ".join(argv)
            is_test_runner = any(Path(a).name in ("pytest", "py.test") for a in argv[:2]) or "-m pytest" in cmdline
            if is_test_runner or not any(w in cmdline for w in WATCHED):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            ours = _MARKER_ENTRY in (entry / "environ").read_bytes().split(b"\0")  # read only for the few watched ones
        except OSError:
            continue
        if ours and state != "Z":
            pids.add(int(entry.name))
    return pids


def majority_class_features(seed: int, spread: float):  # -> (train FeatureSet, test FeatureSet)
    """Three classes of 8-d features, unit noise around centres drawn at scale ``spread``: a training set where class 0
    holds 90 % (540 / 30 / 30) and a balanced test set (300 each), for the logit-adjustment tests."""
    import numpy as np

    from common.features import FeatureSet

    rng = np.random.default_rng(seed)
    centres = rng.normal(0, spread, (3, 8))

    def draw(per_class):
        x = np.concatenate([centres[c] + rng.normal(0, 1.0, (n, 8)) for c, n in enumerate(per_class)]).astype(np.float32)
        return FeatureSet(x, np.repeat(np.arange(3), per_class), ("a", "b", "c"))

    return draw((540, 30, 30)), draw((300, 300, 300))


def rare_class_recall(head, test) -> float:
    """Of ``test``'s rare-class images (majority_class_features), the share ``head`` does not call the majority class."""
    import torch

    with torch.no_grad():
        predicted = head(torch.from_numpy(test.images)).argmax(1).numpy()
    return float((predicted[300:] != 0).mean())


def log_tails(workdir: Path, lines: int = 12) -> str:
    """The last lines of every process log under ``workdir``: what a failed run over real processes left behind, for
    the assertion message (CI keeps nothing else)."""
    parts = []
    for log_file in sorted(Path(workdir).rglob("*.log")):
        tail = log_file.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log_file.relative_to(workdir)}\n" + "\n".join(line[:300] for line in tail))
    return "\n".join(parts)


@pytest.fixture
def no_leftover_processes():
    """Fail the test if any Flower/FedForge process it started is still alive afterwards."""
    before = federation_pids()
    yield
    deadline = time.monotonic() + 15
    while (left := federation_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        def cmdline(pid: int) -> str:
            try:
                return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
            except OSError:
                return "(gone)"

        described = {pid: cmdline(pid) for pid in left}
        for pid in left:  # never let one test's leftovers disturb the next
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        pytest.fail(f"processes left running: {described}")


REPO = Path(__file__).resolve().parents[1]
WRITTEN_BY_TOOLS = frozenset({".pytest_cache", ".hypothesis", ".ruff_cache", "test-artifacts", "__pycache__"})


@pytest.fixture(scope="session", autouse=True)
def _checkout_stays_clean():
    """No test writes into the checkout. A component left at a default relative path (an agent's ``fedforge-factory``
    state folder, say) writes into the working directory, where .gitignore hides it and the next run reads it back:
    a personal model or a privacy ledger carried from one run of the suite into the next."""
    before = {p.name for p in REPO.iterdir()}
    yield
    written = {p.name for p in REPO.iterdir()} - before - WRITTEN_BY_TOOLS
    assert not written, f"the tests wrote {sorted(written)} into the checkout {REPO}: give the component a tmp_path"


@pytest.fixture(scope="session", autouse=True)
def _one_feature_cache(tmp_path_factory):
    """Every FedForge process the suite starts shares one backbone feature cache (``FEDFORGE_FEATURE_CACHE``): many tests
    federate the same generated images, and each image then goes through the backbone once per suite, not once per
    test and process. Under pytest-xdist the workers share it too (it sits beside their own temporary folders): the
    dashboard tests' demo and compose's factories, say, hold the same 600 images and often run in different workers
    (in one suite run, compose read all 600 from the dashboard demo's rows; two workers that compute the same images at
    the same moment both compute them).
    SQLite in WAL mode takes the workers' concurrent writes (`common.features.FeatureCache`). Tests of the cache
    itself open their own."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / "feature-cache-shared"
        folder.mkdir(exist_ok=True)
    else:
        folder = tmp_path_factory.mktemp("feature-cache")
    path = folder / "features.db"
    os.environ["FEDFORGE_FEATURE_CACHE"] = str(path)
    yield path
    os.environ.pop("FEDFORGE_FEATURE_CACHE", None)


@pytest.fixture(autouse=True)
def _quiet_flower(monkeypatch):
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv("FEDFORGE_TORCH_THREADS", "1")


@pytest.fixture
def chromium(tmp_path_factory):
    """A real headless Chromium (Debian's) driven through chromedriver.

    Its profile and the singleton-socket folder it makes under TMPDIR live in a short pytest folder: `driver.quit()`
    ends Chromium without the clean shutdown that would remove them, so each test left two folders in /tmp."""
    from selenium import webdriver

    home = tmp_path_factory.mktemp("chromium")  # short: the socket's path must fit a Unix socket name (108 bytes)
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1366,900",
                f"--user-data-dir={home / 'profile'}"):
        options.add_argument(arg)
    service = webdriver.ChromeService("/usr/bin/chromedriver", env={**os.environ, "TMPDIR": str(home)})
    driver = webdriver.Chrome(service=service, options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="session")
def postgres():
    from tests.pg import PostgresServer

    server = PostgresServer()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def registry_factory(request, tmp_path):
    """Make registries on SQLite and on PostgreSQL (the registry suite runs against both)."""
    from common.signing import create_keypair, load_private
    from server.registry.service import Registry

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'registry.db'}"
    else:
        url = request.getfixturevalue("postgres").new_database()
    key_path, _ = create_keypair(tmp_path / "keys")
    release_path, _ = create_keypair(tmp_path / "keys", "release")

    def make() -> Registry:
        return Registry(url, tmp_path / "artifacts", signing_key=load_private(key_path), release_key=load_private(release_path))

    make.url = url  # type: ignore[attr-defined]
    make.public_key = tmp_path / "keys" / "signing.pub"  # type: ignore[attr-defined]
    make.release_public_key = tmp_path / "keys" / "release.pub"  # type: ignore[attr-defined]
    return make

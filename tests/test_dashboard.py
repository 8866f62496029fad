"""The dashboard over a registry filled by a real (short) federation: API, auth, SSE, fuzzing, a real browser."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from common.procs import free_port, wait_for_port
from server.dashboard.app import DashboardSettings, create_app, serve_dashboard
from server.registry.service import Registry

pytestmark = pytest.mark.slow
ADMIN = "test-admin-token-7f3a"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


@pytest.fixture(scope="module")
def demo_registry(tmp_path_factory) -> Path:
    """A registry written by `fedforge demo` (3 factories with DP sharing the secure sum's noise, 2 rounds)."""
    root = tmp_path_factory.mktemp("dash")
    proc = subprocess.run(
        [sys.executable, "-m", "common.cli", "demo", "--factories", "3", "--rounds", "2", "--train-size", "200", "--local-epochs", "1",
         "--dp", "--epsilon", "8", "--dp-secure-sum", "--min-factories", "3", "--set", "proxy-size=64",  # the DP heads' public set: 64 images
         "--workdir", str(root), "--json", str(root / "summary.json")],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "central" / "registry"


@pytest.fixture
def registry_dir(demo_registry: Path, tmp_path: Path) -> Path:
    """Each test's own copy of the demo's registry, so that a test that approves or revokes a version leaves the next
    test the registry the demo wrote, whatever order the tests run in."""
    copy = tmp_path / "registry"
    shutil.copytree(demo_registry, copy)
    return copy


def _serve(registry_dir: Path, **kw):
    port = free_port()
    server = serve_dashboard(DashboardSettings(registry_dir, poll_seconds=0.2, **kw), "127.0.0.1", port)
    wait_for_port("127.0.0.1", port, 30)
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture
def dashboard(registry_dir):
    server, url = _serve(registry_dir, admin_token=ADMIN)
    yield url
    server.should_exit = True


def test_api_shows_the_real_run(dashboard, registry_dir):
    reg = Registry.at(registry_dir)
    (run,) = reg.runs()
    with httpx.Client(base_url=dashboard) as c:
        runs = c.get("/api/v1/runs").json()
        assert [r["id"] for r in runs] == [run.id] and runs[0]["status"] == "finished" and runs[0]["rounds_completed"] == 2
        detail = c.get(f"/api/v1/runs/{run.id}").json()
        assert [r["accuracy"] for r in detail["rounds"]] == [r.accuracy for r in reg.rounds(run.id)]
        versions = c.get("/api/v1/versions").json()
        assert {v["id"] for v in versions} == {v.id for v in reg.versions()}
        newest = versions[0]
        v = c.get(f"/api/v1/versions/{newest['id']}").json()
        assert v["signature_status"] == "valid" and len(v["lineage"]) == 3 and v["lineage"][-1]["kind"] == "initial"
        privacy = c.get("/api/v1/privacy").json()
        assert {p["factory"] for p in privacy} == {"factory-0", "factory-1", "factory-2"}
        assert all(0 < p["epsilon_spent"] <= p["epsilon_max"] == 8.0 for p in privacy)
        assert all(p["subspace_dims"] == 40 for p in privacy)  # the head trained within the generated proxy set's top 40 directions
        # 3 factories, the default threshold 2, no tolerated colluder: each added half the noise of the secure sum
        assert all(p["noise_holders"] == 2 and p["epsilon_spent"] < p["epsilon_alone"] for p in privacy)
        # the clipping norm each factory used: by default a fifth of the public feature norm, the same at every factory (computed
        # from the same public images), on the features' scale rather than 1
        norms = {p["max_grad_norm"] for p in privacy}
        assert len(norms) == 1 and norms.pop() > 2.0
        factories = c.get("/api/v1/factories").json()
        assert [f["status"] for f in factories] == ["ok", "ok", "ok"]
        metrics = c.get("/metrics").text
        received = float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("fedforge_bytes_received_total")))
        assert received > 0
        assert "fedforge_rounds_completed_total 2" in metrics and 'fedforge_privacy_epsilon_spent{factory="factory-0"}' in metrics
        refused = c.get(f"/api/v1/versions/{newest['id']}/download")  # weights leave only with the view token
        assert refused.status_code == 403 and "view token" in refused.json()["detail"]


def test_state_changes_need_the_admin_token(dashboard, registry_dir):
    reg = Registry.at(registry_dir)
    target = reg.versions()[1].id
    with httpx.Client(base_url=dashboard) as c:
        assert c.post(f"/api/v1/versions/{target}/approve", json={}).status_code == 401
        assert c.post(f"/api/v1/versions/{target}/approve", json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert reg.get_version(target).status == "candidate"
        ok = c.post(f"/api/v1/versions/{target}/approve", json={"note": "qa passed", "actor": "alice"}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert ok.status_code == 200 and ok.json()["status"] == "approved"
        assert reg.actions(version_id=target)[-1].actor == "dashboard:alice"
        conflict = c.post(f"/api/v1/versions/{'0' * 32}/revoke", json={}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert conflict.status_code == 404


def test_read_only_without_admin_token_and_view_token(registry_dir):
    server, url = _serve(registry_dir, view_token="viewer-secret")
    try:
        with httpx.Client(base_url=url) as c:
            assert c.get("/api/v1/versions").status_code == 401
            assert c.get("/api/v1/versions", headers={"Authorization": "Bearer viewer-secret"}).status_code == 200
            page = c.get("/versions?token=viewer-secret")
            assert page.status_code == 200 and c.get("/versions").status_code == 200  # the cookie carries the view token
            vid = Registry.at(registry_dir).versions()[0].id
            r = c.post(f"/api/v1/versions/{vid}/revoke", json={}, headers={"Authorization": "Bearer viewer-secret"})
            assert r.status_code == 403 and "disabled" in r.json()["detail"]
            reg = Registry.at(registry_dir)
            v = reg.versions()[1]  # the browser test below approves a candidate: leave the newest alone
            assert c.get(f"/api/v1/versions/{v.id}/download", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get(f"/api/v1/versions/{v.id}/download?token=viewer-secret").content == reg.artifacts.get(v.sha256)
            reg.revoke(v.id, actor="qa")
            gone = c.get(f"/api/v1/versions/{v.id}/download?token=viewer-secret")
            assert gone.status_code == 410 and "revoked" in gone.json()["detail"]
    finally:
        server.should_exit = True


def test_malformed_ids_and_traversal_get_4xx(dashboard):
    with httpx.Client(base_url=dashboard) as c:
        for path in ("/api/v1/versions/xyz", "/api/v1/versions/..%2F..%2Fetc%2Fpasswd", "/api/v1/versions/" + "a" * 33,
                     "/api/v1/runs/..%2Fsecret", "/versions/../../etc/passwd", "/api/v1/versions/" + "0" * 32 + "/download",
                     "/api/v1/versions?status=bogus"):
            r = c.get(path)
            assert 400 <= r.status_code < 500, (path, r.status_code)


def test_live_updates_arrive_as_server_sent_events(dashboard, registry_dir):
    reg = Registry.at(registry_dir)
    target = reg.versions()[0].id
    with httpx.Client(base_url=dashboard, timeout=30) as c, c.stream("GET", "/api/v1/events") as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        reg.approve(target, actor="sse-test")
        second = next(line for line in lines if line.startswith("data:"))
    assert first != second


@pytest.fixture
def api_app(registry_dir):
    return create_app(DashboardSettings(registry_dir, admin_token=ADMIN, poll_seconds=0.05))


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture
def api_schema(api_app):
    return schemathesis.openapi.from_asgi("/openapi.json", api_app)


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_never_cause_a_server_error(case):
    if case.path == "/api/v1/events":
        return  # an endless stream by design
    response = case.call()
    assert response.status_code < 500, f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
    if case.method == "POST":
        assert 400 <= response.status_code < 500  # never changed state without the token


def test_browser_shows_real_numbers_and_approves_with_the_token(registry_dir, chromium):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    server, url = _serve(registry_dir, admin_token=ADMIN)
    driver = chromium
    ARTIFACTS.mkdir(exist_ok=True)
    reg = Registry.at(registry_dir)
    (run,) = reg.runs()
    try:
        driver.get(url + "/")
        points = driver.find_elements(By.CSS_SELECTOR, 'svg[data-chart="Global accuracy per round"] circle[data-series="test set"]')
        shown = sorted((int(p.get_attribute("data-x")), float(p.get_attribute("data-y"))) for p in points)
        expected = [(r.server_round, round(r.accuracy, 4)) for r in reg.rounds(run.id) if r.status == "completed"]
        assert shown == expected
        # the factories' own held-out figures: one point per evaluated version, at the round that produced it
        points = driver.find_elements(By.CSS_SELECTOR, 'svg[data-chart="Global accuracy per round"] circle[data-series="factories\' held-out images"]')
        federated = {(v.server_round, round(reg.latest_evaluation(v.id).figures["accuracy"], 4)) for v in reg.versions(run.id)
                     if reg.latest_evaluation(v.id) is not None}
        assert {(int(p.get_attribute("data-x")), float(p.get_attribute("data-y"))) for p in points} == federated and len(federated) == 3
        assert driver.find_element(By.ID, "round-progress").text == "2 / 2"
        driver.save_screenshot(str(ARTIFACTS / "dashboard-overview.png"))

        driver.get(url + "/versions")
        rows = driver.find_elements(By.CSS_SELECTOR, "#versions-table tr[data-version]")
        assert {r.get_attribute("data-version") for r in rows} == {v.id for v in reg.versions()}
        candidate = next(v for v in reversed(reg.versions()) if v.status == "candidate")
        row = driver.find_element(By.CSS_SELECTOR, f'tr[data-version="{candidate.id}"] td.accuracy')
        assert row.text == f"{candidate.metrics['accuracy']:.4f}"
        driver.save_screenshot(str(ARTIFACTS / "dashboard-versions.png"))

        driver.get(url + f"/versions/{candidate.id}")
        assert driver.find_element(By.ID, "signature-status").text == "valid"
        evaluation = reg.latest_evaluation(candidate.id)  # the final, evaluate-only phase measured the last version
        assert evaluation is not None and evaluation.phase == "final" and evaluation.factories == 3
        cells = driver.find_elements(By.CSS_SELECTOR, "svg.heatmap rect[data-count]")
        assert len(cells) == 36 and sum(int(c.get_attribute("data-count")) for c in cells) == evaluation.examples
        assert [[int(c.get_attribute("data-count")) for c in cells[i * 6:(i + 1) * 6]] for i in range(6)] == evaluation.confusion
        escape = evaluation.figures["escape-rate"]
        assert driver.find_element(By.ID, "escape-rate").text == f"{escape:.4f}"
        driver.find_element(By.ID, "admin-token").send_keys(ADMIN)
        driver.find_element(By.ID, "admin-save").click()
        driver.find_element(By.ID, "action-note").send_keys("approved in the browser test")
        driver.find_element(By.ID, "approve").click()
        confirm = WebDriverWait(driver, 10).until(EC.alert_is_present())
        assert f"Escape rate on the factories' held-out images: {escape:.4f}" in confirm.text
        confirm.accept()
        WebDriverWait(driver, 10).until(lambda d: reg.get_version(candidate.id).status == "approved")
        WebDriverWait(driver, 10).until(lambda d: "approved" in d.find_element(By.ID, "version-status").text)  # live update, no reload
        driver.save_screenshot(str(ARTIFACTS / "dashboard-version-approved.png"))
        assert reg.actions(version_id=candidate.id)[-1].note == "approved in the browser test"
    finally:
        server.should_exit = True


def test_stop_run_from_the_dashboard(tmp_path, no_leftover_processes):
    """POST /api/v1/runs/{id}/stop (admin token) stops a live Flower run through the SuperLink."""
    from common.procs import ProcessSet
    from server.local import LocalFederation, wait_for_run

    with ProcessSet(tmp_path / "logs") as procs:
        fed = LocalFederation(tmp_path, procs, num_factories=2, train_size=200, admin_token=ADMIN, secure=False)
        fed.start()
        run_id = "run-" + fed.submit(fed.run_config(20, **{"local-epochs": 1, "min-factories": 2}))
        registry = Registry.at(fed.registry_dir)
        deadline = time.monotonic() + 120
        while registry.get_run(run_id) is None:
            assert time.monotonic() < deadline
            time.sleep(0.3)
        with httpx.Client(base_url=fed.dashboard_url, timeout=60) as c:
            assert c.post(f"/api/v1/runs/{run_id}/stop", json={"actor": "ops"}).status_code == 401
            r = c.post(f"/api/v1/runs/{run_id}/stop", json={"actor": "ops"}, headers={"Authorization": f"Bearer {ADMIN}"})
            assert r.status_code == 200 and r.json()["status"] == "stopped", r.text
            again = c.post(f"/api/v1/runs/{run_id}/stop", json={"actor": "ops"}, headers={"Authorization": f"Bearer {ADMIN}"})
            assert again.status_code == 409
        run = wait_for_run(registry, run_id, timeout=60)
        assert run.status == "stopped" and "ops" in run.error
        from server import launch

        deadline = time.monotonic() + 60
        while not launch.run_status(fed.flwr_home(), run_id.removeprefix("run-")).startswith("finished"):
            assert time.monotonic() < deadline, "Flower did not stop the run"
            time.sleep(1)
        assert len(registry.rounds(run_id)) < 20

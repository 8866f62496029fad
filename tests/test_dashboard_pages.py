"""Every list the dashboard serves is paginated: newest first, X-Total-Count, Link headers, pager links on the pages."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from fastapi.testclient import TestClient

from server.dashboard.app import DashboardSettings, create_app
from server.registry.service import NewVersion, Registry


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pages")
    registry = Registry.at(directory, create_key=True)
    for i in range(250):
        registry.add_version(NewVersion(run_id=f"run-{i % 3}", server_round=i, parent_id=None, kind="fedavg", architecture="cnn-small",
                                        weights=OrderedDict(w=np.full(4, i, np.float32)), metrics={"accuracy": i / 250}, participants=["a"]))
    for i in range(3):
        registry.start_run(f"run-{i}", str(i), {"num_server_rounds": 2})
    with TestClient(create_app(DashboardSettings(directory))) as c:
        c.app_state_dir = directory
        yield c


def test_versions_come_in_pages_newest_first(client):
    first = client.get("/api/v1/versions", params={"limit": 100})
    assert first.status_code == 200 and len(first.json()) == 100 and first.headers["X-Total-Count"] == "250"
    assert [v["server_round"] for v in first.json()[:3]] == [249, 248, 247]
    assert first.headers["Link"].startswith("</api/v1/versions?") and "offset=100" in first.headers["Link"]
    assert 'rel="next"' in first.headers["Link"] and 'rel="prev"' not in first.headers["Link"]
    last = client.get("/api/v1/versions", params={"limit": 100, "offset": 200})
    assert [v["server_round"] for v in last.json()] == list(range(49, -1, -1)) and 'rel="next"' not in last.headers["Link"]
    assert len(client.get("/api/v1/versions").json()) == 50  # the default page
    for bad in ({"limit": 0}, {"limit": 5000}, {"offset": -1}, {"limit": "x"}):
        assert client.get("/api/v1/versions", params=bad).status_code == 422, bad


def test_runs_factories_privacy_and_the_html_pages_paginate(client):
    runs = client.get("/api/v1/runs", params={"limit": 2})
    assert len(runs.json()) == 2 and runs.headers["X-Total-Count"] == "3"
    for path in ("/api/v1/factories", "/api/v1/privacy"):
        r = client.get(path, params={"limit": 1})
        assert r.status_code == 200 and "X-Total-Count" in r.headers
    page = client.get("/versions", params={"limit": 50, "offset": 50})
    assert page.status_code == 200 and page.text.count("data-version=") == 50
    assert 'id="page-next" href="?offset=100&amp;limit=50"' in page.text and 'id="page-prev" href="?offset=0&amp;limit=50"' in page.text
    assert "51–100 of 250" in page.text
    assert client.get("/runs", params={"limit": 2}).text.count("data-run=") == 2


def test_a_status_change_shows_in_the_next_list_at_once(client, tmp_path_factory):
    newest = client.get("/api/v1/versions", params={"limit": 1}).json()[0]
    assert newest["status"] == "candidate"
    registry = Registry.at(client.app_state_dir)
    registry.approve(newest["id"], actor="qa")
    assert client.get("/api/v1/versions", params={"limit": 1}).json()[0]["status"] == "approved"  # the cached page is not served stale


def test_the_privacy_list_defers_each_factorys_history_and_a_new_round_shows_at_once(tmp_path):
    registry = Registry.at(tmp_path, create_key=True)
    registry.start_run("run-p", "1", {})
    for r in range(3):
        registry.add_version(NewVersion(run_id="run-p", server_round=r, parent_id=None, kind="fedavg", architecture="cnn-small",
                                        weights=OrderedDict(w=np.zeros(2, np.float32)), metrics={}, participants=["a", "b"],
                                        privacy={"a": {"epsilon-spent": 0.5 * (r + 1), "epsilon-max": 8.0},
                                                 "b": {"epsilon-spent": 0.5 * (r + 1), "epsilon-max": 8.0, "dp-noise-holders": 2.0,
                                                       "epsilon-alone": 0.9 * (r + 1), "dp-max-grad-norm": 11.5}}))
    with TestClient(create_app(DashboardSettings(tmp_path))) as c:
        short = c.get("/api/v1/privacy").json()
        assert [(p["factory"], p["epsilon_spent"], p["history"]) for p in short] == [("a", 1.5, None), ("b", 1.5, None)]
        # a factory that shares the secure sum's noise (--dp-secure-sum) shows with whom, and what its own noise guarantees
        assert [(p["noise_holders"], p["epsilon_alone"]) for p in short] == [(None, None), (2, pytest.approx(2.7))]
        assert "noise shared with 2 honest input(s) of the secure sum (ε 2.700 on its own noise); gradients clipped at 11.5" in c.get("/privacy").text
        assert [p["max_grad_norm"] for p in short] == [None, 11.5]
        full = c.get("/api/v1/privacy", params={"history": "true"}).json()
        assert [h["epsilon_spent"] for h in full[0]["history"]] == [0.5, 1.0, 1.5]
        registry.record_round("run-p", 3, status="aborted", participants=[], failures={"a": "no reply"}, seconds=1.0, version_id=None, metrics={})
        assert c.get("/api/v1/factories").json()[0]["rounds_failed"] == 1  # the cached list moved with the registry

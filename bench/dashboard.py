#!/usr/bin/env python3
"""Dashboard API under bounded load: every JSON list endpoint vs a minimal FastAPI endpoint served the same way.

Both apps run in their own uvicorn process on loopback; this process sends a fixed number of
requests from a few threads (keep-alive clients) and reports requests/s and p99 latency, then the
ratio dashboard / minimal. The registry holds one run of ``--versions`` rounds, each with
``--factories`` participants (some failing, each with a privacy spend) and a version per round.

    python bench/dashboard.py [--versions 1000] [--factories 200] [--requests 2000] [--threads 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx
import numpy as np

from common.procs import free_port, wait_for_port
from server.registry.service import NewVersion, Registry

ENDPOINTS = ("/api/v1/versions", "/api/v1/runs", "/api/v1/factories", "/api/v1/privacy")

MINIMAL = "from fastapi import FastAPI\napp = FastAPI()\n@app.get('/ping')\ndef ping():\n    return {'ok': True}\n"
DASHBOARD = ("import sys\nfrom pathlib import Path\nfrom server.dashboard.app import DashboardSettings, create_app\n"
             "app = create_app(DashboardSettings(Path(sys.argv[-1])))\n")


def load(url: str, requests: int, threads: int) -> dict[str, float]:
    latencies: list[float] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        local = []
        with httpx.Client() as c:
            for _ in range(n):
                t = time.perf_counter()
                r = c.get(url)
                local.append(time.perf_counter() - t)
                assert r.status_code == 200
        with lock:
            latencies.extend(local)

    with httpx.Client() as c:
        for _ in range(20):
            c.get(url)  # warm-up
    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker, args=(requests // threads,)) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    return {"rps": len(latencies) / wall, "p50_ms": statistics.median(latencies) * 1e3, "p99_ms": float(np.percentile(latencies, 99)) * 1e3}


def serve(tmp: Path, name: str, source: str, extra: list[str]) -> tuple[subprocess.Popen, int]:
    (tmp / f"{name}.py").write_text(source)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", (f"import sys; sys.path[:0]=[{str(tmp)!r}, {str(ROOT)!r}]; import uvicorn, {name}; "
                             f"uvicorn.run({name}.app, host='127.0.0.1', port={port}, log_level='warning', access_log=False)"), *extra],
                            stdout=subprocess.DEVNULL)
    wait_for_port("127.0.0.1", port, 60, proc)
    return proc, port


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=1000)
    p.add_argument("--factories", type=int, default=200)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--threads", type=int, default=4)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        reg = Registry.at(tmp / "registry", create_key=True)
        names = [f"factory-{i}" for i in range(a.factories)]
        reg.start_run("run-bench", "1", {"num-server-rounds": a.versions})
        parent = None
        for i in range(a.versions):
            failed = {names[(7 * i + k) % a.factories]: "no reply to train within 300s" for k in range(3)}
            ok = [n for n in names if n not in failed]
            privacy = {n: {"epsilon-spent": 0.01 * i, "epsilon-max": 8.0, "delta": 1e-5} for n in ok}
            parent = reg.add_version(NewVersion(run_id="run-bench", server_round=i, parent_id=parent.id if parent else None, kind="fedavg",
                                                architecture="cnn-small", weights=OrderedDict(w=np.zeros(8, np.float32)),
                                                metrics={"accuracy": 0.5}, participants=ok, secure_aggregation=True, privacy=privacy))
            reg.record_round("run-bench", i, status="completed", accuracy=0.5, loss=1.0, participants=ok, failures=failed, seconds=1.0,
                             version_id=parent.id, metrics={"accuracy": 0.5})
        procs = []
        try:
            mp, mport = serve(tmp, "minimal_app", MINIMAL, [])
            procs.append(mp)
            dp, dport = serve(tmp, "dashboard_app", DASHBOARD, [str(tmp / "registry")])
            procs.append(dp)
            minimal = load(f"http://127.0.0.1:{mport}/ping", a.requests, a.threads)
            lists = {path: load(f"http://127.0.0.1:{dport}{path}", a.requests, a.threads) for path in ENDPOINTS}
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    print(json.dumps({"versions": a.versions, "factories": a.factories, "minimal": minimal, "lists": lists}))
    print(f"minimal endpoint: {minimal['rps']:.0f} req/s, p99 {minimal['p99_ms']:.1f} ms")
    for path, figures in lists.items():
        print(f"{path} ({a.versions} versions, {a.factories} factories): {figures['rps']:.0f} req/s, p99 {figures['p99_ms']:.1f} ms; "
              f"ratio to minimal: throughput {figures['rps'] / minimal['rps']:.2f}, p99 {figures['p99_ms'] / minimal['p99_ms']:.1f}x")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Model distribution and inspection serving, as ratios against baselines in the same run.

1. Streaming download of a ~100 MB version over loopback gRPC (pull + signature + sha256 verify) vs
   a raw file copy of the same file.
2. Inspect requests/s and p99 latency for the default model: one unary call per image vs the
   streaming variant (InspectStream) from one client.

    python bench/registry.py [--megabytes 100] [--requests 400]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import numpy as np
from PIL import Image

from client.agent import serve
from client.config import AgentConfig
from client.models import ModelClient
from common.data import datasets
from common.models import build_model
from common.procs import free_port
from common.rpc.fedforge.v1 import edge_pb2, edge_pb2_grpc
from common.signing import load_public
from server.registry.grpc_service import serve_registry
from server.registry.service import NewVersion, Registry

TOKEN = "bench-token"


def download(tmp: Path, megabytes: int) -> dict[str, float]:
    registry = Registry.at(tmp / "registry", create_key=True)
    big = registry.add_version(NewVersion(run_id="bench", server_round=0, parent_id=None, kind="initial", architecture="blob",
                                          weights=OrderedDict(w=np.random.default_rng(0).random(megabytes * 262_144, dtype=np.float32)),
                                          metrics={}, participants=[]))
    address = f"127.0.0.1:{free_port()}"
    server, stop = serve_registry(registry, address, TOKEN)
    try:
        src = registry.artifacts.path_for(big.sha256)
        t_copy = min(_timed(lambda i=i: shutil.copyfile(src, tmp / f"copy{i}")) for i in range(3))
        pulls = []
        for i in range(3):
            client = ModelClient(address, load_public(tmp / "registry" / "keys" / "signing.pub"), tmp / f"edge{i}", token=TOKEN)
            pulls.append(_timed(lambda c=client: c.pull(big.id)))
            client.close()
        t_pull = min(pulls)
    finally:
        stop.set()
        server.stop(None)
    mb = big.size_bytes / 1e6
    return {"megabytes": mb, "copy_MBps": mb / t_copy, "grpc_pull_verify_MBps": mb / t_pull, "pull_over_copy_time": t_pull / t_copy}


def inspect(tmp: Path, requests: int) -> dict[str, float]:
    registry = Registry.at(tmp / "registry")
    weights = OrderedDict((k, v.numpy()) for k, v in build_model("cnn-small", 6, seed=0).state_dict().items())
    v = registry.add_version(NewVersion(run_id="bench", server_round=1, parent_id=None, kind="fedavg", architecture="cnn-small",
                                        weights=weights, metrics={}, participants=[]))
    registry.approve(v.id, actor="bench")
    reg_address, agent_address, inspection_address = (f"127.0.0.1:{free_port()}" for _ in range(3))
    reg_server, stop = serve_registry(registry, reg_address, TOKEN)
    agent = serve(AgentConfig(factory_id="bench", listen=agent_address, inspection_listen=inspection_address, train_size=16, registry=reg_address,
                              registry_public_key=str(tmp / "registry" / "keys" / "signing.pub"), registry_token=TOKEN,
                              release_public_key=str(tmp / "registry" / "keys" / "release.pub"), state_dir=str(tmp / "agent")))
    try:
        while agent.follower.serving.version != v.id:
            time.sleep(0.05)
        images = []
        for img in datasets.test_dataset(datasets.SyntheticSpec(), 60).images:
            buf = io.BytesIO()
            Image.fromarray((img[0] * 255).astype(np.uint8)).save(buf, format="PNG")
            images.append(buf.getvalue())
        stub = edge_pb2_grpc.InspectionStub(grpc.insecure_channel(inspection_address))  # loopback: no TLS or token needed
        reqs = [edge_pb2.InspectRequest(image=images[i % len(images)], request_id=str(i)) for i in range(requests)]
        for r in reqs[:20]:
            stub.Inspect(r)  # warm-up
        lat = []
        t0 = time.perf_counter()
        for r in reqs:
            t = time.perf_counter()
            stub.Inspect(r)
            lat.append(time.perf_counter() - t)
        unary_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        n = sum(1 for _ in stub.InspectStream(iter(reqs)))
        stream_s = time.perf_counter() - t0
        assert n == requests
    finally:
        agent.stop(None)
        stop.set()
        reg_server.stop(None)
    return {"unary_rps": requests / unary_s, "unary_p50_ms": statistics.median(lat) * 1e3,
            "unary_p99_ms": float(np.percentile(lat, 99)) * 1e3, "stream_rps": requests / stream_s, "stream_over_unary": unary_s / stream_s}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megabytes", type=int, default=100)
    p.add_argument("--requests", type=int, default=400)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = download(Path(tmp), a.megabytes)
        i = inspect(Path(tmp), a.requests)
    print(json.dumps({**d, **i}))
    print(f"download {d['megabytes']:.0f} MB: raw copy {d['copy_MBps']:.0f} MB/s, gRPC pull+verify {d['grpc_pull_verify_MBps']:.0f} MB/s "
          f"(time ratio pull/copy {d['pull_over_copy_time']:.1f}x)")
    print(f"Inspect unary: {i['unary_rps']:.0f} req/s, p50 {i['unary_p50_ms']:.1f} ms, p99 {i['unary_p99_ms']:.1f} ms; "
          f"stream: {i['stream_rps']:.0f} req/s ({i['stream_over_unary']:.2f}x unary)")


if __name__ == "__main__":
    main()

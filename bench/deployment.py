#!/usr/bin/env python3
"""Deployment figures that can be computed without a Docker engine.

1. Installed size of the Python dependency closure of `fedforge` (the dominant image layer), by
   distribution, from the files each installed distribution records (this machine's CPU torch).
2. Cold start of the factory command: `fedforge client` launched -> edge agent serving (data loaded)
   -> SuperNode registered with the SuperLink, against a local `fedforge server`; baseline: the bare
   `python -c "import torch"` start in the same run.
3. With --install-layer: the images' install layer reproduced, i.e. the Dockerfiles' `pip install
   --no-cache-dir ... fedforge` into an empty virtual environment, measured on disk (bytecode
   included, as pip writes it in the image). The slim Python base image cannot be fetched here.

    python bench/deployment.py [--install-layer]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.procs import ProcessSet
from server.local import LocalFederation


def closure(name: str, seen: dict[str, int]) -> None:
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        return
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return
    seen[key] = sum((f.size or 0) for f in (dist.files or []))
    for req in dist.requires or []:
        if "extra ==" in req:
            continue
        closure(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0], seen)


def cold_start() -> dict[str, float]:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    torch_import = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d, ProcessSet(Path(d) / "logs") as procs:
        fed = LocalFederation(Path(d), procs, num_factories=1)
        fed.start_central()
        t0 = time.perf_counter()
        f = fed.start_factory(0)
        fed.wait_for_agent(f.agent_address)
        agent_ready = time.perf_counter() - t0
        home = fed.flwr_home()
        while True:
            out = subprocess.run(["flwr", "supernode", "ls", "fedforge", "--format", "json"], env={**__import__("os").environ, "FLWR_HOME": str(home)},
                                 capture_output=True, text=True, check=False)
            if '"online"' in out.stdout:
                break
            time.sleep(0.2)
        node_online = time.perf_counter() - t0
    return {"python_import_torch_s": torch_import, "agent_serving_s": agent_ready, "supernode_online_s": node_online}


def install_layer() -> tuple[int, list[tuple[str, int]]]:
    """Bytes that `pip install --no-cache-dir <this repo>` writes into an empty environment, and the largest entries."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "layer"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-cache-dir", str(root)],
                       check=True)
        (site,) = (venv / "lib").glob("python3*/site-packages")
        sizes = {entry.name: _disk_bytes(entry) for entry in site.iterdir()}
        return sum(sizes.values()), sorted(sizes.items(), key=lambda kv: -kv[1])[:8]


def _disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--install-layer", action="store_true", help="also reproduce and measure the images' pip install layer (~1 min)")
    args = parser.parse_args()
    if args.install_layer:
        layer, largest = install_layer()
        print(json.dumps({"install_layer_bytes": layer, "largest": largest}))
        print(f"install layer (pip install of fedforge into an empty environment): {layer / 2**20:.0f} MiB; largest: "
              + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in largest[:6]))
    sizes: dict[str, int] = {}
    closure("fedforge", sizes)
    total = sum(sizes.values())
    top = sorted(sizes.items(), key=lambda kv: -kv[1])[:8]
    start = cold_start()
    print(json.dumps({"closure_bytes": total, "top": top, **start}))
    print(f"installed Python closure of fedforge: {total / 2**20:.0f} MiB in {len(sizes)} distributions; largest: "
          + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in top[:5]))
    print(f"cold start: agent serving after {start['agent_serving_s']:.1f} s, SuperNode online after {start['supernode_online_s']:.1f} s "
          f"(bare `import torch`: {start['python_import_torch_s']:.1f} s, ratio {start['agent_serving_s'] / start['python_import_torch_s']:.1f}x)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Cost curves from 10 to 200 factories on Flower's Simulation Engine, side by side in one run.

For each N it runs, on this machine, with the same generated partitions (``--train-size`` images per
factory), ``--local-epochs`` of training in every run (default 0: what a round costs besides
training; FedForge then also skips the personal fine-tune) and otherwise the default recipe:

- Flower's own plain simulation (``bench/plain_flower``: the stock FedAvg strategy, ``cnn-small``):
  the baseline;
- ``fedforge simulate --no-secure`` (plain FedAvg rounds of the FedForge app);
- ``fedforge simulate`` with SecAgg+ on the complete graph;
- ``fedforge simulate`` with SecAgg+ on a sparse graph of fixed degree ``--degree``;

and reports the median round wall time over rounds 2..R, the peak RSS of the simulation process (the
ServerApp and Flower's simulation driver), the payload each factory uploads per round and the client
CPU per factory and round (CPU time of Flower's simulation workers, where every virtual factory runs,
over rounds 2..R). ``--dropout-at`` adds the dropout check: N factories, 30% dropping out after their
masked input, every round must complete and every unmasked sum must equal the sum of its contributors.

    python bench/scale.py --factories 10,50,100,200 --rounds 3 --degree 16 --dropout-at 100
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.procs import ProcessSet, free_port, wait_for_port
from server import launch

CLK_TCK = os.sysconf("SC_CLK_TCK")


class Sampler:
    """Polls /proc: the simulation process's peak RSS, and the CPU seconds of Flower's Ray workers over time."""

    def __init__(self) -> None:
        self.peak_rss_mb = 0.0
        self.cpu: list[tuple[float, float]] = []  # (wall time, summed CPU seconds of ray:: worker processes)
        self._workers: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    if b"flwr-simulation" in cmdline:
                        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                            if line.startswith("VmHWM:"):
                                self.peak_rss_mb = max(self.peak_rss_mb, int(line.split()[1]) / 1024)
                    elif cmdline.startswith(b"ray::ClientAppActor"):  # where the virtual factories run (not Ray's own agents)
                        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                        self._workers[pid] = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
                except (OSError, ValueError, IndexError):
                    continue
            self.cpu.append((time.time(), sum(self._workers.values())))
            self._stop.wait(0.25)

    def cpu_between(self, start: float, end: float) -> float:
        def at(t: float) -> float:
            before = [c for w, c in self.cpu if w <= t]
            return before[-1] if before else 0.0
        return at(end) - at(start)


def fedforge(n: int, rounds: int, train_size: int, local_epochs: int, work: Path, *flags: str) -> dict[str, float | bool | int]:
    """One ``fedforge simulate`` run: median round seconds (2..R), peak server RSS, upload bytes, client CPU per factory-round."""
    from server.registry.service import Registry

    summary_path = work / "summary.json"
    cmd = [sys.executable, "-m", "common.cli", "simulate", "--factories", str(n), "--rounds", str(rounds), "--train-size", str(train_size),
           "--local-epochs", str(local_epochs), "--workdir", str(work), "--json", str(summary_path), *flags]
    if local_epochs == 0:
        cmd += ["--set", "personal-epochs=0"]  # no training at all, as the Flower baseline
    with Sampler() as sampler:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    if not summary_path.exists():
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    summary = json.loads(summary_path.read_text())
    registry = Registry.at(Path(summary["registry"]))
    done = registry.rounds(summary["run_id"])
    completed = [r for r in done if r.status == "completed"]
    later = [r for r in done if r.server_round >= 2]
    seconds = statistics.median(r.seconds for r in later) if later else float("nan")
    upload = statistics.median(r.metrics.get("upload-bytes-per-factory", float("nan")) for r in later) if later else float("nan")
    cpu = float("nan")
    if len(done) >= 2:
        first_end = done[0].created_at.replace(tzinfo=UTC).timestamp()
        last_end = done[-1].created_at.replace(tzinfo=UTC).timestamp()
        cpu = sampler.cpu_between(first_end, last_end) / (n * (len(done) - 1))
    out = {"round_s": seconds, "peak_rss_mb": round(sampler.peak_rss_mb, 1), "upload_kb": upload / 1024, "client_cpu_ms": cpu * 1000,
           "rounds_completed": len(completed), "rounds": len(done)}
    if "audit" in summary:
        out["audit_equal"] = summary["audit"]["equal"]
        out["dropped_at_unmask"] = [sum("dropped out at unmask" in why for why in r.failures.values()) for r in done]
    return out


def flower_plain(n: int, rounds: int, train_size: int, local_epochs: int, work: Path) -> dict[str, float]:
    """Flower's stock FedAvg on its Simulation Engine (bench/plain_flower), same N: the baseline round time."""
    timings = work / "timings.json"
    env = {"FLWR_TELEMETRY_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    with ProcessSet(work / "logs") as procs, Sampler() as sampler:
        port = free_port()
        proc = procs.start("superlink", launch.superlink_command(work, "127.0.0.1", port, simulation=True), env=env, cwd=work)
        wait_for_port("127.0.0.1", port, timeout=90, proc=proc)
        home = launch.flwr_home(work, f"127.0.0.1:{port}")
        cfg = (f'num-server-rounds={rounds} num-factories={n} architecture="cnn-small" local-epochs={local_epochs} train-size={train_size} '
               f'timings-file="{timings}"')
        fed = f"num-supernodes={n} backend='ray' init-args-num-cpus={os.cpu_count()} client-resources-num-cpus={os.cpu_count()}"
        subprocess.run(["flwr", "run", str(ROOT / "bench" / "plain_flower"), launch.CONNECTION, "--run-config", cfg, "--federation-config", fed],
                       env=launch.flwr_env(home), check=True, capture_output=True, timeout=120)
        deadline = time.monotonic() + 3600
        while True:
            stamps = json.loads(timings.read_text()) if timings.exists() else []
            if len(stamps) == rounds + 1:  # round 0 is the initial evaluation
                break
            if time.monotonic() > deadline or procs.dead():
                raise RuntimeError(f"Flower's plain simulation of {n} factories did not finish")
            time.sleep(0.5)
    per_round = [b["time"] - a["time"] for a, b in itertools.pairwise(stamps)]
    return {"round_s": statistics.median(per_round[1:]) if len(per_round) > 1 else per_round[0], "peak_rss_mb": round(sampler.peak_rss_mb, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--factories", default="10,50,100,200")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--train-size", type=int, default=30)
    ap.add_argument("--local-epochs", type=int, default=0, help="local epochs in every run (0: the rounds' own cost, no training)")
    ap.add_argument("--degree", type=int, default=16, help="neighbours per factory of the sparse graph")
    ap.add_argument("--dropout-at", type=int, default=100, help="N for the 30%%-dropout check (0: skip)")
    ap.add_argument("--only", default="flower,plain,complete,sparse", help="which runs per N")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    only = set(args.only.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.factories.split(",")):
            row: dict[str, object] = {"factories": n}
            runs = {
                "flower": lambda w, n=n: flower_plain(n, args.rounds, args.train_size, args.local_epochs, w),
                "plain": lambda w, n=n: fedforge(n, args.rounds, args.train_size, args.local_epochs, w, "--no-secure"),
                "complete": lambda w, n=n: fedforge(n, args.rounds, args.train_size, args.local_epochs, w, "--secagg-degree", str(n + n % 2)),
                "sparse": lambda w, n=n: fedforge(n, args.rounds, args.train_size, args.local_epochs, w, "--secagg-degree", str(args.degree)),
            }
            for name, run in runs.items():
                if name in only:
                    t0 = time.perf_counter()
                    row[name] = run(Path(tmp) / f"{name}-{n}")
                    print(f"N={n} {name}: {row[name]} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
            if "flower" in row and "complete" in row:
                row["complete_over_flower"] = row["complete"]["round_s"] / row["flower"]["round_s"]  # type: ignore[index]
            rows.append(row)
        if args.dropout_at:
            n = args.dropout_at
            check = fedforge(n, args.rounds, args.train_size, args.local_epochs, Path(tmp) / f"dropout-{n}", "--dropout", "0.3", "--dropout-stages", "unmask", "--audit")
            print(f"N={n}, 30% dropping out after the masked input: {check}", file=sys.stderr, flush=True)
            rows.append({"factories": n, "dropout_0.3_unmask": check})
    print(json.dumps(rows, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

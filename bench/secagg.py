#!/usr/bin/env python3
"""Secure aggregation costs, as ratios against baselines measured in the same run.

1. Mask expansion throughput: FedForge's ChaCha20 keystream (uint64 words, Z_2^64) vs Flower's
   `pseudo_rand_gen` (numpy RandomState seeded by a 32-bit fold of the key), same vector sizes.
2. Secure round / plain round wall time in FedForge over real SuperLink/SuperNode processes
   (3 factories, same model, data and local epochs; median of rounds 2..N).

    python bench/secagg.py --rounds 3 --local-epochs 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common.procs import ProcessSet
from common.secagg.primitives import expand_mask
from server.local import LocalFederation, wait_for_run
from server.registry.service import Registry


def mask_throughput(sizes: list[int]) -> list[dict[str, float]]:
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

    rows = []
    for n in sizes:
        seed = os.urandom(32)
        t_ours = min(_timed(lambda seed=seed, n=n: expand_mask(seed, n)) for _ in range(5))
        t_flwr = min(_timed(lambda seed=seed, n=n: pseudo_rand_gen(seed, 1 << 31, [(n,)])) for _ in range(5))
        rows.append({"elements": n, "fedforge_GBps": 8 * n / t_ours / 1e9, "flower_GBps": 8 * n / t_flwr / 1e9, "speedup": t_flwr / t_ours})
    return rows


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def round_seconds(secure: bool, rounds: int, local_epochs: int, factories: int, architecture: str = "",
                  extra: dict[str, object] | None = None) -> tuple[list[float], dict[str, float]]:
    """Each round's wall time, and the median over rounds 2..N of the time spent per message type."""
    with tempfile.TemporaryDirectory() as tmp, ProcessSet(Path(tmp) / "logs") as procs:
        fed = LocalFederation(Path(tmp), procs, num_factories=factories, secure=secure)  # plain: factories allow plaintext answers
        fed.start()
        overrides = {"local-epochs": local_epochs, "secure-aggregation": secure, "min-factories": factories,
                     **({"architecture": architecture} if architecture else {}), **(extra or {})}
        run_id = "run-" + fed.submit(fed.run_config(rounds, **overrides))
        registry = Registry.at(fed.registry_dir)
        wait_for_run(registry, run_id, procs=procs)
        done = registry.rounds(run_id)
        assert all(r.status == "completed" for r in done), [(r.status, r.failures) for r in done]  # a refused round is no timing
        later = done[1:] or done
        kinds = {k for r in later for k in r.metrics if k.startswith("seconds/")}
        phases = {k.removeprefix("seconds/"): statistics.median(r.metrics.get(k, 0.0) for r in later) for k in sorted(kinds)}
        return [r.seconds for r in done], phases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--factories", type=int, default=3)
    p.add_argument("--architecture", default="", help="the run's model (default: the run config's, the pretrained head)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="run-config key=value (repeatable), e.g. personal-epochs=0")
    p.add_argument("--skip-rounds", action="store_true", help="only the mask throughput")
    p.add_argument("--flower-legacy", action="store_true", help="also time Flower's SecAggPlusWorkflow (bench/flower_secagg)")
    a = p.parse_args()
    rows = mask_throughput([80_662, 1_278_022, 10_000_000])
    for r in rows:
        print(f"mask expansion, {r['elements']:>10,} words: FedForge {r['fedforge_GBps']:.2f} GB/s, Flower pseudo_rand_gen "
              f"{r['flower_GBps']:.2f} GB/s, speed-up {r['speedup']:.1f}x")
    out = {"mask": rows}
    if not a.skip_rounds:
        extra = {k: json.loads(v) if v[:1] in "0123456789-[{tf" else v for k, v in (o.split("=", 1) for o in a.overrides)}
        plain, plain_phases = round_seconds(False, a.rounds, a.local_epochs, a.factories, a.architecture, extra)
        secure, secure_phases = round_seconds(True, a.rounds, a.local_epochs, a.factories, a.architecture, extra)
        pm, sm = statistics.median(plain[1:] or plain), statistics.median(secure[1:] or secure)
        out |= {"plain_round_seconds": plain, "secure_round_seconds": secure, "ratio": sm / pm,
                "plain_phase_seconds": plain_phases, "secure_phase_seconds": secure_phases}
        for name, phases in (("plain", plain_phases), ("secure", secure_phases)):
            print(f"{name} round, median seconds per message phase: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
        print(f"round wall time ({a.factories} factories, {a.local_epochs} local epoch(s)): plain {pm:.2f} s, secure {sm:.2f} s, "
              f"ratio secure/plain {sm / pm:.2f}")
    if a.flower_legacy:
        from round_overhead import plain_flower_rounds

        with tempfile.TemporaryDirectory() as tmp:
            legacy = plain_flower_rounds(Path(tmp), a.factories, a.rounds, "cnn-small", app="flower_secagg", local_epochs=a.local_epochs)
        lm = statistics.median(legacy[1:] or legacy)
        out |= {"flower_secaggplus_round_seconds": legacy}
        print(f"Flower SecAggPlusWorkflow round: {lm:.2f} s" + (f"; FedForge secure / Flower SecAgg+ {out['ratio'] * pm / lm:.2f}"
                                                                 if "ratio" in out else ""))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Local training costs at a factory, as ratios against a baseline measured in the same run.

1. DP-SGD step time / plain step time for Opacus' hooks, functorch and ghost modes (1 thread).
2. DDP with 2 CPU ranks (1 thread each) vs 1 process with 2 threads and with 1 thread (images/s).
3. FSDP2 with 2 ranks vs DDP with 2 ranks (images/s).

    python bench/local_training.py [--architecture cnn-small] [--images 640]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from client.config import AgentConfig
from client.data import DataRequest
from client.dp import DPPlan, sample_rate, train_private
from client.workers import Job, WorkerGroup, factory_data
from common.data import datasets
from common.models import build_model
from common.training import TrainConfig, set_torch_threads, train


def per_step(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        steps = fn()
        best = min(best, (time.perf_counter() - t0) / max(1, steps))
    return best


def dp_ratios(arch: str, images: int, batch: int) -> dict[str, float]:
    set_torch_threads(1)
    data = datasets.factory_dataset(datasets.SyntheticSpec(train_size=images), 0)
    cfg = TrainConfig(epochs=1, batch_size=batch, grad_clip=0.0)
    plain = per_step(lambda: train(build_model(arch, 6, seed=0), data, cfg).steps)
    out = {"plain_step_ms": plain * 1e3}
    for mode in ("hooks", "functorch", "ghost"):
        plan = DPPlan(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=sample_rate(len(data), batch), grad_sample_mode=mode)
        t = per_step(lambda plan=plan: train_private(build_model(arch, 6, seed=0), data, cfg, plan).steps)
        out[f"dp_{mode}_over_plain"] = t / plain
    return out


def throughput(images: int, batch: int, arch: str) -> dict[str, float]:
    cfg = AgentConfig(factory_id="bench", train_size=images, torch_threads=1)
    train_data = factory_data(cfg).split(DataRequest()).train
    tc = TrainConfig(epochs=1, batch_size=batch)
    weights = {k: v.numpy() for k, v in build_model(arch, 6, seed=0).state_dict().items()}
    out = {}
    for threads in (1, 2):
        set_torch_threads(threads)
        t = min(_timed(lambda: train(build_model(arch, 6, seed=0), train_data, tc)) for _ in range(3))
        out[f"single_{threads}thread_img_s"] = len(train_data) / t
    for parallelism in ("ddp", "fsdp"):
        group = WorkerGroup(cfg, parallelism, 2)
        try:
            job = Job(weights=weights, architecture=arch, train=asdict(tc))
            group.run(job)  # warm-up
            t = min(_timed(lambda group=group, job=job: group.run(job)) for _ in range(3))
        finally:
            group.close()
        out[f"{parallelism}_2ranks_img_s"] = len(train_data) / t
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--architecture", default="cnn-small")
    parser.add_argument("--images", type=int, default=640)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    dp = dp_ratios(args.architecture, args.images // 2, args.batch)
    tp = throughput(args.images, args.batch, args.architecture)
    print(json.dumps({"architecture": args.architecture, **{k: round(v, 3) for k, v in {**dp, **tp}.items()}}))
    for mode in ("hooks", "functorch", "ghost"):
        print(f"DP-SGD {mode:9s} step / plain step: {dp[f'dp_{mode}_over_plain']:.2f}x  (plain {dp['plain_step_ms']:.1f} ms/step)")
    print(f"DDP 2 ranks / 1 process 1 thread:  {tp['ddp_2ranks_img_s'] / tp['single_1thread_img_s']:.2f}x images/s")
    print(f"DDP 2 ranks / 1 process 2 threads: {tp['ddp_2ranks_img_s'] / tp['single_2thread_img_s']:.2f}x images/s")
    print(f"FSDP 2 ranks / DDP 2 ranks:        {tp['fsdp_2ranks_img_s'] / tp['ddp_2ranks_img_s']:.2f}x images/s")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""GPU check for the `device` machine: nccl DDP/FSDP worker groups, with and without DP, fp32 and bf16.

One call, well under 5 minutes; prints one JSON line per configuration and a summary. CI never runs
this (no GPU there); run it when a GPU machine is lent:

    python bench/gpu_check.py --images 2048 --architecture cnn-medium
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
from client.dp import DPPlan
from client.workers import Job, WorkerGroup
from common.models import build_model
from common.training import TrainConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--architecture", default="cnn-medium")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for the GPU machine", file=sys.stderr)
        return 2
    world = torch.cuda.device_count()
    print(json.dumps({"gpus": world, "name": torch.cuda.get_device_name(0), "torch": torch.__version__}))
    cfg = AgentConfig(factory_id="gpu-check", train_size=args.images, torch_threads=4)
    weights = {k: v.numpy() for k, v in build_model(args.architecture, 6, seed=0).state_dict().items()}
    dp = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "sample_rate": args.batch / (args.images * 0.9)}
    results = []
    for parallelism in ("ddp", "fsdp"):
        group = WorkerGroup(cfg, parallelism, world)
        assert group.backend == "nccl", group.backend
        try:
            for bf16 in (False, True):
                for private in (False, True):
                    if private and bf16:
                        continue  # Opacus per-sample gradients under bf16 autocast are not supported for every mode
                    tc = TrainConfig(epochs=1, batch_size=args.batch, bf16=bf16)
                    mode = "ghost_fsdp" if parallelism == "fsdp" else "hooks"
                    job = Job(weights=weights, architecture=args.architecture, train=asdict(tc), dp=DPPlan(**dp, grad_sample_mode=mode) if private else None)
                    group.run(job)  # warm-up (cuDNN autotune, allocator)
                    t0 = time.perf_counter()
                    out = group.run(job)
                    seconds = time.perf_counter() - t0
                    row = {"parallelism": parallelism, "ranks": world, "bf16": bf16, "dp": private, "images_per_s": round(cfg.train_size * 0.9 / seconds, 1),
                           "loss": round(out["loss"], 4), "ranks_agree": len(set(out["rank_digests"])) == 1 or parallelism == "fsdp"}
                    print(json.dumps(row), flush=True)
                    results.append(row)
        finally:
            group.close()
    ok = all(r["ranks_agree"] and r["loss"] == r["loss"] for r in results)
    print("GPU check", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""GPU check for the `device` machine: backbone feature extraction on the GPU against the CPU (alone, and in a factory's
first round, and a DP factory's round), and the nccl DDP/FSDP worker groups, with and without DP, fp32 and bf16.

One call, a few minutes; prints one JSON line per measurement and a summary. CI never runs this (no GPU there); run it
when a GPU machine is lent:

    python bench/gpu_check.py                       # on the GPU machine
    python bench/gpu_check.py --allow-cpu --images 256 --feature-images 64   # checks the script itself on a CPU host (gloo)

Ratios are taken in this process: GPU ms/image over CPU ms/image for the same images and network (every CPU thread the
host has), bf16 over fp32, DP over plain, FSDP over DDP.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from client.config import AgentConfig
from client.dp import DPPlan
from client.workers import Job, WorkerGroup
from common.backbones import FeatureExtractor, feature_extractor
from common.data.datasets import ImageDataset
from common.features import FeatureCache, array_keys, features_of
from common.models import build_model
from common.training import TrainConfig


def emit(row: dict) -> dict:
    print(json.dumps(row), flush=True)
    return row


def ms_per_image(extract: FeatureExtractor, images: torch.Tensor, batch: int, reps: int) -> float:
    def one_pass() -> None:
        for i in range(0, len(images), batch):
            extract(images[i : i + batch])

    one_pass()  # warm-up: kernels chosen, memory allocated
    if extract.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        one_pass()  # each call returns CPU features, so every pass ends synchronised
    return (time.perf_counter() - start) / (reps * len(images)) * 1000


def check_features(args: argparse.Namespace, on_gpu: bool) -> list[dict]:
    """The product's extractor on the CPU and on the GPU: speed, agreement, and features_of through a real cache."""
    spec = build_model("effnet-lite0", 6, seed=0).backbone.spec
    cpu = feature_extractor(spec, "cpu")
    gpu = feature_extractor(spec, "cuda") if on_gpu else cpu
    g = torch.Generator().manual_seed(0)
    images = torch.rand(args.feature_images, 1, 64, 64, generator=g)
    rows = []
    torch.set_num_threads(os.cpu_count() or 1)
    cpu_ms = ms_per_image(cpu, images[: args.cpu_feature_images], cpu.batch, reps=2)
    rows.append(emit({"features": "cpu", "threads": torch.get_num_threads(), "batch": cpu.batch, "ms_per_image": round(cpu_ms, 3)}))
    for batch in sorted({cpu.batch, gpu.batch}):
        ms = ms_per_image(gpu, images, batch, reps=3)
        rows.append(emit({"features": str(gpu.device), "batch": batch, "ms_per_image": round(ms, 4), "over_cpu": round(ms / cpu_ms, 4)}))
    sample = images[:64]
    diff = float((gpu(sample) - cpu(sample)).abs().max())
    row = {"features": "agreement", "max_abs_diff_gpu_vs_cpu": diff, "ok": diff < 1e-3}
    if on_gpu:  # what full-precision convolutions buy: the same network with TF32 allowed
        conv = torch.backends.cudnn.conv
        before, conv.fp32_precision = conv.fp32_precision, "tf32"
        with torch.no_grad():
            tf32 = gpu.backbone(sample.to(gpu.device)).cpu()
        conv.fp32_precision = before
        row["max_abs_diff_tf32_vs_cpu"] = float((tf32 - cpu(sample)).abs().max())
    rows.append(emit(row))
    with tempfile.TemporaryDirectory() as tmp:  # the path a factory takes: features_of on its device, through a real cache
        cache = FeatureCache(Path(tmp) / "features.sqlite")
        n = min(300, len(images))
        data = ImageDataset(images[:n].numpy(), np.zeros(n, dtype=np.int64), ("ok",))
        first = features_of(data, spec.ident, gpu, cache, array_keys(data.images), batch=gpu.batch)
        again = features_of(data, spec.ident, gpu, cache, array_keys(data.images), batch=gpu.batch)
        rows.append(emit({"features": "cache", "misses": cache.misses, "hits": cache.hits,
                          "ok": cache.misses == n and cache.hits == n and np.array_equal(first.images, again.images)}))
        cache.close()
    return rows


def first_round_weights() -> dict[str, np.ndarray]:
    """The head a factory receives in the checks' first round (the same every call)."""
    from common.models import weights_of

    return weights_of(build_model("effnet-lite0", 6, seed=1))


def first_round(factory_id: str, **agent: object):  # -> (LocalRound, seconds)
    """A factory's first round of the default pretrained recipe (600 generated images, features from scratch, head
    trained 2 epochs) in a throw-away state directory, with these `AgentConfig` settings; and its wall time."""
    from client.trainer import FactoryTrainer

    with tempfile.TemporaryDirectory() as tmp:
        trainer = FactoryTrainer(AgentConfig(factory_id=factory_id, train_size=600, state_dir=tmp, torch_threads=os.cpu_count() or 1, **agent))
        t0 = time.perf_counter()
        out = trainer.train(first_round_weights(), {"architecture": "effnet-lite0", "local-epochs": 2, "batch-size": 16}, 1, run_id=factory_id)
        seconds = time.perf_counter() - t0
        trainer.close()
    return out, seconds


def check_agent_round(on_gpu: bool) -> list[dict]:
    """A factory's first pretrained-family round (features extracted, then the head trained), with --feature-device auto
    against cpu: the time of the round, and the trained heads, which should agree."""
    threads = os.cpu_count() or 1
    heads, seconds = {}, {}
    for device in ("cpu", "auto"):
        out, seconds[device] = first_round(f"gpu-check-{device}", feature_device=device)
        heads[device] = out.weights
    diff = max(float(np.abs(heads["auto"][k] - heads["cpu"][k]).max()) for k in heads["cpu"])
    return [emit({"agent_round": "effnet-lite0, 600 images, features from scratch", "cpu_threads": threads, "cpu_s": round(seconds["cpu"], 2),
                  "auto_s": round(seconds["auto"], 2), "auto_over_cpu": round(seconds["auto"] / seconds["cpu"], 3),
                  "max_abs_head_diff": diff, "ok": diff < 1e-3})]


def check_dp_agent_round() -> list[dict]:
    """A DP factory's first pretrained-family round with its features on the GPU (--feature-device auto): the released
    class counts, the logit-adjusted DP-SGD head (`client.dp.LogitShift`) and the ledger's charge, end to end."""
    out, seconds = first_round("gpu-check-dp", feature_device="auto", dp=True, dp_epsilon=8.0, dp_planned_rounds=5)
    received = first_round_weights()
    finite = all(bool(np.isfinite(v).all()) for v in out.weights.values())
    changed = any(not np.array_equal(out.weights[k], received[k]) for k in out.weights)
    spent = out.privacy.get("epsilon-spent", float("nan"))
    return [emit({"dp_agent_round": "effnet-lite0, 600 images, features on the GPU, DP head", "seconds": round(seconds, 2),
                  "epsilon_spent": round(spent, 4), "examples": out.examples, "train_loss": round(out.metrics.get("train-loss", float("nan")), 4),
                  "ok": finite and changed and 0 < spent <= 8.0})]


def check_worker_groups(args: argparse.Namespace, on_gpu: bool) -> list[dict]:
    world = torch.cuda.device_count() if on_gpu else 2
    cfg = AgentConfig(factory_id="gpu-check", train_size=args.images, torch_threads=4)
    weights = {k: v.numpy() for k, v in build_model(args.architecture, 6, seed=0).state_dict().items()}
    dp = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "sample_rate": args.batch / (args.images * 0.9)}
    rows = []
    for parallelism in ("ddp", "fsdp"):
        group = WorkerGroup(cfg, parallelism, world)
        if on_gpu and group.backend != "nccl":
            raise SystemExit(f"the worker group chose {group.backend}, not nccl, with {world} GPU(s)")
        try:
            for bf16 in (False, True):
                for private in (False, True):
                    if private and bf16:
                        continue  # Opacus per-sample gradients under bf16 autocast are not supported for every mode
                    tc = TrainConfig(epochs=1, batch_size=args.batch, bf16=bf16)
                    mode = "ghost_fsdp" if parallelism == "fsdp" else "hooks"
                    job = Job(weights=weights, architecture=args.architecture, train=asdict(tc),
                              dp=DPPlan(**dp, grad_sample_mode=mode) if private else None)
                    group.run(job)  # warm-up (cuDNN autotune, allocator)
                    t0 = time.perf_counter()
                    out = group.run(job)
                    seconds = time.perf_counter() - t0
                    rows.append(emit({"parallelism": parallelism, "backend": group.backend, "ranks": world, "bf16": bf16, "dp": private,
                                      "images_per_s": round(cfg.train_size * 0.9 / seconds, 1), "loss": round(out["loss"], 4),
                                      "ok": out["loss"] == out["loss"] and (len(set(out["rank_digests"])) == 1 or parallelism == "fsdp")}))
        finally:
            group.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2048, help="training images per worker-group job")
    parser.add_argument("--architecture", default="cnn-medium")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--feature-images", type=int, default=2048, help="images whose features the GPU extracts")
    parser.add_argument("--cpu-feature-images", type=int, default=256, help="of those, how many the CPU baseline extracts")
    parser.add_argument("--allow-cpu", action="store_true", help="without a GPU, run the same checks on the CPU (gloo, 2 ranks)")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.allow_cpu:
        print("no CUDA device: this script is for the GPU machine (--allow-cpu checks the script itself)", file=sys.stderr)
        return 2
    emit({"gpus": torch.cuda.device_count(), "name": torch.cuda.get_device_name(0) if on_gpu else "cpu", "torch": torch.__version__,
          "cpu_threads": os.cpu_count()})
    rows = check_features(args, on_gpu) + check_agent_round(on_gpu) + check_dp_agent_round() + check_worker_groups(args, on_gpu)
    ok = all(r["ok"] for r in rows if "ok" in r)
    print("GPU check", "passed" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

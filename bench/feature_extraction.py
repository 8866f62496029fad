#!/usr/bin/env python3
"""Backbone feature extraction on CPU: the product's channels-last EfficientNet-Lite0 against the same network in
torch's default (contiguous) memory format, in one process, on the same images.

A factory extracts the features of its images once (then reads its cache); the demo's first round, the proxy set of DP
factories and personal models, and inspection all run this. Prints ms per image for both layouts, their ratio, and the
largest difference between the features they compute.

    python bench/feature_extraction.py                   # 1 and 2 threads, 128 px (the default backbone), grey 64 px input
    python bench/feature_extraction.py --threads 1 --images 128 --input-size 96 --channels 3
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from common.features import BATCH
from common.models import build_model


def contiguous_features(backbone: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """What `FrozenBackbone.raw_features` computes, in torch's default memory format (the baseline)."""
    with torch.no_grad():
        return F.layer_norm(backbone._pooled(backbone.prepare(images)), (backbone.feature_dim,))


def per_image_ms(fn, images: torch.Tensor, batch: int, reps: int) -> float:
    fn(images[:batch])  # warm-up: kernels chosen, buffers allocated
    start = time.perf_counter()
    for _ in range(reps):
        for i in range(0, len(images), batch):
            fn(images[i : i + batch])
    return (time.perf_counter() - start) / (reps * len(images)) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="torch intra-op threads, comma-separated")
    p.add_argument("--images", type=int, default=128)
    p.add_argument("--batch", type=int, default=BATCH, help="images per forward pass (default: the product's, common.features.BATCH)")
    p.add_argument("--input-size", type=int, default=64, help="side of the input images (the built-in generator's: 64)")
    p.add_argument("--channels", type=int, default=1, choices=(1, 3))
    p.add_argument("--reps", type=int, default=4, help="passes over the images per layout (fewer: noisier on a busy machine)")
    a = p.parse_args()
    product = build_model("effnet-lite0", 6, seed=0).backbone
    baseline = copy.deepcopy(product).to(memory_format=torch.contiguous_format)
    images = torch.rand(a.images, a.channels, a.input_size, a.input_size, generator=torch.Generator().manual_seed(0))
    diff = float((product.raw_features(images[:16]) - contiguous_features(baseline, images[:16])).abs().max())
    print(f"EfficientNet-Lite0 at {product.spec.input_size} px, {a.images} images of {a.channels} x {a.input_size} px, batch {a.batch}; "
          f"largest feature difference between the layouts {diff:.1e} (layer-normed features, |x| up to ~8)")
    print("| threads | contiguous (baseline) ms/image | channels-last (product) ms/image | product / baseline |")
    print("| --- | --- | --- | --- |")
    for threads in map(int, a.threads.split(",")):
        torch.set_num_threads(threads)
        base = per_image_ms(lambda x: contiguous_features(baseline, x), images, a.batch, a.reps)
        ours = per_image_ms(product.raw_features, images, a.batch, a.reps)
        print(f"| {threads} | {base:.1f} | {ours:.1f} | {ours / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()

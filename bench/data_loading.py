#!/usr/bin/env python3
"""Reading a factory's image folder: kept in memory vs streamed from disk, and the pretrained family's feature cache.

A folder of generated images written as PNG (grey) and JPEG (RGB, another size) is read the way an
agent reads it (`common.data.folder`): once decoded and kept (under --memory-limit-mb), or decoded batch
by batch each epoch (over it). Printed as images/s and as ratios against the in-memory epoch measured
in the same run; and the backbone-feature extraction a pretrained-family factory pays once per image,
against reading its cached features. With ``--photos N``, also N camera-sized JPEG photographs (scikit-image's
``astronaut`` scaled to ``--photo-size``) decoded as the agent decodes them (at a reduced DCT scale,
`common.data.images.JPEG_DRAFT`) against decoding every pixel, in the same run.

    python bench/data_loading.py --images 600
    python bench/data_loading.py --images 600 --photos 60 --photo-size 3000x2000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from PIL import Image

from common.data import synth
from common.data.folder import index_image_folder, load_labelled
from common.features import FeatureCache, content_keys, features_of
from common.models import build_model
from common.training import set_torch_threads


def write_folder(root: Path, n: int) -> None:
    rng = synth.rng_for(0, 42)
    profile = synth.factory_profile(0, 0)
    for i in range(n):
        label = i % len(synth.CLASSES)
        img = synth.render(rng, label, profile, 64)
        folder = root / synth.CLASSES[label]
        folder.mkdir(parents=True, exist_ok=True)
        pil = Image.fromarray((img * 255).astype(np.uint8))
        if i % 2:
            pil.resize((96, 72)).convert("RGB").save(folder / f"{i}.jpg", quality=90)
        else:
            pil.save(folder / f"{i}.png")


def write_photos(root: Path, n: int, size: tuple[int, int]) -> None:
    from skimage import data as skdata

    photo = Image.fromarray(skdata.astronaut()).resize(size, Image.BICUBIC)
    folder = root / synth.CLASSES[0]
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        photo.rotate(90 * (i % 4), expand=False).save(folder / f"{i}.jpg", quality=90)


def decode_rate(root: Path, size: int, full: bool) -> float:
    """Images/s of loading ``root`` as an agent does (`load_labelled`); ``full``: every pixel decoded (no JPEG draft)."""
    from common.data import images

    draft, images.JPEG_DRAFT = images.JPEG_DRAFT, (10**6 if full else images.JPEG_DRAFT)
    try:
        index = index_image_folder(root)
        t0 = time.perf_counter()
        kept, _ = load_labelled(index, synth.CLASSES, size, 3)
        return len(kept) / (time.perf_counter() - t0)
    finally:
        images.JPEG_DRAFT = draft


def epoch(data, batch: int = 16) -> float:
    t0 = time.perf_counter()
    order = np.random.default_rng(0).permutation(len(data))
    for start in range(0, len(data), batch):
        data.images_at(order[start : start + batch])
    return len(data) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=600)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--photos", type=int, default=0, help="also time N camera-sized JPEG photographs (default 0: skip)")
    p.add_argument("--photo-size", default="3000x2000", help="their width x height (default 3000x2000)")
    a = p.parse_args()
    set_torch_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "images"
        write_folder(root, a.images)
        index = index_image_folder(root)
        t0 = time.perf_counter()
        kept, _ = load_labelled(index, synth.CLASSES, a.size, 1)
        first_pass = len(kept) / (time.perf_counter() - t0)
        streamed, report = load_labelled(index, synth.CLASSES, a.size, 1, memory_limit=0)
        assert report.streamed
        in_memory, from_disk = epoch(kept), epoch(streamed)
        model = build_model("effnet-lite0", 6)
        cache = FeatureCache(Path(tmp) / "features.db")
        t0 = time.perf_counter()
        features_of(kept, model.backbone.spec.ident, model.encode, cache, content_keys(kept))
        extract = len(kept) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        features_of(kept, model.backbone.spec.ident, model.encode, cache, content_keys(kept))
        cached = len(kept) / (time.perf_counter() - t0)
        cache.close()
        photos = {}
        if a.photos:
            width, height = (int(v) for v in a.photo_size.lower().split("x"))
            write_photos(Path(tmp) / "photos", a.photos, (width, height))
            full, reduced = decode_rate(Path(tmp) / "photos", a.size, full=True), decode_rate(Path(tmp) / "photos", a.size, full=False)
            photos = {"photos": a.photos, "photo_size": a.photo_size, "photo_full_decode_img_s": full, "photo_draft_decode_img_s": reduced,
                      "photo_draft_over_full": reduced / full}
    out = {"images": a.images, "size": a.size, "decode_once_img_s": first_pass, "epoch_in_memory_img_s": in_memory,
           "epoch_streamed_img_s": from_disk, "streamed_over_in_memory": from_disk / in_memory,
           "backbone_features_img_s": extract, "cached_features_img_s": cached, "cached_over_extraction": cached / extract, **photos}
    print(json.dumps(out))
    print(f"decode once {first_pass:.0f} img/s | epoch in memory {in_memory:.0f} img/s, streamed {from_disk:.0f} img/s "
          f"(streamed/in-memory {from_disk / in_memory:.3f}) | backbone features {extract:.0f} img/s once, then {cached:.0f} img/s "
          f"from the cache ({cached / extract:.0f}x)")
    if photos:
        print(f"{a.photos} JPEG photographs of {a.photo_size}: every pixel decoded {photos['photo_full_decode_img_s']:.1f} img/s, at a reduced "
              f"DCT scale {photos['photo_draft_decode_img_s']:.1f} img/s ({photos['photo_draft_over_full']:.1f}x)")


if __name__ == "__main__":
    main()

"""Users' own images: an image-folder layout, one sub-folder per class, read on the edge node."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.data.datasets import ImageDataset
from common.data.synth import DEFAULT_SIZE

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp"})


class DatasetError(ValueError):
    """The data source cannot be used for training; the message says what to fix."""


@dataclass
class FolderReport:
    """What the loader read and what it skipped (with the reason), for logs and health checks."""

    loaded: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _read_image(path: Path, size: int) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        img.load()  # raises on truncated or corrupt files (LOAD_TRUNCATED_IMAGES stays off)
        grey = img.convert("L").resize((size, size), Image.BILINEAR)
    return np.asarray(grey, dtype=np.float32) / 255.0


def _read_or_skip(path: Path, size: int, report: FolderReport) -> np.ndarray | None:
    """The image, or None after noting in ``report`` (and the log) why it could not be read."""
    try:
        return _read_image(path, size)
    except Exception as exc:  # PIL raises several types for bad files
        report.skipped.append((str(path), f"{type(exc).__name__}: {exc}"))
        log.warning("skipping unreadable image %s: %s", path, exc)
        return None


def load_image_folder(
    root: str | Path, size: int = DEFAULT_SIZE, classes: tuple[str, ...] | None = None
) -> tuple[ImageDataset, FolderReport]:
    """Read ``root/<class>/<image>``; unreadable files are logged by name and skipped.

    ``classes`` fixes the label order (the federation's class list); by default the sub-folders
    are taken in sorted order. Raises `DatasetError` for a missing, empty or single-class folder.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"data folder {root} does not exist or is not a directory")
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    classes = tuple(classes) if classes is not None else tuple(found)
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise DatasetError(f"data folder {root} has class folders {unknown} not in the class list {list(classes)}")

    report, images, labels = FolderReport(), [], []
    for label, name in enumerate(classes):
        class_dir = root / name
        if not class_dir.is_dir():
            continue
        for path in sorted(class_dir.iterdir()):
            if path.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            if (image := _read_or_skip(path, size, report)) is not None:
                images.append(image)
                labels.append(label)
    report.loaded = len(images)
    if not images:
        raise DatasetError(f"data folder {root} holds no readable images (expected {root}/<class>/<image>.png)")
    present = sorted({classes[i] for i in labels})
    if len(present) < 2:
        raise DatasetError(
            f"data folder {root} holds images of a single class ({present[0]!r}); "
            "training a classifier needs at least two classes"
        )
    stacked = np.stack(images)[:, None, :, :]
    return ImageDataset(stacked, np.asarray(labels, dtype=np.int64), classes), report


def load_unlabelled_folder(root: str | Path, size: int = DEFAULT_SIZE) -> tuple[np.ndarray, FolderReport]:
    """Every readable image under ``root`` (any depth), as (N, 1, size, size) float32; labels are ignored.

    For the server's distillation proxy set. Unreadable files are logged by name and skipped.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"proxy folder {root} does not exist or is not a directory")
    report, images = FolderReport(), []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES):
        if (image := _read_or_skip(path, size, report)) is not None:
            images.append(image)
    if not images:
        raise DatasetError(f"proxy folder {root} holds no readable images")
    report.loaded = len(images)
    return np.stack(images)[:, None, :, :].astype(np.float32), report

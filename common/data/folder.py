"""Users' own images: an image-folder layout, one sub-folder per class, read on the edge node.

Reading is two steps. `index_image_folder` runs when the agent starts: it maps every sub-folder to a
class of the factory's class list by name (or alias) and lists the files, refusing an unknown folder
name at once. `load_labelled` runs when a run first asks for a given image size and channel count:
it decodes every file once (unreadable ones are skipped and named in the log and the report), leaves out
the copies of one image filed under two classes (`label_conflicts`), keeps the images in memory when they
fit under the memory limit, and otherwise returns a set that decodes batches from disk as training asks
for them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.data.classes import DEFAULT_CLASSES, ClassListError, assign_folders, label_map
from common.data.datasets import ImageDataset, ImageSet, StreamedImages
from common.data.images import DEFAULT_BIT_DEPTH, SUFFIXES, UNREAD_IMAGE_SUFFIXES, ImageError, read_image
from common.data.synth import DEFAULT_SIZE

log = logging.getLogger(__name__)


class _LoggedOnce:
    """What indexing a folder said already, so that an agent that indexes its folder again every round (to see images
    added since) warns about the same HEIF files or loose images once, not every round: a repeat goes to DEBUG, and a
    message that changed (a file more) is logged again. Bounded, thread-safe (the agent indexes off its event loop)."""

    def __init__(self, capacity: int = 256) -> None:
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._capacity, self._lock = capacity, threading.Lock()

    def __call__(self, level: int, msg: str, *args: object) -> None:
        text = msg % args if args else msg
        with self._lock:
            repeat = text in self._seen
            self._seen[text] = None
            self._seen.move_to_end(text)
            while len(self._seen) > self._capacity:
                self._seen.popitem(last=False)
        log.log(logging.DEBUG if repeat else level, "%s%s", text, " (as when this folder was indexed before)" if repeat else "")


_log_once = _LoggedOnce()

IMAGE_SUFFIXES = SUFFIXES
TRAIN_NAMES = ("train", "training")  # a factory's training folder, by the names data sets commonly give it
TEST_NAMES = ("test", "val", "valid", "validation", "holdout")  # and its own held-out folder


def folder_key(name: str) -> str:
    """A folder's name as split and reserved names are compared: ``Central-Test``, ``central_test`` and ``central test``
    are one, and so are ``Training`` and ``training``."""
    return "".join(c for c in name.casefold() if c not in "-_ ")


DEFAULT_MEMORY_LIMIT = 2 << 30  # bytes of decoded images kept in memory before a factory streams from disk


class DatasetError(ValueError):
    """The data source cannot be used for training; the message says what to fix."""


@dataclass
class FolderReport:
    """What the loader read and what it skipped (with the reason), for logs and health checks."""

    loaded: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    streamed: bool = False


@dataclass(frozen=True)
class FolderIndex:
    """The files of an image folder and the class name of each (folders mapped through aliases)."""

    root: Path
    paths: tuple[Path, ...]
    names: tuple[str, ...]  # class name of each file
    folders: dict[str, str]  # folder name -> class name
    unread: tuple[tuple[Path, str], ...] = ()  # image files in a format not read, each with what to do (`unread_files`)

    def present(self, classes: Sequence[str]) -> tuple[str, ...]:
        """The classes this folder has images of, in the order of ``classes``."""
        have = set(self.names)
        return tuple(c for c in classes if c in have)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in self.names:
            out[name] = out.get(name, 0) + 1
        return out


def image_files(folder: Path) -> list[Path]:
    """The image files under ``folder`` at any depth, sorted (`_walk_images`)."""
    return sorted(_walk_images(folder))


def has_image_files(folder: Path) -> bool:
    """Whether ``folder`` holds an image file at any depth (`image_files`' test), stopping at the first: a layout check
    need not list and sort a whole data set."""
    return next(_walk_images(folder), None) is not None


def _walk_images(folder: Path) -> Iterator[Path]:
    """The image files under ``folder``, in no set order (`_walk_files` of a suffix in `SUFFIXES`)."""
    return (path for path in _walk_files(folder) if path.suffix.lower() in SUFFIXES)


def _walk_files(folder: Path) -> Iterator[Path]:
    """The files under ``folder``, in no set order.

    - Files and folders starting with ``.`` are never read: macOS writes ``._name.jpg`` resource forks beside copied
      images, and tools keep ``.thumbnails/`` or ``.cache/`` inside.
    - Linked folders are followed (``good/line-2 -> /mnt/nas/line-2``, as data sets curated by links are), each real
      folder once, so a link to a folder above cannot loop; ``Path.rglob`` of Python 3.11 skips them, and their images
      were silently left out."""
    seen: set[str] = set()
    for top, folders, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            folders[:] = []
            continue
        seen.add(real)
        folders[:] = sorted(d for d in folders if not d.startswith("."))
        for name in files:
            if not name.startswith(".") and (path := Path(top) / name).is_file():
                yield path


def _is_image_file(path: Path) -> bool:
    return not path.name.startswith(".") and path.suffix.lower() in SUFFIXES and path.is_file()


UNREAD_FORMAT = "a format FedForge does not read"
UNREAD_ADVICE = f"{UNREAD_FORMAT}: convert it to PNG, JPEG or TIFF"  # each such file's reason for being left out


@dataclass(frozen=True)
class UnreadFiles:
    """The files of a folder that are not read as images (`unread_files`): those in an image format FedForge does not read
    (`UNREAD_IMAGE_SUFFIXES`: a phone's HEIF, a camera's raw files) and any others (notes, annotations, exports)."""

    images: tuple[Path, ...] = ()
    others: tuple[Path, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.images or self.others)

    def describe(self, root: Path) -> str:
        """``"12 files are not read: .heic 10 (e.g. scratch/IMG_0001.heic), .txt 2"``, paths relative to ``root``."""
        by_suffix: dict[str, list[Path]] = {}
        for path in (*self.images, *self.others):
            by_suffix.setdefault(path.suffix.lower() or "(no suffix)", []).append(path)
        parts = [f"{suffix} {len(paths)} (e.g. {_relative(paths[0], root)})"
                 for suffix, paths in sorted(by_suffix.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
        n = len(self.images) + len(self.others)
        return f"{n} file{'s are' if n != 1 else ' is'} not read: {', '.join(parts)}"


def _relative(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def unread_files(folder: Path) -> UnreadFiles:
    """The files under ``folder`` (any depth, as `image_files` walks) that it does not read as images, sorted (`scan_folder`)."""
    return scan_folder(folder)[1]


def scan_folder(folder: Path) -> tuple[list[Path], UnreadFiles]:
    """`image_files` and `unread_files` of ``folder`` from one walk of it (a data set's folders are walked once at start).

    Why the files not read are kept: a class folder whose camera writes ``.heic`` or raw files (or images under a suffix
    outside `SUFFIXES`) would otherwise train the federation without those images, or without the class, and say nothing."""
    images, unread_images, others = [], [], []
    for path in sorted(_walk_files(folder)):
        suffix = path.suffix.lower()
        if suffix in SUFFIXES:
            images.append(path)
        else:
            (unread_images if suffix in UNREAD_IMAGE_SUFFIXES else others).append(path)
    return images, UnreadFiles(tuple(unread_images), tuple(others))


def _report_unread(root: Path, unread: UnreadFiles, what: str = "data folder") -> None:
    """Log what ``root`` holds that is not read: a warning when image files are among them (their images are lost to
    training until converted), else a note (side files are common and harmless); each once while it stays so (`_LoggedOnce`)."""
    if unread.images:
        _log_once(logging.WARNING, "%s %s: %s; the %d image files among them are in %s: convert them to PNG, JPEG or TIFF", what, root,
                  unread.describe(root), len(unread.images), UNREAD_FORMAT)
    elif unread.others:
        _log_once(logging.INFO, "%s %s: %s (formats read: %s)", what, root, unread.describe(root), " ".join(sorted(SUFFIXES)))


def index_image_folder(root: str | Path, classes: Sequence[str] = DEFAULT_CLASSES, aliases: Mapping[str, str] | None = None) -> FolderIndex:
    """List ``root/<folder>/<image>`` and map each folder to a class of ``classes`` by name or alias.

    Raises `DatasetError` for a missing folder, a folder name that fits no class (naming it and the
    list) or a folder without any image file. A class without a folder is fine, and so is a single class.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"data folder {root} does not exist or is not a directory")
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    try:
        mapping = assign_folders(folders, classes, aliases or {}, where=f"data folder {root}")
    except ClassListError as exc:
        train_keys, test_keys = {folder_key(n) for n in TRAIN_NAMES}, {folder_key(n) for n in TEST_NAMES}
        if splits := [f for f in folders if folder_key(f) in train_keys | test_keys]:
            train = next((f for f in splits if folder_key(f) in train_keys), splits[0])
            raise DatasetError(f"data folder {root} holds {splits}, which look like a data set's splits, not classes: give the folder "
                               f"of class folders, e.g. {root / train} (a factory holds out its own share of it for evaluation)") from None
        raise DatasetError(str(exc)) from None
    loose = [p.name for p in root.iterdir() if _is_image_file(p)]
    if loose:
        _log_once(logging.WARNING, "data folder %s: %d images outside any class folder are ignored (e.g. %s)", root, len(loose), loose[0])
    paths, names, unread_images, others = [], [], [], []
    for folder in folders:
        images, not_read = scan_folder(root / folder)
        if not images and not_read:
            _log_once(logging.WARNING, "data folder %s: class folder %r holds no image file it reads, so class %r gets no images from it: %s",
                      root, folder, mapping[folder], not_read.describe(root))
        paths.extend(images)
        names.extend([mapping[folder]] * len(images))
        unread_images.extend(not_read.images)
        others.extend(not_read.others)
    unread = UnreadFiles(tuple(unread_images), tuple(others))
    if not paths:
        raise DatasetError(f"data folder {root} holds no image files (expected {root}/<class>/<image>.png; formats {sorted(SUFFIXES)})"
                           + (f"; {unread.describe(root)}" if unread else ""))
    _report_unread(root, unread)
    return FolderIndex(root, tuple(paths), tuple(names), mapping, tuple((path, UNREAD_ADVICE) for path in unread.images))


def bit_depth_hint(brightest: float, bit_depth: int) -> str:
    """What to set when no pixel of a folder read at 16 bits reaches 1/16 of the range ('' otherwise): its files are most
    likely a 10- or 12-bit camera's, written into the low bits of 16 (`common.data.images`), and read dark. (A 14-bit
    camera's reach a quarter of the range, as a dim 16-bit image may: not flagged.)"""
    raw = brightest * (2**16 - 1)
    bits = next((b for b in (10, 12) if raw <= 2**b - 1 + 0.5), None) if bit_depth == 16 and brightest > 0 else None
    if bits is None:
        return ""
    return (f"no pixel of its images exceeds {raw:.0f} of 65535: a {bits}-bit camera's 16-bit files? then set --bit-depth {bits} at the "
            f"factory (data-bit-depth for the central site's folders); read as 16 bits they are dark")


def load_labelled(index: FolderIndex, classes: Sequence[str], size: int = DEFAULT_SIZE, channels: int = 1,
                  memory_limit: int = DEFAULT_MEMORY_LIMIT, bit_depth: int = DEFAULT_BIT_DEPTH) -> tuple[ImageSet, FolderReport]:
    """Decode the indexed images at ``size`` x ``size`` with ``channels`` (16-bit grey ones as ``bit_depth`` bits), labelled
    by name in ``classes``.

    Every file is decoded once here (so an unreadable one is found now, named and skipped); the
    images are kept when they fit in ``memory_limit`` bytes, else the set streams them from disk.
    """
    try:
        labels_of = label_map(sorted(set(index.names)), classes, where=f"data folder {index.root}")
    except ClassListError as exc:
        raise DatasetError(str(exc)) from None
    streamed = len(index.paths) * channels * size * size * 4 > memory_limit
    report = FolderReport(streamed=streamed)
    report.skipped.extend((str(path), reason) for path, reason in index.unread)
    conflicts = label_conflicts(index)
    if conflicts:
        path, reason = next(iter(conflicts.items()))
        log.warning("data folder %s: %d files are copies of one image filed under two or more classes; they are left out until the "
                    "wrong copies are deleted (e.g. %s: %s)", index.root, len(conflicts), path, reason)
    kept: list[np.ndarray] = []
    good_paths: list[Path] = []
    labels: list[int] = []
    brightest = 0.0
    for path, name in zip(index.paths, index.names):
        if path in conflicts:
            report.skipped.append((str(path), conflicts[path]))
            continue
        try:
            image = read_image(path, size, channels, bit_depth)
        except ImageError as exc:
            report.skipped.append((str(path), str(exc)))
            log.warning("skipping unreadable image %s", exc)
            continue
        good_paths.append(path)
        labels.append(labels_of[name])
        brightest = max(brightest, float(image.max()))
        if not streamed:
            kept.append(image)
    report.loaded = len(labels)
    if not labels:
        raise DatasetError(f"data folder {index.root} holds no usable images ({len(report.skipped)} unreadable, filed under two classes or in a "
                           "format not read)")
    if hint := bit_depth_hint(brightest, bit_depth):
        log.warning("data folder %s: %s", index.root, hint)
    label_array = np.asarray(labels, dtype=np.int64)
    if streamed:
        log.info("data folder %s: %d images (%.0f MB decoded) exceed the memory limit of %.0f MB; streaming from disk",
                 index.root, len(labels), len(labels) * channels * size * size * 4 / 1e6, memory_limit / 1e6)
        return StreamedImages(tuple(good_paths), label_array, tuple(classes), size, channels, bit_depth), report
    return ImageDataset(np.stack(kept), label_array, tuple(classes)), report


def label_conflicts(index: FolderIndex) -> dict[Path, str]:
    """The files whose exact bytes also lie under another class of ``index``, each with the reason it is left out.

    An image copied into a second class folder (an operator's copy instead of a move, an export run twice with other
    labels) would train the model on one image with two labels and could be scored against the one it did not learn.
    Which label is right only the factory can say, so every copy is left out, each named with the others, until the
    wrong ones are deleted. Copies within one class are left as they are. Files are compared by size first, and only
    files of a size seen under two classes are read and hashed (SHA-256); an unreadable file is left to decoding to name."""
    by_size: dict[int, list[tuple[Path, str]]] = {}
    for path, name in zip(index.paths, index.names):
        try:
            by_size.setdefault(path.stat().st_size, []).append((path, name))
        except OSError:
            continue
    by_digest: dict[str, list[tuple[Path, str]]] = {}
    for files in by_size.values():
        if len({name for _, name in files}) < 2:
            continue
        for path, name in files:
            try:
                by_digest.setdefault(hashlib.sha256(path.read_bytes()).hexdigest(), []).append((path, name))
            except OSError:
                continue
    out: dict[Path, str] = {}
    for copies in by_digest.values():
        if len({name for _, name in copies}) < 2:
            continue
        for path, name in copies:
            others = ", ".join(f"{p.relative_to(index.root).as_posix()} ({n})" for p, n in copies if p != path)
            out[path] = f"the same image as {others}: filed as {name} and as another class, so no copy is used; delete the wrong ones"
    return out


def load_image_folder(root: str | Path, size: int = DEFAULT_SIZE, classes: Sequence[str] | None = None, channels: int = 1,
                      aliases: Mapping[str, str] | None = None, memory_limit: int = DEFAULT_MEMORY_LIMIT,
                      bit_depth: int = DEFAULT_BIT_DEPTH) -> tuple[ImageSet, FolderReport]:
    """Index and load a labelled folder in one step (the server's test and validation folders, tests)."""
    classes = tuple(classes) if classes is not None else DEFAULT_CLASSES
    return load_labelled(index_image_folder(root, classes, aliases), classes, size, channels, memory_limit, bit_depth)


def load_unlabelled_folder(root: str | Path, size: int = DEFAULT_SIZE, channels: int = 1,
                           bit_depth: int = DEFAULT_BIT_DEPTH) -> tuple[np.ndarray, FolderReport]:
    """Every readable image under ``root`` (any depth, `image_files`), as (N, channels, size, size) float32; labels are ignored.

    For the server's distillation proxy set. Unreadable files are logged by name and skipped.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"proxy folder {root} does not exist or is not a directory")
    report, images = FolderReport(), []
    paths, unread = scan_folder(root)
    _report_unread(root, unread, "proxy folder")
    report.skipped.extend((str(path), UNREAD_ADVICE) for path in unread.images)
    for path in paths:
        try:
            images.append(read_image(path, size, channels, bit_depth))
        except ImageError as exc:
            report.skipped.append((str(path), str(exc)))
            log.warning("skipping unreadable image %s", exc)
    if not images:
        raise DatasetError(f"proxy folder {root} holds no readable images" + (f"; {unread.describe(root)}" if unread else ""))
    if hint := bit_depth_hint(max(float(image.max()) for image in images), bit_depth):
        log.warning("proxy folder %s: %s", root, hint)
    report.loaded = len(images)
    return np.stack(images).astype(np.float32), report
